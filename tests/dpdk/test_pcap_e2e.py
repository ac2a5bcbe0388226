"""The DPDK switch end to end on pcap ports: exact sums, and byte-for-byte agreement
with the reference aggregator (dataplane/reference.py) on random mixed traffic."""
import numpy as np
import pytest

from dataplane.config import Route
from dataplane.reference import ReferenceSwitch
from dataplane.dpdk_runner import run_pcap
from host.packets import TYPE_RESULT, parse_frame

from . import streams


def reference_run(cfg, batches, port_rates=None):
    ref = ReferenceSwitch(cfg, port_rates, clock=lambda: 0.0)
    out = {}
    for batch in batches:
        for port, frame in batch:
            for egress, f in ref.process(port, frame, now=0.0):
                out.setdefault(egress, []).append(f)
        for egress, f in ref.drain():
            out.setdefault(egress, []).append(f)
    return out, ref.counters()


def test_rounds_of_1024_values_sum_exactly(switch_bin):
    """4 workers x 8 slots x 3 rounds of 1024 values: every result equals numpy."""
    rng = np.random.default_rng(1)
    cfg = streams.config(n_workers=4, pool_size=8)
    frames, sums = streams.rounds_stream(cfg, n_rounds=3, values=1024, rng=rng)
    out, stats = run_pcap(cfg, [frames])
    job = stats["jobs"]["1"]
    assert job["aggregated"] == len(frames) == 96
    assert job["results_multicast"] == 24
    for m in cfg.jobs[0].members:
        results = [parse_frame(f) for f in out[m.port]]
        assert len(results) == 24
        for p in results:
            assert p.ptype == TYPE_RESULT and p.ip_checksum_ok
            h = p.header
            assert int(h["worker"]) == m.worker and int(h["count"]) == 4
            assert int(h["contributors"]) == 0b1111 and int(h["num_values"]) == 1024
            got = np.frombuffer(p.payload, np.uint8)
            np.testing.assert_array_equal(got, sums[(int(h["slot"]), int(h["round"]))])


@pytest.mark.parametrize("seed", [3, 4])
def test_random_mix_matches_reference_byte_for_byte(switch_bin, seed):
    """Valid, duplicate, obsolete, partial, unsatisfiable, flushed, non-member, forged,
    fragmented, routed (with and without IP options) and mutated frames over two jobs,
    in three runs, one port paused with small DLCP queues: every emitted frame and every
    counter equals the reference's."""
    rng = np.random.default_rng(seed)
    to_paused = Route("10.3.0.0/16", 1, "02:00:00:00:00:d0")    # CE marks IP options
    cfg = streams.config(n_workers=3, pool_size=4, jobs=(1, 2),
                         routes=streams.routes() + (to_paused,), dlcp=streams.small_dlcp())
    batches = [streams.random_mix(cfg, 250, rng) for _ in range(3)]
    rates = {1: 0}
    got, stats = run_pcap(cfg, batches, rates, num_ports=6)
    want, counters = reference_run(cfg, batches, rates)
    for port in range(6):
        assert got.get(port, []) == want.get(port, []), f"port {port} differs"
    assert stats["global"] == counters["global"]
    assert {int(j): c for j, c in stats["jobs"].items()} == counters["jobs"]
    # The mix really exercised the paths it is meant to.
    g, j1 = counters["global"], counters["jobs"][1]
    assert g["forwarded"] and g["drop_not_routable"] and g["drop_bad_length"]
    assert g["drop_fragment"] and g["dlcp_ce_marked"]
    assert j1["results_multicast"] and j1["straggler_notices"] and j1["flushes"]
    assert j1["drop_duplicate"] and j1["drop_not_member"] and j1["drop_bad_slot"]
    assert j1["drop_unsatisfiable"]


def test_ordinary_traffic_follows_the_longest_prefix(switch_bin):
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    cfg = streams.config(n_workers=2, routes=streams.routes())
    dsts = {"10.1.1.9": (3, "02:00:00:00:00:c8"), "10.1.2.9": (5, "02:00:00:00:00:b0"),
            "10.7.0.1": (4, "02:00:00:00:00:a8")}
    frames = [(0, bytes(Ether(src="02:00:00:00:01:01", dst=streams.SWITCH_MAC)
                        / IP(src="10.1.0.1", dst=d, ttl=9) / UDP(sport=5, dport=6)))
              for d in dsts] + [(1, bytes(Ether() / IP(dst="192.168.0.1") / UDP()))]
    out, stats = run_pcap(cfg, [frames], num_ports=6)
    assert stats["global"]["forwarded"] == 3 and stats["global"]["drop_not_routable"] == 1
    for (port, frame), (dst, (egress, mac)) in zip(frames, dsts.items()):
        assert len(out[egress]) == 1
        sent = out[egress][0]
        assert sent[:6] == bytes.fromhex(mac.replace(":", ""))
        assert sent[6:12] == bytes.fromhex(streams.SWITCH_MAC.replace(":", ""))
        assert sent[12:] == frame[12:]          # L2 rewrite only (§7)


def test_tiny_empty_and_jumbo_frames_match_reference(switch_bin):
    """Frames of 0, 1 and 13 bytes, a DATA packet padded past one mbuf (3 KiB) and a
    3 KiB ordinary frame (chained mbufs in DPDK): same outputs and counters."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    cfg = streams.config(n_workers=2, routes=streams.routes())
    m0, m1 = cfg.jobs[0].members
    padded = streams.data_frame(m0, [1] * 1024, job=1, slot=0, round_=0, expected=3)
    jumbo = bytes(Ether(dst=streams.SWITCH_MAC) / IP(dst="10.1.1.7") / UDP() / (b"j" * 3000))
    frames = [(0, b""), (0, b"\x01"), (0, b"\x00" * 13), (0, padded + b"\x00" * 2000),
              (1, streams.data_frame(m1, [2] * 1024, job=1, slot=0, round_=0, expected=3)),
              (1, jumbo)]
    got, stats = run_pcap(cfg, [frames], num_ports=6)
    want, counters = reference_run(cfg, [frames])
    assert {p: f for p, f in got.items() if f} == want
    assert stats["global"] == counters["global"]
    assert stats["jobs"]["1"]["results_multicast"] == 1 and stats["global"]["forwarded"] == 1


def test_rate_limited_port_delivers_everything_it_admitted(switch_bin):
    """A port served at 2000 packets/s (token bucket, wall clock): the timing is not
    deterministic, so compare what left (as a multiset) and the counters with the
    reference, which holds a rated port's backlog until the end of the run as well."""
    rng = np.random.default_rng(21)
    cfg = streams.config(n_workers=3, pool_size=4)
    frames, _ = streams.rounds_stream(cfg, n_rounds=2, values=40, rng=rng)
    got, stats = run_pcap(cfg, [frames], {0: 2000.0})
    want, counters = reference_run(cfg, [frames], {0: 2000.0})
    assert sorted(got[0]) == sorted(want[0]) and len(got[0]) == 8
    assert got[1] == want[1] and got[2] == want[2]
    assert stats["global"] == counters["global"]
