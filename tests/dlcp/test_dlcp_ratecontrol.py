"""H10: the rate-control state machine, and the sender's pacing on a real socket."""
import numpy as np
import pytest

from host.dlcp.ratecontrol import RateController, RateState
from host.dlcp.transport import DATA_HEADER_LEN, WIRE_OVERHEAD, DlcpReceiver, DlcpSender, LossBounds

LINK = 10e9


def test_h10_starts_at_line_rate():
    rc = RateController(LINK)
    assert rc.rate_bps == LINK and rc.state is RateState.LINE_RATE_START


def test_h10_uncongested_reports_keep_line_rate_in_start_state():
    rc = RateController(LINK)
    for _ in range(5):
        assert rc.on_report(send_bps=9e9, recv_bps=8e9) == LINK
    assert rc.state is RateState.LINE_RATE_START


def test_h10_first_congested_report_halves_and_enters_ca():
    rc = RateController(LINK)
    assert rc.on_report(send_bps=10e9, recv_bps=4.9e9) == LINK / 2
    assert rc.state is RateState.CONG_AVOID


def test_h10_boundary_is_strictly_greater_than_delta():
    rc = RateController(LINK)
    rc.on_report(send_bps=10e9, recv_bps=5e9)       # send == 2*recv: not congested
    assert rc.rate_bps == LINK and rc.state is RateState.LINE_RATE_START


def test_h10_ca_additive_increase_capped_and_halving():
    rc = RateController(LINK)
    rc.on_report(10e9, 1e9)                          # -> 5 Gb/s, CA
    assert rc.on_report(5e9, 4e9) == pytest.approx(5.5e9)
    assert rc.on_report(5.5e9, 5e9) == pytest.approx(6e9)
    assert rc.on_report(6e9, 2e9) == pytest.approx(3e9)   # congested again: halve
    for _ in range(40):
        rc.on_report(1e9, 1e9)
    assert rc.rate_bps == LINK and rc.state is RateState.CONG_AVOID


def test_h10_retransmission_resets_to_line_rate():
    rc = RateController(LINK)
    rc.on_report(10e9, 1e9)
    rc.on_report(5e9, 1e9)
    assert rc.rate_bps == LINK / 4
    assert rc.on_retransmission() == LINK and rc.state is RateState.LINE_RATE_START


def test_h10_floor_and_bad_config():
    rc = RateController(LINK, min_fraction=0.1)
    for _ in range(20):
        rc.on_report(10e9, 0.0)
    assert rc.rate_bps == pytest.approx(1e9)
    with pytest.raises(ValueError, match="link_bps"):
        RateController(0)
    with pytest.raises(ValueError, match="delta"):
        RateController(LINK, delta=0.5)


def test_sender_paces_at_link_rate():
    x = np.ones(35_000, np.float32)                   # 100 full segments
    link = 2e7
    ideal = 100 * (DATA_HEADER_LEN + 1400 + WIRE_OVERHEAD) * 8 / link
    with DlcpReceiver() as r, DlcpSender(r.udp_addr, r.tcp_addr, link_bps=link, rate_control=False,
                                          bounds=LossBounds(0.0, 0.0)) as s:
        st = s.send_tensor(1, x)
        r.wait(1, 10)
    # (a zero-RTT datagram that beat START may be resent once)
    assert st.completion_s >= 0.9 * ideal and 100 <= st.packets_sent <= 102


def test_ecn_echo_counts_as_congestion_only_when_enabled():
    paper = RateController(LINK)
    assert paper.on_report(send_bps=5e9, recv_bps=5e9, ce_fraction=0.9) == LINK   # ignored
    echo = RateController(LINK, ce_threshold=0.1)
    assert echo.on_report(5e9, 5e9, ce_fraction=0.1) == LINK                        # not above
    assert echo.on_report(5e9, 5e9, ce_fraction=0.11) == LINK / 2
    assert echo.state is RateState.CONG_AVOID
    with pytest.raises(ValueError, match="ce_threshold"):
        RateController(LINK, ce_threshold=1.0)


def test_additive_increase_step_is_configurable():
    rc = RateController(LINK, ai_fraction=0.25)
    rc.on_report(10e9, 1e9)
    assert rc.on_report(1e9, 1e9) == pytest.approx(7.5e9)
