"""What the switch holds is sized from its configuration (mbuf pool, rings), and frames up
to the jumbo limit pass whole while longer ones are dropped and counted."""
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from dataplane.config import Dlcp
from dataplane.dpdk_runner import SwitchError, run_pcap
from dataplane.wire import L2L4_LEN

from . import streams


def completions(cfg, n: int) -> list[tuple[int, bytes]]:
    """n completed slots of job 1 (slot k, round 0), every member contributing 4 values."""
    job = cfg.jobs[0]
    templates = [(m, bytearray(streams.data_frame(m, [1, 2, 3, 4], job=1, slot=0, round_=0,
                                                  expected=job.expected_all)))
                 for m in job.members]
    frames = []
    for slot in range(n):
        for m, t in templates:
            t[46:48] = slot.to_bytes(2, "big")          # AGG header: slot
            frames.append((m.port, bytes(t)))
    return frames


def test_paused_ports_hold_every_result_their_queues_admit():
    """Capacity 4096 on four paused ports and 2,500 completions: 10,000 results wait in
    the queues at once (the old fixed pool of 8,191 mbufs ran dry and the run died with
    "port 0 has no more input"); every one of them leaves once the input is done."""
    cfg = streams.config(n_workers=4, pool_size=2500, dlcp=Dlcp(capacity=4096))
    out, stats = run_pcap(cfg, [completions(cfg, 2500)], port_rates={p: 0 for p in range(4)},
                          timeout=300)
    assert stats["jobs"]["1"]["results_multicast"] == 2500
    for p in range(4):
        assert len(out[p]) == 2500
        assert stats["ports"][str(p)]["tx_nombuf"] == 0
    assert stats["global"]["dlcp_buffer_drop"] == 0


def test_a_configuration_whose_queues_cannot_fit_in_memory_is_refused_at_start():
    """Capacity 2^20 per queue on two paused ports would need ~180 GB of mbufs: refused
    before any packet, with the numbers and what to lower."""
    cfg = streams.config(n_workers=2, dlcp=Dlcp(capacity=1 << 20))
    with pytest.raises(SwitchError) as err:
        run_pcap(cfg, [[]], port_rates={0: 0, 1: 0})
    msg = str(err.value)
    assert "exited with 2" in msg and "refusing configuration" in msg
    assert "capacity 1048576" in msg and "lower the DLCP capacity" in msg


def ordinary(size: int, dst: str = "10.2.0.9") -> bytes:
    """An ordinary UDP frame of exactly `size` bytes, routed by streams.routes() to port 4."""
    head = Ether(dst=streams.SWITCH_MAC, src="02:00:00:00:09:01") / IP(src="10.9.0.1", dst=dst) \
        / UDP(sport=1234, dport=4321)
    return bytes(head / Raw((bytes(range(256)) * (size // 256 + 1))[:size - L2L4_LEN]))


def test_jumbo_frames_pass_whole_and_longer_ones_are_dropped_and_counted():
    """pcap ports: ordinary frames of 4000 and 9216 bytes (MTU 9000 with room) leave
    whole, next-hop MACs rewritten; 9217- and 12000-byte frames are dropped and counted
    drop_oversize (docs/protocol.md §4.1) and rx_oversize on their port, not forwarded
    (the old switch forwarded any length)."""
    cfg = streams.config(n_workers=2, routes=streams.routes())
    frames = [ordinary(n) for n in (4000, 9217, 9216, 12000)]
    out, stats = run_pcap(cfg, [[(0, f) for f in frames]], num_ports=6)
    assert [len(f) for f in out[4]] == [4000, 9216]
    for sent, got in zip((frames[0], frames[2]), out[4]):
        assert got[:6] == bytes.fromhex("0200000000a8") and got[12:] == sent[12:]
    assert stats["ports"]["0"]["rx_oversize"] == 2
    assert stats["global"]["drop_oversize"] == 2 and stats["ports"]["0"]["rx"] == len(frames)
    assert stats["global"]["forwarded"] == 2
