"""H4-H9, H11, H12, the per-iteration exchange and the missing-segment policy, on real UDP/TCP
sockets on loopback."""
import socket
import threading
import time

import numpy as np
import pytest

from host.dlcp.marking import DlcpPolicy
from host.netlab.relay import LossyRelay, dlcp_header, dlcp_loss, dlcp_rule
from host.dlcp.transport import (DATA_HEADER, DATA_HEADER_LEN, FLAG_END_MARK, FLAG_RETX, MSG_ANNOUNCE, MSG_END,
                                 WIRE_OVERHEAD, DlcpError, DlcpReceiver, DlcpSender, LossBounds,
                                 TensorToSend, apply_missing_policy, encode_segments, fin_threshold,
                                 frame, segment_bounds, send_order)

from .conftest import RawSender, fin_count, retx_segments

RNG = np.random.default_rng(7)


def grad(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


# --- H4: segmentation ---------------------------------------------------------------
@pytest.mark.parametrize("n,vps", [(1, 350), (349, 350), (350, 350), (351, 350), (10_001, 7)])
def test_h4_segments_cover_tensor_exactly_once(n, vps):
    b = segment_bounds(n, vps)
    cover = np.zeros(n, np.int64)
    for off, length in b:
        assert 1 <= length <= vps
        cover[off:off + length] += 1
    assert (cover == 1).all()
    x = grad(n)
    rows = encode_segments(5, x, vps)
    back = np.concatenate([np.frombuffer(rows[k, DATA_HEADER_LEN:DATA_HEADER_LEN + 4 * length].tobytes(), ">f4")
                           for k, (_, length) in enumerate(b)])
    assert np.array_equal(back.astype(np.float32), x)     # whole values, nothing split


# --- H5: order independence -----------------------------------------------------------
def test_h5_any_permutation_gives_identical_buffer(receiver, raw_sender):
    x = grad(205, 1)
    grams = raw_sender.datagrams(11, x)
    buffers = []
    for trial in range(3):
        tid = 100 + trial
        grams = raw_sender.datagrams(tid, x)
        raw_sender.start(tid, x.size, p=0.0)
        order = np.random.default_rng(trial).permutation(len(grams)) if trial else np.arange(len(grams))
        base = receiver.data_packets
        for k in order:
            raw_sender.send(grams[k])
        raw_sender.settle(until_udp=base + len(grams))
        assert fin_count(raw_sender.messages()) == [len(grams)]
        res = receiver.wait(tid, 5)
        buffers.append(res.values.tobytes())
    assert buffers[0] == buffers[1] == buffers[2]
    assert np.array_equal(np.frombuffer(buffers[0], np.float32), x)


# --- H6: FIN at the first arrival meeting the bound ----------------------------------
@pytest.mark.parametrize("p,n_values", [(0.1, 200), (0.0, 200), (0.25, 95)])
def test_h6_fin_exactly_at_bound(receiver, raw_sender, p, n_values):
    x = grad(n_values, 2)
    grams = raw_sender.datagrams(21, x)
    need = fin_threshold(len(grams), p)
    assert need == int(np.ceil(round((1 - p) * len(grams), 9)))
    raw_sender.start(21, x.size, p)
    for k in range(need - 1):
        raw_sender.send(grams[k])
    raw_sender.send(grams[0])                 # a duplicate must not count
    raw_sender.settle(until_udp=need)
    assert fin_count(raw_sender.messages(0.05)) == []
    raw_sender.send(grams[need - 1])
    raw_sender.settle(until_udp=need + 1)
    assert fin_count(raw_sender.messages()) == [need]
    res = receiver.wait(21, 5)
    assert res.received_at_fin == need and res.duplicates == 1
    assert res.delivered_fraction >= 1 - p


def test_fin_thresholds():
    assert [fin_threshold(10, p) for p in (0, 0.1, 0.15, 0.3, 0.99)] == [10, 9, 9, 7, 1]


# --- H7: retransmission only when needed, exactly the missing ------------------------
def test_h7_stop_requests_exactly_the_missing_segments(receiver, raw_sender):
    x = grad(300, 3)
    grams = raw_sender.datagrams(31, x)          # 30 segments, p = 0.1 -> need 27
    raw_sender.start(31, x.size, 0.1)
    lost = {2, 5, 11, 17, 29}        # 25 of 30 arrive
    for k in range(len(grams)):
        if k not in lost:
            raw_sender.send(grams[k])
    raw_sender.settle(until_udp=len(grams) - len(lost))
    raw_sender.end(31)
    msgs = raw_sender.messages()
    assert fin_count(msgs) == [] and retx_segments(msgs) == [sorted(lost)]
    raw_sender.send(grams[2])                    # 25 -> 26: still short
    raw_sender.settle(until_udp=len(grams) - len(lost) + 1)
    assert raw_sender.messages(0.05) == []
    raw_sender.send(grams[29])                   # 27 = ceil(0.9 * 30): FIN
    assert fin_count(raw_sender.messages()) == [27]
    assert receiver.wait(31, 5).retx_requests == 1


def test_h7_loss_below_bound_never_retransmits(receiver):
    x = grad(35_000, 4)                          # 100 segments
    with LossyRelay(receiver.udp_addr, dlcp_loss(0.03, seed=1)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=2e8, bounds=LossBounds(0.1, 0.1)) as s:
        for it in range(3):
            st = s.send_tensor(40 + it, x, iteration=it)
            res = receiver.wait(40 + it, 10)
            assert st.retx_requests == 0 and st.retransmitted == 0 and (st.sends <= 1).all()
            assert res.delivered_fraction >= 0.9
        assert relay.dropped                     # the relay really lost packets


def test_h7_loss_above_bound_recovers_via_stop_retx(receiver):
    x = grad(35_000, 5)
    with LossyRelay(receiver.udp_addr, dlcp_loss(0.3, seed=2, first_only=True)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=2e8, bounds=LossBounds(0.1, 0.05)) as s:
        st = s.send_tensor(50, x)
        res = receiver.wait(50, 10)
    dropped = {off // 350 for tid, off, flags in map(dlcp_header, relay.dropped)
               if tid == 50 and not flags & FLAG_END_MARK}
    assert len(dropped) > 10 and st.stops >= 1 and st.retx_requests >= 1
    requested = set(st.retx_lists[0])
    assert dropped <= requested                  # every lost segment is asked for ...
    assert requested <= set(np.flatnonzero(st.sends >= 1))
    assert set(np.flatnonzero(st.sends > 1)) <= requested   # ... and only requested ones resent
    assert res.delivered_fraction >= 0.9 and res.received_at_fin >= 90


# --- H8: no timer-driven retransmission -------------------------------------------------
def test_h8_silent_receiver_gets_each_segment_once_then_timeout():
    """A receiver that never answers: the sender must not resend anything on a timer."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.settimeout(0.2)
    listener = socket.create_server(("127.0.0.1", 0))
    conns = []
    threading.Thread(target=lambda: conns.append(listener.accept()), daemon=True).start()
    x = grad(3500, 6)
    with DlcpSender(sink.getsockname(), listener.getsockname(), link_bps=None, timeout_s=0.6) as s:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no STATUS"):
            s.send_tensor(60, x)
        assert time.monotonic() - t0 >= 0.55
    got = []
    try:
        while True:
            got.append(sink.recv(65536))
    except socket.timeout:
        pass
    marks = [g for g in got if g[14] & FLAG_END_MARK]
    # the band's END_MARK (tensors 0..0, after 10 datagrams, 1 marker), repeated before END
    assert marks == [marks[0]] * 2 and len(marks[0]) == DATA_HEADER_LEN
    assert marks[0][4:14] == bytes([0, 0, 0, 0, 0, 1, 0, 0, 0, 10]) and marks[0][15] == 1
    got = [g for g in got if not g[14] & FLAG_END_MARK]
    segs = sorted(int.from_bytes(g[4:8], "big") // 350 for g in got)
    assert segs == list(range(10))               # every segment exactly once, no RETX flag
    assert all(g[14] & FLAG_RETX == 0 for g in got)
    sink.close(), listener.close(), [c.close() for c, _ in conns]


def test_h8_retransmissions_match_requests(receiver):
    x = grad(70_000, 7)
    with LossyRelay(receiver.udp_addr, dlcp_loss(0.4, seed=3)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=2e8, bounds=LossBounds(0.05, 0.0)) as s:
        st = s.send_tensor(70, x)
        receiver.wait(70, 10)
    assert st.retx_requests == len(st.retx_lists) == st.stops - (st.stops - st.retx_requests)
    # a segment is sent at most once per round: first round + one per RETX_REQ naming it
    named = np.zeros(st.num_segments, np.int64)
    for lst in st.retx_lists:
        named[lst] += 1
    assert (st.sends <= 1 + named).all()


# --- H9: zero-RTT, data before START dropped and counted -------------------------------
def test_h9_data_before_start_dropped_and_counted(receiver, raw_sender):
    x = grad(100, 8)
    grams = raw_sender.datagrams(90, x)           # 10 segments
    for k in range(4):
        raw_sender.send(grams[k])
    raw_sender.settle(until_udp=4)
    assert receiver.early_drops == 4
    raw_sender.start(90, x.size, 0.0)
    for k in range(4, 10):
        raw_sender.send(grams[k])
    raw_sender.settle(until_udp=10)
    raw_sender.end(90)
    assert retx_segments(raw_sender.messages()) == [[0, 1, 2, 3]]


def test_h9_zero_rtt_sender_start_after_data(receiver):
    # The ANNOUNCE goes 0.1 s after the data (which takes about 11 ms at this rate): the
    # receiver handles control first when both are pending, so with a 5 ms delay a receiver
    # thread descheduled that long on a loaded machine saw the ANNOUNCE first, no early drop.
    x = grad(35_000, 9)
    with DlcpSender(receiver.udp_addr, receiver.tcp_addr, link_bps=1e8, start_delay_s=0.1,
                    bounds=LossBounds(0.0, 0.0)) as s:
        st = s.send_tensor(91, x)
        res = receiver.wait(91, 10)
    assert receiver.early_drops > 0
    assert st.retx_requests >= 1 and res.received.all()
    assert np.array_equal(res.values, x)


# --- H11: push/pull bounds ---------------------------------------------------------------
def test_h11_pull_bound_not_looser_than_push(receiver):
    with pytest.raises(ValueError, match="p_pull=0.2 > p_push=0.1"):
        LossBounds(p_push=0.1, p_pull=0.2)
    bounds = LossBounds(p_push=0.3, p_pull=0.05)
    x = grad(35_000, 10)
    with DlcpSender(receiver.udp_addr, receiver.tcp_addr, link_bps=None, bounds=bounds) as s:
        s.send_tensor(110, x, stage="push")
        s.send_tensor(111, x, stage="pull")
    push, pull = receiver.wait(110, 10), receiver.wait(111, 10)
    assert (push.stage, push.p, push.need) == ("push", 0.3, 70)
    assert (pull.stage, pull.p, pull.need) == ("pull", 0.05, 95)


# --- H12: send order changes per iteration -------------------------------------------------
def test_h12_send_order_seeded_and_varies_per_iteration():
    orders = [send_order(100, seed=1, tensor_id=3, iteration=i) for i in range(5)]
    for o in orders:
        assert sorted(o) == list(range(100))
    assert len({tuple(o[-10:]) for o in orders}) == 5            # different tails cut
    assert np.array_equal(orders[0], send_order(100, seed=1, tensor_id=3, iteration=0))
    rot = [send_order(10, 0, 0, i, "rotate") for i in range(3)]
    assert len({tuple(r) for r in rot}) == 3
    with pytest.raises(ValueError, match="segment order"):
        send_order(10, 0, 0, 0, "backwards")


def test_h12_fin_cut_segments_differ_across_iterations(receiver):
    x = grad(35_000, 11)
    missing = []
    with DlcpSender(receiver.udp_addr, receiver.tcp_addr, link_bps=5e7,
                    bounds=LossBounds(0.3, 0.3)) as s:
        for it in range(2):
            s.send_tensor(120 + it, x, iteration=it)
            missing.append(frozenset(np.flatnonzero(~receiver.wait(120 + it, 10).received)))
    assert missing[0] != missing[1] or not missing[0]


# --- marks on the wire, missing policy, bad input -----------------------------------------
def test_retransmissions_are_sent_ect(receiver):
    x = grad(35_000, 14) * 1e-3
    x[350 * 10:] *= 1e3                            # 10 unimportant segments, lost first time
    lost_once = lambda tid, off, length, seq, flags: off < 3500 and not flags & FLAG_RETX
    with LossyRelay(receiver.udp_addr, dlcp_rule(lost_once)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=None, policy=DlcpPolicy(),
                       bounds=LossBounds(0.0, 0.0)) as s:
        st = s.send_tensor(160, x)
        res = receiver.wait(160, 10)
    assert res.received.all() and set(range(10)) <= set(st.retx_lists[0])
    assert (st.tos[:10] & 3 == 0).all()             # marked Not-ECT ...
    # the relay keeps the ToS: Not-ECT arrivals are only the other segments' first sends
    assert receiver.tos_counts.get(32 << 2, 0) == int((st.tos[10:] & 3 == 0).sum())
    not_ect = int((st.tos[10:] & 3 == 0).sum())
    assert receiver.tos_counts.get(32 << 2 | 2, 0) == int(st.sends.sum()) - 10 - not_ect
def test_marks_reach_the_receiver_in_the_tos_byte(receiver):
    x = grad(35_000, 12)
    x[:350 * 30] *= 1e-3                              # 30 unimportant segments
    with DlcpSender(receiver.udp_addr, receiver.tcp_addr, link_bps=None, policy=DlcpPolicy(),
                    bounds=LossBounds(0.0, 0.0), retx_important=False) as s:
        st = s.send_tensor(130, x, layer=9, num_layers=10)
        receiver.wait(130, 10)
    band6 = 38 << 2
    assert (st.tos[:30] == band6).all() and (st.tos[30:] == band6 | 0b10).all()
    # every datagram arrives with the ToS it was sent with (a zero-RTT resend counts twice)
    assert receiver.tos_counts == {band6 | 0b10: int(st.sends[30:].sum()), band6: int(st.sends[:30].sum())}


def test_missing_policy_zero_and_own():
    vals = np.arange(10, dtype=np.float32) + 1
    received = np.array([True, False, True, False])
    zero = apply_missing_policy(np.where(np.repeat(received, 3)[:10], vals, 0), received, 3, "zero", None)
    assert zero.tolist() == [1, 2, 3, 0, 0, 0, 7, 8, 9, 0]
    own = -np.ones(10, np.float32)
    filled = apply_missing_policy(zero.copy(), received, 3, "own", own)
    assert filled.tolist() == [1, 2, 3, -1, -1, -1, 7, 8, 9, -1]
    with pytest.raises(ValueError, match="needs the receiver's own"):
        apply_missing_policy(zero.copy(), received, 3, "own", None)


def test_own_policy_end_to_end():
    x = grad(3500, 13)
    own = np.full(3500, 9.0, np.float32)
    with DlcpReceiver(missing_policy="own") as r:
        r.set_own(140, own)
        with LossyRelay(r.udp_addr, dlcp_loss(0.2, seed=4)) as relay, \
                DlcpSender(relay.address, r.tcp_addr, link_bps=None, bounds=LossBounds(0.5, 0.5)) as s:
            s.send_tensor(140, x)
            res = r.wait(140, 10)
    got = np.repeat(res.received, 350)
    assert not res.received.all()
    assert np.array_equal(res.values[got], x[got]) and (res.values[~got] == 9.0).all()


def test_bad_input_refused_and_counted(receiver, raw_sender):
    with pytest.raises(ValueError, match="NaN"):
        DlcpSender(receiver.udp_addr, receiver.tcp_addr).send_tensor(1, np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="missing_policy"):
        DlcpReceiver(missing_policy="average")
    raw_sender.start(150, 100, 0.0)
    raw_sender.send(b"\x00" * 7)                                  # too short
    good = raw_sender.datagrams(150, grad(100))
    raw_sender.send(good[0][:-4])                                 # length field disagrees
    time.sleep(0.1)
    assert receiver.malformed == 2
    small = DlcpReceiver(max_values=1000)
    with small, DlcpSender(small.udp_addr, small.tcp_addr) as s:
        with pytest.raises(DlcpError, match="raise max_values"):
            s.send_tensor(151, grad(5000))


# --- the per-iteration exchange -------------------------------------------------------------
def layer_tensors(first_id, sizes, seed=0):
    return [TensorToSend(first_id + k, grad(n, seed + k), k) for k, n in enumerate(sizes)]


def test_one_control_exchange_per_iteration(receiver):
    """20 tensors: one ANNOUNCE, at most one END, one STATUS per iteration, not 4 per tensor."""
    sizes = [350 * k + 17 for k in range(1, 21)]
    with DlcpSender(receiver.udp_addr, receiver.tcp_addr, link_bps=2e8, policy=DlcpPolicy(),
                    bounds=LossBounds(0.1, 0.1)) as s:
        for it in range(2):
            tensors = layer_tensors(1000 * (it + 1), sizes, seed=it)
            stats = s.send_iteration(tensors, num_layers=20, iteration=it)
            for t, st in zip(tensors, stats):
                res = receiver.wait(t.tensor_id, 5)
                got = np.repeat(res.received, 350)[:t.values.size]
                assert np.array_equal(res.values[got], t.values[got])
                assert res.delivered_fraction >= 0.9 and st.tensor_id == t.tensor_id
                assert st.retx_requests == 0 and st.first_sent > 0
    counts = receiver.control_counts
    assert counts[MSG_ANNOUNCE] == 2 and counts.get(MSG_END, 0) <= 2
    assert receiver.statuses_sent == 2 and set(counts) <= {MSG_ANNOUNCE, MSG_END}


def test_status_lists_missing_only_below_the_bound(receiver, raw_sender):
    """END's STATUS names only the tensors below their bound, with their missing segments."""
    a, b = grad(100, 20), grad(100, 21)                  # 10 segments each
    key = raw_sender.announce([(500, a.size, 0.2), (501, b.size, 0.2)])
    ga, gb = raw_sender.datagrams(500, a), raw_sender.datagrams(501, b)
    for k in range(10):
        if k not in (3,):                                # a: 9 of 10, within p = 0.2
            raw_sender.send(ga[k])
        if k not in (1, 4, 7):                           # b: 7 of 10, need 8
            raw_sender.send(gb[k])
    raw_sender.settle(until_udp=16)
    raw_sender.end(key, 16)
    (done, entries), = raw_sender.messages()
    assert not done and set(entries) == {501}            # a, within its bound, is not named
    assert entries[501][0] == 7 and entries[501][1].tolist() == [1, 4, 7]
    raw_sender.send(gb[4])                               # b reaches 8: the iteration is done
    (done, entries), = raw_sender.messages()
    assert done and entries[501][0] == 8
    ra, rb = receiver.wait(500, 5), receiver.wait(501, 5)
    assert (ra.retx_requests, rb.retx_requests) == (0, 1)
    assert rb.fin_time >= ra.fin_time and rb.received_at_fin == 8


def test_iteration_under_loss_retransmits_only_for_tensors_below_bound(receiver):
    sizes = [3500, 7000, 350, 35_000]
    with LossyRelay(receiver.udp_addr, dlcp_loss(0.15, seed=5, first_only=True)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=2e8, bounds=LossBounds(0.1, 0.1)) as s:
        tensors = layer_tensors(700, sizes)
        stats = s.send_iteration(tensors)
    for t, st in zip(tensors, stats):
        res = receiver.wait(t.tensor_id, 5)
        assert res.delivered_fraction >= 0.9
        named = np.zeros(st.num_segments, np.int64)
        for lst in st.retx_lists:
            named[lst] += 1
        assert (st.sends <= 1 + named).all()             # resent only when asked
    assert relay.dropped and sum(st.retransmitted for st in stats) > 0
    # a tensor whose first transmission stayed within its bound is never named
    lost = {}
    for tid, off, flags in map(dlcp_header, relay.dropped):
        if not flags & (FLAG_RETX | FLAG_END_MARK):
            lost[tid] = lost.get(tid, 0) + 1
    for t, st in zip(tensors, stats):
        if lost.get(t.tensor_id, 0) <= st.num_segments - fin_threshold(st.num_segments, 0.1):
            assert st.retx_requests == 0
        else:
            assert st.retx_requests >= 1


def test_rate_state_carries_across_tensors_and_iterations(receiver):
    """No restart from line rate: a halved rate paces the next iteration too."""
    link = 4e7
    x = np.ones(35_000, np.float32)                      # 100 full segments
    ideal = 100 * (DATA_HEADER_LEN + 1400 + WIRE_OVERHEAD) * 8 / link
    with DlcpSender(receiver.udp_addr, receiver.tcp_addr, link_bps=link, rate_control=False,
                    bounds=LossBounds(0.0, 0.0)) as s:
        s.rc.on_report(link, link / 4)                  # congested: rate halves
        assert s.rc.rate_bps == link / 2
        t = time.monotonic()
        s.send_iteration([TensorToSend(800, x), TensorToSend(801, x)], iteration=0)
        first = time.monotonic() - t
        t = time.monotonic()
        s.send_tensor(802, x, iteration=1)
        second = time.monotonic() - t
    for tid in (800, 801, 802):
        receiver.wait(tid, 5)
    assert s.rc.rate_bps == link / 2
    assert first >= 0.9 * 2 * 2 * ideal and second >= 0.9 * 2 * ideal


def test_a_receiver_that_dies_fails_its_senders_at_once_with_the_cause():
    """An exception in the receiver's event loop (here injected into its rate reports once
    the iteration is registered) is not a silent stall: the sender mid-iteration gets an
    ERROR naming it and raises at once, not after its timeout; wait() raises with it; a
    later ANNOUNCE finds the connection closed, and a new sender cannot connect."""
    reports = DlcpReceiver._send_rate_reports

    def broken_reports(now):
        if r._iterations:
            raise RuntimeError("injected fault in the rate reports")
        reports(r, now)

    x = np.ones(350_000, np.float32)                     # 1000 segments: still sending
    with DlcpReceiver(report_period_s=0.001) as r, \
            DlcpSender(r.udp_addr, r.tcp_addr, link_bps=2e8, bounds=LossBounds(0.0, 0.0),
                       timeout_s=60) as s:
        r._send_rate_reports = broken_reports
        t = time.monotonic()
        with pytest.raises(DlcpError, match="injected fault"):
            s.send_iteration([TensorToSend(900, x)], iteration=0)
        assert time.monotonic() - t < 5
        with pytest.raises(DlcpError, match="receiver stopped.*injected fault"):
            r.wait(900, 5)
        with pytest.raises(DlcpError, match="closed"):
            s.send_iteration([TensorToSend(901, x)], iteration=1)
        with pytest.raises(OSError):
            DlcpSender(r.udp_addr, r.tcp_addr)


def test_announce_refusals_and_malformed_control(receiver, raw_sender):
    with pytest.raises(ValueError, match="distinct"):
        DlcpSender(receiver.udp_addr, receiver.tcp_addr).send_iteration(
            [TensorToSend(1, grad(10)), TensorToSend(1, grad(10))])
    raw_sender.ctrl.sendall(frame(MSG_ANNOUNCE, b"\x00\x00\x00\x07\x00\x00\x00\x05"))  # 5 entries promised, none there
    raw_sender.ctrl.sendall(frame(99, b"\x00\x00\x00\x01"))
    time.sleep(0.1)
    assert receiver.malformed_control == 2
    raw_sender.start(600, 100, 0.0)
    with DlcpSender(receiver.udp_addr, receiver.tcp_addr) as s:
        with pytest.raises(DlcpError, match="already in transfer"):
            s.send_iteration([TensorToSend(601, grad(10)), TensorToSend(600, grad(10))])


@pytest.mark.parametrize("batched", [True, False])
def test_datagram_core_reports_each_datagrams_tos(batched):
    """host.datagram: recvmmsg (or the recvmsg loop) with IP_RECVTOS, per datagram."""
    from host.datagram import DatagramSocket, PacketRows, mmsg_available
    if batched and not mmsg_available():
        pytest.skip("sendmmsg/recvmmsg not available here")
    rx_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx_sock.bind(("127.0.0.1", 0))
    tx_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx_sock.connect(rx_sock.getsockname())
    rx = DatagramSocket(rx_sock, rx_rows=16, rx_width=64, batched=batched, rx_tos=True)
    tx = DatagramSocket(tx_sock, rx_rows=1, rx_width=16, batched=batched)
    tos = np.array([0x80, 0x82, 0x00, 0xC0, 0x9A, 0x81], np.uint8)
    rows = np.arange(6 * 20, dtype=np.uint8).reshape(6, 20)
    tx.send(PacketRows(rows, np.full(6, 20), tos), np.arange(6))
    time.sleep(0.05)
    n = rx.receive()
    assert n == 6 and rx.rx_tos[:n].tolist() == tos.tolist()
    assert (rx.rx_len[:n] == 20).all() and np.array_equal(rx.rx[:n, :20], rows)
    tx.send(PacketRows(rows, np.full(6, 20), np.full(6, 0x88, np.uint8)), np.arange(2))
    time.sleep(0.05)
    assert rx.receive() == 2 and rx.rx_tos[:2].tolist() == [0x88, 0x88]   # setsockopt path
    rx_sock.close(), tx_sock.close()


def test_deficit_only_resends_meet_the_bound(receiver):
    """retx_extra: a STATUS lists every missing segment, the sender resends only what the
    bound needs (plus the margin), and the tensor still completes within its bound."""
    x = grad(35_000, 30)                                 # 100 segments, p = 0.1 -> need 90
    lost_first = lambda tid, off, length, seq, flags: (off // 350) % 4 == 0 and not flags & FLAG_RETX
    with LossyRelay(receiver.udp_addr, dlcp_rule(lost_first)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=None, bounds=LossBounds(0.1, 0.1),
                       retx_extra=0.0) as s:
        st = s.send_tensor(900, x)
        res = receiver.wait(900, 5)
    assert len(st.retx_lists[0]) == 25                   # all 25 lost segments listed ...
    assert st.retransmitted == 90 - 75                   # ... 15 resent: exactly the deficit
    assert res.received.sum() == 90 and res.delivered_fraction >= 0.9
    with pytest.raises(ValueError, match="retx_extra"):
        DlcpSender(receiver.udp_addr, receiver.tcp_addr, retx_extra=-1)


def test_finished_tensor_memory_is_bounded():
    """A receiver remembers the newest `finished_memory` finished tensor ids (their stray
    datagrams count as late); ids grow with the iteration, so older ones are forgotten and
    a stray datagram of one counts as an early drop."""
    with pytest.raises(ValueError, match="finished_memory"):
        DlcpReceiver(finished_memory=0)
    with DlcpReceiver(report_period_s=0.001, finished_memory=2) as r:
        raw = RawSender(r)

        def send_all(grams):        # counts taken before sending: the receiver runs meanwhile
            seen = r.data_packets + r.early_drops + r.late_packets
            for g in grams:
                raw.send(g)
            raw.settle(until_udp=seen + len(grams))

        try:
            x = grad(100, 12)
            strays = {}
            for tid in (201, 202, 203):
                grams = raw.datagrams(tid, x)
                raw.start(tid, x.size, 0.0)
                send_all(grams)
                raw.end(tid, len(grams))
                assert np.array_equal(r.wait(tid, timeout=5).values, x)
                strays[tid] = grams[0]
            send_all([strays[203]])                # remembered: late
            assert (r.late_packets, r.early_drops) == (1, 0)
            send_all([strays[201]])                # forgotten: as if never announced
            assert (r.late_packets, r.early_drops) == (1, 1)
        finally:
            raw.close()


# --- per-band END: a band's STATUS when that band has passed ---------------------------------
def band_mark(key, first, count, sent, markers=1):
    """A band section's END_MARK: tensors [first, first + count) of the iteration, sent
    after `sent` datagrams, one of `markers` (one per DSCP the section used)."""
    return DATA_HEADER.pack(key, first, count, sent, FLAG_END_MARK, markers)


def test_band_status_is_sent_when_that_band_ends(receiver, raw_sender):
    """The back band's marker is in: STATUS names its missing segments at once, without
    END and before any datagram of the next band was sent."""
    a, b = grad(100, 40), grad(100, 41)                  # 10 segments each, p = 0.2: need 8
    key = raw_sender.announce([(700, a.size, 0.2), (701, b.size, 0.2)])
    ga, gb = raw_sender.datagrams(700, a), raw_sender.datagrams(701, b)
    for k in (0, 1, 2, 4, 5, 7, 9):                      # a: 7 of 10
        raw_sender.send(ga[k])
    raw_sender.settle(until_udp=7)
    raw_sender.send(band_mark(key, 0, 1, 7))
    (done, entries), = raw_sender.messages()
    assert not done and set(entries) == {700}            # b (nothing of it sent yet) not named
    assert entries[700][0] == 7 and entries[700][1].tolist() == [3, 6, 8]
    assert receiver.control_counts.get(MSG_END, 0) == 0
    raw_sender.send(ga[3])                               # the resend: a reaches its bound
    for g in gb:
        raw_sender.send(g)
    raw_sender.send(band_mark(key, 1, 1, 18))
    assert [done for done, _ in raw_sender.messages()] == [True]
    assert receiver.wait(700, 5).retx_requests == 1 and receiver.wait(701, 5).retx_requests == 0


def test_late_band_is_waited_for_not_asked():
    """END arrives while the back band is still queued (strict priority serves it last):
    nothing is asked for it; its data and marker then complete the iteration."""
    with DlcpReceiver(report_period_s=0.001, stop_drain_s=2.0) as r:
        raw = RawSender(r)
        try:
            a, b = grad(100, 42), grad(100, 43)
            key = raw.announce([(710, a.size, 0.2), (711, b.size, 0.2)])
            ga, gb = raw.datagrams(710, a), raw.datagrams(711, b)
            for g in gb:                                 # the front band overtook the back one
                raw.send(g)
            raw.send(band_mark(key, 1, 1, 20))
            raw.end(key, 20)
            raw.settle(until_udp=10)
            assert raw.messages(0.3) == []               # a is late, not lost
            for k in range(9):                           # a: 9 of 10, within p = 0.2
                raw.send(ga[k])
            raw.send(band_mark(key, 0, 1, 9))
            assert [done for done, _ in raw.messages()] == [True]
            assert r.wait(710, 5).retx_requests == 0 and r.statuses_sent == 1
        finally:
            raw.close()


def test_early_band_is_resent_before_later_bands_finish(receiver):
    """Backprop order: the back layer's band goes first and loses 7 of 20 segments (need 18).
    Its STATUS comes when its marker is in, and the resends leave while the front layer's
    band is still being sent, not after the iteration's END."""
    back, front = grad(7000, 44), grad(350 * 300, 45)     # 20 and 300 segments
    lost_once = lambda tid, off, length, seq, flags: (
        tid == 720 and (off // 350) % 3 == 0 and not flags & (FLAG_RETX | FLAG_END_MARK))
    with LossyRelay(receiver.udp_addr, dlcp_rule(lost_once)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=2e7, policy=DlcpPolicy(),
                       bounds=LossBounds(0.1, 0.1), rate_control=False) as s:
        stats = s.send_iteration([TensorToSend(720, back, 5), TensorToSend(721, front, 0)],
                                 num_layers=6)
        res = receiver.wait(720, 5), receiver.wait(721, 5)
    assert len(relay.dropped) == 7
    back_st, front_st = stats
    assert (back_st.tos >> 2 != front_st.tos[0] >> 2).all()      # two bands, two sections
    assert back_st.retx_requests == 1 and sorted(back_st.retx_lists[0]) == list(range(0, 20, 3))
    resent = back_st.sends > 1
    assert resent.any()
    # every resend left before the front band's last first transmission
    assert back_st.last_seq[resent].max() < front_st.last_seq.max()
    assert front_st.retx_requests == 0 and back_st.stops <= 1
    assert res[0].delivered_fraction >= 0.9 and res[1].delivered_fraction >= 0.9   # the FIN cut


def test_loss_bound_holds_per_band(receiver):
    """Six layers in three bands through 25% random loss of first transmissions: every
    tensor of every band ends within its bound; only tensors below it are named."""
    sizes = [3500, 7000, 1750, 3500, 5250, 3500]
    with LossyRelay(receiver.udp_addr, dlcp_loss(0.25, seed=9, first_only=True)) as relay, \
            DlcpSender(relay.address, receiver.tcp_addr, link_bps=1e8, policy=DlcpPolicy(num_bands=3),
                       bounds=LossBounds(0.1, 0.1), retx_extra=0.25) as s:
        tensors = [TensorToSend(730 + k, grad(n, 50 + k), 5 - k) for k, n in enumerate(sizes)]
        stats = s.send_iteration(tensors, num_layers=6)    # back to front: bands 2, 2, 1, 1, 0, 0
    assert len({int(st.tos[0]) >> 2 for st in stats}) == 3
    lost = {}
    for tid, off, flags in map(dlcp_header, relay.dropped):
        if not flags & (FLAG_RETX | FLAG_END_MARK):
            lost[tid] = lost.get(tid, 0) + 1
    for t, st in zip(tensors, stats):
        res = receiver.wait(t.tensor_id, 5)
        assert res.delivered_fraction >= 0.9 and res.received.sum() >= res.need
        below = lost.get(t.tensor_id, 0) > st.num_segments - res.need
        assert (st.retx_requests >= 1) == below
    assert any(st.retx_requests for st in stats)


def test_lost_band_marker_is_repeated_before_end():
    """The band's only END_MARK is lost (a full buffer): the copy sent before END brings
    the band's STATUS, without waiting out the receiver's idle clock (5 s here)."""
    x = grad(35_000, 46)                                 # 100 segments, p = 0.1: need 90
    markers_seen = []

    def lose(tid, off, length, seq, flags):
        if flags & FLAG_END_MARK:
            markers_seen.append(seq)
            return len(markers_seen) == 1                # the first marker only
        return (off // 350) % 5 == 0 and not flags & FLAG_RETX     # 20 of 100 segments
    with DlcpReceiver(report_period_s=0.001, stop_drain_s=5.0) as r, \
            LossyRelay(r.udp_addr, dlcp_rule(lose)) as relay, \
            DlcpSender(relay.address, r.tcp_addr, link_bps=None, bounds=LossBounds(0.1, 0.1)) as s:
        t = time.monotonic()
        st = s.send_tensor(740, x)
        elapsed = time.monotonic() - t
        res = r.wait(740, 5)
    assert len(relay.dropped) == 21 and markers_seen[0] == markers_seen[1]
    assert st.retx_requests >= 1 and res.delivered_fraction >= 0.9
    assert elapsed < 2.0                                 # not the 5 s idle clock
