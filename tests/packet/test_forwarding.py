"""Per-packet load balancing of ordinary IPv4 traffic (docs/protocol.md §7, DLCP S7).

A route with k equal-cost next hops sprays the packets of ONE 5-tuple round-robin over
them, in their listed order, with one counter per route starting at 0. Every packet
carries its sequence number in the UDP payload, so per egress port the test knows
exactly which packets must arrive, in which order, with which next-hop MAC.
"""
import pytest

from dataplane.config import ConfigError, Route, SwitchConfig
from host.packets import L2L4_LEN, ipv4_checksum, parse_frame
from .scenario import SWITCH_MAC, check_counters, make_config, make_job, raw_frame

SPRAY_3 = Route("10.20.0.0/16", 2, "02:00:00:00:14:02",
                extra_hops=((3, "02:00:00:00:14:03"), (4, "02:00:00:00:14:04")))
SPRAY_2 = Route("10.21.0.0/16", 5, "02:00:00:00:15:05",
                extra_hops=((6, "02:00:00:00:15:06"),))
SINGLE = Route("10.22.0.0/16", 7, "02:00:00:00:16:07")


def flow_packets(src, dst: bytes, count: int, first_seq: int = 0) -> list[tuple[int, bytes]]:
    """`count` UDP packets of one 5-tuple (src member -> dst:53), payload = sequence number."""
    out = []
    for seq in range(first_seq, first_seq + count):
        port, frame = raw_frame(src, seq.to_bytes(4, "big") + bytes(12), dport=53)
        f = bytearray(frame)
        f[30:34] = dst
        f[24:26] = b"\0\0"
        f[24:26] = ipv4_checksum(bytes(f[14:34])).to_bytes(2, "big")
        out.append((port, bytes(f)))
    return out


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame[L2L4_LEN:L2L4_LEN + 4], "big")


def by_port(got) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for port, frame in got:
        out.setdefault(port, []).append(seq_of(frame))
    return out


def check_sprayed(got, sent, route: Route, first_turn: int = 0) -> None:
    """Packet i of `sent` left by next hop (first_turn + i) mod k, rewritten for it, in order."""
    hops = route.next_hops
    k = len(hops)
    sent_by_seq = {seq_of(f): f for _, f in sent}
    seqs = [seq_of(f) for _, f in sent]
    ports = by_port([(p, f) for p, f in got if seq_of(f) in sent_by_seq])
    for turn, (port, mac) in enumerate(hops):
        want = [s for i, s in enumerate(seqs) if (first_turn + i) % k == turn]
        assert ports.get(port, []) == want, f"next hop {turn} (port {port})"
    for port, frame in got:
        seq = seq_of(frame)
        if seq not in sent_by_seq:
            continue
        p = parse_frame(frame)
        assert p.eth_dst == dict(hops)[port] and p.eth_src == SWITCH_MAC
        assert frame[12:] == sent_by_seq[seq][12:], "IPv4 and up unchanged"


@pytest.mark.parametrize("route", [SPRAY_2, SPRAY_3], ids=["k2", "k3"])
def test_one_flow_is_sprayed_round_robin_over_the_next_hops(target, route):
    job = make_job(1, 2)
    target.start(make_config(job, routes=(route,)))
    n = 30
    dst = bytes([10, 20 if route is SPRAY_3 else 21, 1, 1])
    sent = flow_packets(job.members[0], dst, n)
    got = target.run(sent)
    assert len(got) == n
    check_sprayed(got, sent, route)
    k = len(route.next_hops)
    counts = [len(by_port(got).get(port, [])) for port, _ in route.next_hops]
    assert all(abs(c - n / k) < 1 for c in counts), counts     # each within 1/k share
    check_counters(target, glob={"forwarded": n}, jobs={1: {}})


def test_each_route_keeps_its_own_counter_across_runs(target):
    job = make_job(1, 2)
    target.start(make_config(job, routes=(SPRAY_3, SPRAY_2, SINGLE)))
    src = job.members[0]
    a1 = flow_packets(src, bytes([10, 20, 0, 9]), 4)
    b1 = flow_packets(src, bytes([10, 21, 0, 9]), 3, first_seq=100)
    c1 = flow_packets(src, bytes([10, 22, 0, 9]), 3, first_seq=200)
    interleaved = [f for trio in zip(a1, b1, c1) for f in trio] + a1[3:]
    got = target.run(interleaved)
    assert len(got) == 10
    check_sprayed(got, a1, SPRAY_3)
    check_sprayed(got, b1, SPRAY_2)
    check_sprayed(got, c1, SINGLE)           # one next hop: exactly as before
    # The counters persist: route A resumes at turn 4 mod 3 = 1, route B at 3 mod 2 = 1.
    a2 = flow_packets(src, bytes([10, 20, 7, 7]), 5, first_seq=300)
    b2 = flow_packets(src, bytes([10, 21, 7, 7]), 2, first_seq=400)
    got = target.run(a2 + b2)
    check_sprayed(got, a2, SPRAY_3, first_turn=1)
    check_sprayed(got, b2, SPRAY_2, first_turn=1)
    check_counters(target, glob={"forwarded": 17}, jobs={1: {}})


def test_next_hops_round_trip_through_json_and_old_routes_still_load(tmp_path):
    cfg = make_config(make_job(1, 2), routes=(SPRAY_3, SINGLE))
    loaded = SwitchConfig.load(cfg.save(tmp_path / "job.json"))
    assert loaded == cfg and loaded.routes[0].next_hops == SPRAY_3.next_hops
    old = cfg.to_dict()
    del old["routes"][1]["extra_hops"]            # a file written before next hops existed
    assert SwitchConfig.from_dict(old).routes[1] == SINGLE
    assert SINGLE.next_hops == ((7, "02:00:00:00:16:07"),)


@pytest.mark.parametrize("extra, words", [
    (tuple((p, f"02:00:00:00:01:{p:02x}") for p in range(1, 9)), "9 next hops; at most 8"),
    (((600, "02:00:00:00:01:01"),), "next-hop port 600 must be in 0..511"),
    (((1, "02:00:00:00:01"),), "is not of the form"),
])
def test_bad_next_hops_are_refused_with_what_to_change(extra, words):
    route = Route("10.1.0.0/16", 0, "02:00:00:00:01:00", extra_hops=extra)
    with pytest.raises(ConfigError, match=words):
        make_config(make_job(1, 2), routes=(route,)).validate()
