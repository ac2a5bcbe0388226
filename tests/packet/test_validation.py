"""Malformed and foreign input (docs/protocol.md §4.1): dropped, counted, no slot changed.

Each bad packet claims worker 0's place in slot 2 round 0 with values that differ from
the valid ones. If any of them touched the slot, the follow-up valid round would come out
with the wrong sums, a duplicate drop, or no result at all.
"""
import dataclasses

import numpy as np

from dataplane.config import Route
from host.packets import (HEADER_LEN, L2L4_LEN, TYPE_DATA, TYPE_FLUSH, TYPE_RESULT,
                          TYPE_STRAGGLER, ipv4_checksum, parse_frame)
from .scenario import (SWITCH_MAC, check_counters, check_result, data_frames, header_bytes,
                       make_config, make_job, member, outputs, raw_frame, sums_of)

SLOT, VALUES = 2, 6
GARBAGE = bytes([0xFF] * 3)          # 6 values, all index 15


def good_header(**overrides):
    fields = dict(type=TYPE_DATA, job=1, slot=SLOT, worker=0, round=0, expected=0b11,
                  num_values=VALUES, tensor=7)
    fields.update(overrides)
    return header_bytes(**fields)


def with_valid_ip_checksum(frame: bytearray) -> bytes:
    frame[24:26] = b"\0\0"
    frame[24:26] = ipv4_checksum(bytes(frame[14:34])).to_bytes(2, "big")
    return bytes(frame)


def set_ip_total_length(frame: bytes, value: int) -> bytes:
    f = bytearray(frame)
    f[16:18] = value.to_bytes(2, "big")
    return with_valid_ip_checksum(f)


def set_udp_length(frame: bytes, value: int) -> bytes:
    f = bytearray(frame)
    f[38:40] = value.to_bytes(2, "big")
    return set_ip_total_length(bytes(f), 20 + value)


def set_ip_dst(frame: bytes, dst: bytes) -> bytes:
    f = bytearray(frame)
    f[30:34] = dst
    return with_valid_ip_checksum(f)


def spoofed(m, **address):
    """m's frame layout with some of its address fields replaced (a forged source)."""
    return dataclasses.replace(m, **address)


def malformed_cases(m0, m1, stranger, other_job, max_values):
    """(name, expected counter, scope, frame) for every check of §4.1.

    The job (workers 0 and 1) has values_per_packet = VALUES; `other_job` is job 2's
    worker 0, attached to worker 0's switch port."""
    port, frame = raw_frame(m0, good_header() + GARBAGE)
    cases = [
        ("truncated", "drop_truncated", "global", (port, frame[:L2L4_LEN + HEADER_LEN - 1])),
        ("truncated header only", "drop_truncated", "global",
         raw_frame(m0, good_header()[:20])),
        ("version 0", "drop_bad_version", "global",
         raw_frame(m0, good_header(version=0) + GARBAGE)),
        ("version 1", "drop_bad_version", "global",
         raw_frame(m0, good_header(version=1) + GARBAGE)),
        ("version 3", "drop_bad_version", "global",
         raw_frame(m0, good_header(version=3) + GARBAGE)),
        ("type RESULT", "drop_bad_type", "global",
         raw_frame(m0, good_header(type=TYPE_RESULT) + GARBAGE * 2)),
        ("type STRAGGLER", "drop_bad_type", "global",
         raw_frame(m0, good_header(type=TYPE_STRAGGLER, num_values=0))),
        ("type 9", "drop_bad_type", "global", raw_frame(m0, good_header(type=9) + GARBAGE)),
        ("ip length too long", "drop_bad_length", "global",
         (port, set_ip_total_length(frame, 20 + 8 + 32 + 3 + 1))),
        ("udp length beyond frame", "drop_bad_length", "global",
         (port, set_udp_length(frame, 8 + 32 + 3 + 10))),
        ("payload shorter than num_values", "drop_bad_length", "global",
         raw_frame(m0, good_header() + GARBAGE[:2])),
        ("payload longer than num_values", "drop_bad_length", "global",
         raw_frame(m0, good_header() + GARBAGE + b"\xff")),
        ("num_values 0", "drop_bad_length", "global",
         raw_frame(m0, good_header(num_values=0))),
        ("num_values above MAX_VALUES", "drop_bad_length", "global",
         raw_frame(m0, good_header(num_values=max_values + 1)
                   + bytes([0xFF] * ((max_values + 2) // 2)))),
        ("num_values above the job's values_per_packet", "drop_bad_length", "global",
         raw_frame(m0, good_header(num_values=VALUES + 1) + GARBAGE + b"\xf0")),
        ("above values_per_packet and slot beyond pool", "drop_bad_length", "global",
         raw_frame(m0, good_header(num_values=VALUES + 1, slot=16) + GARBAGE + b"\xf0")),
        ("flush with payload", "drop_bad_length", "global",
         raw_frame(m0, good_header(type=TYPE_FLUSH, num_values=0) + GARBAGE)),
        ("unknown job", "drop_unknown_job", "global",
         raw_frame(m0, good_header(job=99) + GARBAGE)),
        ("slot beyond pool", "drop_bad_slot", "job",
         raw_frame(m0, good_header(slot=16) + GARBAGE)),
        ("wrong ingress port", "drop_not_member", "job",
         (1, raw_frame(m0, good_header() + GARBAGE)[1])),
        ("worker not in job", "drop_not_member", "job",
         raw_frame(stranger, good_header(worker=stranger.worker,
                                         expected=0b11 | 1 << stranger.worker) + GARBAGE)),
        ("worker id 40", "drop_not_member", "job",
         raw_frame(m0, good_header(worker=40) + GARBAGE)),
        ("worker 0 from a foreign MAC", "drop_not_member", "job",
         raw_frame(spoofed(m0, mac="02:00:00:00:99:99"), good_header() + GARBAGE)),
        ("worker 0 from a foreign IPv4 source", "drop_not_member", "job",
         raw_frame(spoofed(m0, ip="10.0.1.99"), good_header() + GARBAGE)),
        ("worker 0 from a foreign UDP port", "drop_not_member", "job",
         raw_frame(spoofed(m0, udp_port=m0.udp_port + 50), good_header() + GARBAGE)),
        ("worker 1 posing as worker 0 on its port", "drop_not_member", "job",
         raw_frame(spoofed(m1, port=m0.port), good_header() + GARBAGE)),
        ("job 2's worker 0 posing as job 1's worker 0", "drop_not_member", "job",
         raw_frame(other_job, good_header() + GARBAGE)),
        ("expected 0 and min_count 0", "drop_bad_expected", "job",
         raw_frame(m0, good_header(expected=0) + GARBAGE)),
        ("sender not in expected", "drop_bad_expected", "job",
         raw_frame(m0, good_header(expected=0b10) + GARBAGE)),
        ("sender not in expected, which names a non-member", "drop_bad_expected", "job",
         raw_frame(m0, good_header(expected=0b110) + GARBAGE)),
        ("expected names a non-member", "drop_unsatisfiable", "job",
         raw_frame(m0, good_header(expected=0b111) + GARBAGE)),
        ("min_count above the expected workers", "drop_unsatisfiable", "job",
         raw_frame(m0, good_header(expected=0b11, min_count=3) + GARBAGE)),
        ("min_count above the job's size", "drop_unsatisfiable", "job",
         raw_frame(m0, good_header(expected=0, min_count=3) + GARBAGE)),
        ("flush of a slot beyond pool", "drop_bad_slot", "job",
         raw_frame(m0, good_header(type=TYPE_FLUSH, num_values=0, slot=300))),
        ("flush from a non-member", "drop_not_member", "job",
         raw_frame(stranger, good_header(type=TYPE_FLUSH, num_values=0,
                                         worker=stranger.worker))),
    ]
    return cases


def assert_round_is_exact(target, job, seed: int) -> None:
    """A normal round of job 1's two members in SLOT (after an attack): exact sums to both."""
    m0, m1 = job.members
    idx = np.random.default_rng(seed).integers(0, 15, (2, VALUES))    # never index 15
    frames = (data_frames(m0, idx[0], job=1, slot=SLOT, expected=3, vpp=VALUES)
              + data_frames(m1, idx[1], job=1, slot=SLOT, expected=3, vpp=VALUES))
    got = outputs(target.run(frames))
    assert len(got) == 2
    for m, o in zip(job.members, sorted(got, key=lambda o: o.worker)):
        check_result(o, m, job=1, slot=SLOT, round_=0, sums=sums_of(idx), contributors=3,
                     expected=3)


def test_every_malformed_input_is_dropped_counted_and_changes_no_slot(target):
    job = make_job(1, 2, pool_size=16, values_per_packet=VALUES)
    other = make_job(2, 1, ports=[0])
    target.start(make_config(job, other))
    m0, m1 = job.members
    stranger = member(5, 3, job=1)
    cases = malformed_cases(m0, m1, stranger, other.members[0], target.max_values)
    want_global, want_job = {}, {}
    for name, counter, scope, frame in cases:
        assert target.run([frame]) == [], f"{name}: a dropped packet emits nothing"
        want = want_global if scope == "global" else want_job
        want[counter] = want.get(counter, 0) + 1
        check_counters(target, glob=want_global, jobs={1: want_job, 2: {}})
    assert_round_is_exact(target, job, seed=9)
    check_counters(target, glob=want_global,
                   jobs={1: want_job | dict(rx=2, aggregated=2, results_multicast=1)})


def test_padded_short_frame_is_judged_by_the_udp_length(target):
    """Trailing Ethernet padding is not payload: lengths come from the UDP header (§1)."""
    job = make_job(1, 1)
    target.start(make_config(job))
    m0 = job.members[0]
    port, frame = data_frames(m0, [3], job=1, expected=1, vpp=1)[0]
    got = outputs(target.run([(port, frame + bytes(20))]))
    assert len(got) == 1
    check_result(got[0], m0, job=1, slot=0, round_=0, sums=sums_of([[3]]), contributors=1,
                 expected=1)


def test_foreign_traffic_without_a_route_is_counted_not_routable(target):
    job = make_job(1, 2)
    target.start(make_config(job))
    m0 = job.members[0]
    assert target.run([raw_frame(m0, good_header() + GARBAGE, dport=53)]) == []
    assert target.run([(0, bytes(20))]) == []            # not even an IPv4 header
    check_counters(target, glob={"drop_not_routable": 2}, jobs={1: {}})


def test_ordinary_ipv4_is_forwarded_by_longest_prefix(target):
    job = make_job(1, 2)
    routes = (Route("10.9.0.0/16", 2, "02:00:00:00:09:01"),
              Route("10.9.8.0/24", 3, "02:00:00:00:09:02"))
    target.start(make_config(job, routes=routes))
    port, frame = raw_frame(job.members[0], bytes(40), dport=53)
    to_24 = set_ip_dst(frame, bytes([10, 9, 8, 7]))        # both match: the /24 wins
    to_16 = set_ip_dst(frame, bytes([10, 9, 1, 7]))        # only the /16 matches
    got = target.run([(port, to_24), (port, to_16)])
    assert sorted(p for p, _ in got) == [2, 3]
    for egress, out in got:
        p = parse_frame(out)
        assert p.eth_dst == ("02:00:00:00:09:02" if egress == 3 else "02:00:00:00:09:01")
        assert p.eth_src == SWITCH_MAC
        assert out[12:] == (to_24 if egress == 3 else to_16)[12:], "IPv4 and up unchanged"
    check_counters(target, glob={"forwarded": 2}, jobs={1: {}})


def fragment(frame: bytes, *, more: bool, offset_units: int = 0, dst: bytes | None = None,
             protocol: int | None = None) -> bytes:
    """The frame as an IPv4 fragment: MF flag, fragment offset (8-byte units), and
    optionally another destination or protocol; a valid header checksum."""
    f = bytearray(frame)
    f[20:22] = ((0x2000 if more else 0) | offset_units).to_bytes(2, "big")
    if dst is not None:
        f[30:34] = dst
    if protocol is not None:
        f[23] = protocol
    return with_valid_ip_checksum(f)


def test_fragments_for_the_aggregator_are_dropped_and_others_forwarded(target):
    """§4.1 row 1 (R4): a fragment aimed at the aggregator is drop_fragment and touches no
    slot; a fragment of anything else is ordinary traffic, forwarded untouched."""
    job = make_job(1, 2, pool_size=16)
    routes = (Route("10.9.0.0/16", 2, "02:00:00:00:09:01"),)
    target.start(make_config(job, routes=routes))
    m0, m1 = job.members
    port, data = raw_frame(m0, good_header() + GARBAGE)
    routed = bytes([10, 9, 1, 1])
    _, ordinary = raw_frame(m0, bytes(40), dport=53)
    aimed = {
        "lone first fragment of a DATA": fragment(data, more=True),
        "last fragment to the switch, bytes like UDP + AGG": fragment(data, more=False,
                                                                     offset_units=1),
        "middle fragment to the switch, not UDP": fragment(data, more=True, offset_units=3,
                                                           protocol=6),
        "first fragment to the switch, not an AGG port": fragment(ordinary, more=True),
    }
    for name, frame in aimed.items():
        assert target.run([(port, frame)]) == [], name
    check_counters(target, glob={"drop_fragment": len(aimed)}, jobs={1: {}})

    passing = [fragment(ordinary, more=True, dst=routed),
               fragment(data, more=False, offset_units=1, dst=routed)]
    got = target.run([(port, f) for f in passing])
    assert len(got) == 2 and all(egress == 2 for egress, _ in got)
    for (_, out), sent in zip(got, passing):
        assert out[:6] == bytes.fromhex("020000000901") and out[6:12] == bytes.fromhex(
            SWITCH_MAC.replace(":", ""))
        assert out[12:] == sent[12:], "a forwarded fragment leaves untouched above layer 2"
    check_counters(target, glob={"drop_fragment": len(aimed), "forwarded": 2}, jobs={1: {}})

    assert_round_is_exact(target, job, seed=10)


def padded_to(frame: bytes, size: int) -> bytes:
    """The frame with link padding after its UDP datagram, `size` bytes in all."""
    return frame + bytes(range(256)) * ((size - len(frame)) // 256) + bytes(
        (size - len(frame)) % 256)


def test_frames_over_9216_bytes_are_dropped_first_on_every_plane(target):
    """§4.1 row 1: a frame longer than MAX_FRAME (9216 bytes) is drop_oversize whatever it
    carries, a DATA that would otherwise aggregate included, and touches no slot; a
    9216-byte frame is still taken whole."""
    job = make_job(1, 2, pool_size=16, values_per_packet=VALUES)
    routes = (Route("10.9.0.0/16", 2, "02:00:00:00:09:01"),)
    target.start(make_config(job, routes=routes))
    m0 = job.members[0]
    port, data = raw_frame(m0, good_header() + GARBAGE)
    _, ordinary = raw_frame(m0, bytes(40), dport=53)
    routed = set_ip_dst(ordinary, bytes([10, 9, 1, 1]))
    too_long = [padded_to(data, 9217), padded_to(routed, 9217), padded_to(routed, 12000)]
    assert target.run([(port, f) for f in too_long]) == []
    check_counters(target, glob={"drop_oversize": len(too_long)}, jobs={1: {}})

    longest = padded_to(routed, 9216)
    got = target.run([(port, longest)])
    assert [(egress, len(out)) for egress, out in got] == [(2, 9216)]
    assert got[0][1][12:] == longest[12:]
    check_counters(target, glob={"drop_oversize": len(too_long), "forwarded": 1},
                   jobs={1: {}})

    assert_round_is_exact(target, job, seed=11)
