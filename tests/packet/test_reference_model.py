"""Features of the reference model beyond the shared suite: the simulated clock of the
DLCP service rate (§6), set-up limits (§3) and the CE checksum update (§1)."""
import numpy as np
import pytest

from dataplane.config import ConfigError, Dlcp, Job
from dataplane.reference import ReferenceSwitch, checksum_update
from .scenario import TABLE, data_frames, make_config, make_job, member, outputs, tos_of


def one_worker_switch(port_rates):
    job = make_job(1, 1, pool_size=32, ports=[1])
    return ReferenceSwitch(make_config(job), port_rates, clock=lambda: 0.0), job.members[0]


def result_for(sw, m, slot, tos, now):
    (port, frame), = data_frames(m, [1], job=1, slot=slot, expected=1, vpp=1, tos=tos)
    return outputs(sw.process(port, frame, now=now))


def test_rate_limited_port_sends_one_packet_per_interval_highest_queue_first():
    sw, m = one_worker_switch({1: 10.0})                    # one packet per 0.1 s
    assert [o.slot for o in result_for(sw, m, 0, tos_of(band=6), now=0.0)] == [0]
    assert result_for(sw, m, 1, tos_of(band=6), now=0.01) == []      # port busy until 0.1
    assert result_for(sw, m, 2, tos_of(), now=0.02) == []            # control, queue 7
    assert sw.queue_depths(1) == [1, 0, 0, 0, 0, 0, 0, 1]
    assert [o.slot for o in outputs(sw.advance(0.1))] == [2]          # control overtakes
    assert sw.advance(0.15) == []
    assert [o.slot for o in outputs(sw.advance(0.2))] == [1]
    # Idle since 0.2: a packet arriving at 5.0 leaves at once.
    assert [o.slot for o in result_for(sw, m, 3, tos_of(band=6), now=5.0)] == [3]


def test_paused_port_holds_everything_until_drained():
    sw, m = one_worker_switch({1: 0})
    for slot in range(3):
        assert result_for(sw, m, slot, tos_of(band=slot), now=float(slot)) == []
    assert sw.advance(100.0) == []
    assert [o.slot for o in outputs(sw.drain())] == [0, 1, 2]       # bands 0, 1, 2: queues 6, 5, 4


def test_negative_rate_and_oversized_pool_are_refused():
    job = make_job(1, 2)
    with pytest.raises(ValueError, match="service rate"):
        ReferenceSwitch(make_config(job), {0: -1.0})
    big = Job(1, 70000, TABLE, (member(0, 0),))
    with pytest.raises(ConfigError, match="pool_size"):
        ReferenceSwitch(make_config(big))
    overflow = Job(1, 4, TABLE, tuple(member(w, w) for w in range(9)))    # 9 x 30 > 255
    with pytest.raises(ConfigError, match="overflows the 8-bit"):
        ReferenceSwitch(make_config(overflow))


def test_dlcp_limits_are_inclusive():
    """The largest capacity and threshold of §3 are accepted (the suite checks refusals)."""
    k = (0,) * 7 + ((1 << 32) - 1,)
    sw = ReferenceSwitch(make_config(make_job(1, 2), dlcp=Dlcp(thresholds=k, capacity=1 << 20)))
    assert sw.config.dlcp.capacity == 1 << 20


def test_checksum_update_equals_a_full_recompute_for_any_header():
    """R5: RFC 1624 eqn. 3 on a valid header (any IHL) gives the recomputed checksum."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        ihl = int(rng.integers(5, 16))
        header = bytearray(rng.integers(0, 256, 4 * ihl, dtype=np.uint8).tobytes())
        header[0] = 0x40 | ihl
        header[10:12] = full_checksum(header).to_bytes(2, "big")
        marked = bytearray(header)
        marked[1] |= 3
        incremental = checksum_update(int.from_bytes(header[10:12], "big"),
                                      int.from_bytes(header[0:2], "big"),
                                      int.from_bytes(marked[0:2], "big"))
        assert incremental == full_checksum(marked)


def full_checksum(header: bytes) -> int:
    words = [int.from_bytes(header[i:i + 2], "big") for i in range(0, len(header), 2)]
    total = sum(words) - words[5]
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
