"""The DLCP egress stage (docs/protocol.md §6), every target.

Each DATA below comes from the only member of a one-worker job, so it completes at once
and its RESULT leaves port 1 with the DATA's ToS. Port 1 is paused while the input
arrives, so the queues fill deterministically and then drain in strict priority order
(on BMv2: in rounds, a documented limit of its rate-limited queues; `drain_order`).
"""
from dataplane.config import CONTROL_DSCP, Dlcp, NUM_QUEUES, Route
from host.packets import ipv4_checksum
from .scenario import (ECN_CE, ECN_ECT0, ECN_ECT1, ECN_NOT_ECT, check_counters, data_frames,
                       make_config, make_job, outputs, raw_frame, small_dlcp, tos_of)

PORT = 1


def start_single_worker(target, dlcp):
    job = make_job(1, 1, pool_size=256, ports=[PORT])
    target.start(make_config(job, dlcp=dlcp), port_rates={PORT: 0})
    return job.members[0]


def burst(m, tos_list):
    """One single-value DATA per ToS, slot k for the k-th (so outputs name their input)."""
    frames = []
    for k, tos in enumerate(tos_list):
        frames += data_frames(m, [k % 16], job=1, slot=k, expected=1, vpp=1, tos=tos)
    return frames


def drain_order(target, tos_list, survivors, dlcp):
    """The order in which a paused port sends the RESULTs of `survivors` (slots, i.e.
    burst positions) once released. Strict priority (§6): queue 7 first, FIFO inside a
    queue. A target whose paused queues drain in rounds (BMv2: each queue sends its k-th
    packet, highest queue first, before any queue sends its (k+1)-th; packets dropped
    in egress held their place) declares `drain_order = "rounds"`."""
    queue = [dlcp.classify(tos >> 2)[0] for tos in tos_list]
    position = [queue[:k].count(queue[k]) for k in range(len(queue))]
    if getattr(target, "drain_order", "strict") == "rounds":
        return sorted(survivors, key=lambda k: (position[k], -queue[k]))
    return sorted(survivors, key=lambda k: (-queue[k], k))


def job_counters(n):
    return {1: dict(rx=n, aggregated=n, results_multicast=n)}


def test_bands_map_to_queues_and_drain_in_strict_priority(target):
    m = start_single_worker(target, Dlcp())
    tos = [tos_of(band=6), tos_of(band=0), tos_of(dscp=0), tos_of(), tos_of(band=3),
           tos_of(band=0), tos_of(band=5), tos_of(dscp=10), tos_of(band=6), tos_of()]
    got = outputs(target.run(burst(m, tos)))
    assert all(o.port == PORT for o in got)
    # queue 7: control (slots 3, 9); queue 6: band 0 (1, 5); queue 3: band 3 (4);
    # queue 1: band 5 (6); queue 0: band 6 and unmapped DSCPs in arrival order (0, 2, 7, 8).
    strict = [3, 9, 1, 5, 4, 6, 0, 2, 7, 8]
    assert drain_order(target, tos, range(10), Dlcp()) == (
        strict if getattr(target, "drain_order", "strict") == "strict"
        else [3, 1, 4, 6, 0, 9, 5, 2, 7, 8])
    assert [o.slot for o in got] == drain_order(target, tos, range(10), Dlcp())
    assert [o.tos for o in got] == [tos[o.slot] for o in got], "below threshold: unchanged"
    check_counters(target, jobs=job_counters(len(tos)))


def test_below_threshold_nothing_changes(target):
    m = start_single_worker(target, small_dlcp())
    # Band 0 -> queue 6, K = 2: three packets see occupancy 0, 1, 2 (never above K).
    tos = [tos_of(band=0, ecn=e) for e in (ECN_NOT_ECT, ECN_ECT0, ECN_ECT1)]
    frames = burst(m, tos)
    got = outputs(target.run(frames))
    assert [o.slot for o in got] == [0, 1, 2]
    assert [o.tos for o in got] == tos
    check_counters(target, jobs=job_counters(3))


def test_not_ect_dropped_above_threshold_ect_marked_and_buffer_full_drops_all(target):
    m = start_single_worker(target, small_dlcp(threshold=2, capacity=6))
    band0 = [tos_of(band=0, ecn=e) for e in
             (ECN_NOT_ECT, ECN_NOT_ECT, ECN_ECT0,     # occupancy 0, 1, 2: admitted as they are
              ECN_NOT_ECT,                            # occupancy 3 > K=2: selective drop
              ECN_ECT0, ECN_ECT1, ECN_CE,             # occupancy 3, 4, 5: admitted as CE
              ECN_ECT0, ECN_NOT_ECT)]                 # occupancy 6 = C: buffer drop
    got = outputs(target.run(burst(m, band0)))
    assert [o.slot for o in got] == [0, 1, 2, 4, 5, 6]
    for o in got:
        received = band0[o.slot]
        marked = received >> 2 << 2 | ECN_CE if o.slot >= 4 else received
        assert o.tos == marked, f"slot {o.slot}: tos {o.tos:#x}, expected {marked:#x}"
        assert o.p.ip_checksum_ok
        assert ipv4_checksum(o.frame[14:34]) == o.p.ip_checksum
    check_counters(target, glob=dict(dlcp_selective_drop=1, dlcp_ce_marked=2,
                                     dlcp_buffer_drop=2), jobs=job_counters(len(band0)))


def test_queues_fill_independently(target):
    dlcp = small_dlcp(threshold=2, capacity=6)
    m = start_single_worker(target, dlcp)
    # Queue 6 (band 0) goes over its threshold; queue 5 (band 1, K=3) stays below its own.
    tos = [tos_of(band=0, ecn=ECN_NOT_ECT)] * 4 + [tos_of(band=1, ecn=ECN_NOT_ECT)] * 4
    got = outputs(target.run(burst(m, tos)))
    assert [o.slot for o in got] == drain_order(target, tos, [0, 1, 2, 4, 5, 6, 7], dlcp)
    check_counters(target, glob=dict(dlcp_selective_drop=1), jobs=job_counters(8))


def test_control_and_unmapped_dscp_are_never_selectively_dropped(target):
    thresholds = (1,) * (NUM_QUEUES - 1) + (0xFFFF,)
    dlcp = Dlcp(thresholds=thresholds, capacity=6)
    m = start_single_worker(target, dlcp)
    control = [tos_of(ecn=ECN_NOT_ECT)] * 7                      # queue 7
    unmapped = [tos_of(dscp=10, ecn=ECN_NOT_ECT)] * 6           # queue 0, not data
    band6 = [tos_of(band=6, ecn=ECN_NOT_ECT)] * 2               # queue 0, data: above K=1
    tos = control + unmapped + band6
    got = outputs(target.run(burst(m, tos)))
    slots = [o.slot for o in got]
    # control fills to capacity (the 7th is a buffer drop), unmapped fills queue 0
    assert sorted(slots) == list(range(6)) + list(range(7, 13))
    assert slots == drain_order(target, tos, sorted(slots), dlcp)
    assert all(o.tos == tos[o.slot] for o in got)
    assert all(o.p.dscp == CONTROL_DSCP for o in got if o.slot < 7)
    # The two band-6 packets met a full queue 0 (6 = capacity): buffer drops, not selective.
    check_counters(target, glob=dict(dlcp_buffer_drop=3), jobs=job_counters(len(tos)))


def test_data_band_sharing_queue_zero_is_selectively_dropped(target):
    thresholds = (1,) * (NUM_QUEUES - 1) + (0xFFFF,)
    m = start_single_worker(target, Dlcp(thresholds=thresholds, capacity=6))
    tos = [tos_of(dscp=10, ecn=ECN_NOT_ECT)] * 2 + [tos_of(band=6, ecn=ECN_NOT_ECT),
                                                     tos_of(band=6, ecn=ECN_ECT0)]
    got = outputs(target.run(burst(m, tos)))
    assert [o.slot for o in got] == [0, 1, 3]
    assert got[-1].tos == tos_of(band=6, ecn=ECN_CE)
    check_counters(target, glob=dict(dlcp_selective_drop=1, dlcp_ce_marked=1),
                   jobs=job_counters(4))


def test_unpaused_port_passes_everything_unchanged(target):
    job = make_job(1, 1, pool_size=256, ports=[PORT])
    target.start(make_config(job))
    tos = [tos_of(band=0, ecn=ECN_NOT_ECT)] * 5
    got = outputs(target.run(burst(job.members[0], tos)))
    assert [o.slot for o in got] == list(range(5))
    assert all(o.tos == tos[0] for o in got)
    check_counters(target, jobs=job_counters(5))


def internet_sum(data: bytes) -> int:
    """Ones'-complement sum of 16-bit words (0xFFFF for a header with a valid checksum)."""
    total = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def with_options(frame: bytes, options: bytes, *, checksum_error: int = 0) -> bytes:
    """The frame's IPv4 header grown by `options` (IHL 5 + len/4), lengths fixed, checksum
    valid (or off by `checksum_error`)."""
    ip = bytearray(frame[14:34]) + options
    ip[0] = 0x40 | len(ip) // 4
    ip[2:4] = (len(frame) - 14 + len(options)).to_bytes(2, "big")
    ip[10:12] = b"\0\0"
    checksum = (~internet_sum(bytes(ip)) + checksum_error) & 0xFFFF
    ip[10:12] = checksum.to_bytes(2, "big")
    return frame[:14] + bytes(ip) + frame[34:]


def test_ce_marking_keeps_the_checksum_of_packets_with_ip_options(target):
    """§6 (R5): the CE mark updates the checksum incrementally (RFC 1624 eqn. 3), so a
    header with options stays valid, and a bad checksum stays bad by the same amount."""
    route = Route("10.9.0.0/16", PORT, "02:00:00:00:09:01")
    job = make_job(1, 1, ports=[0])
    target.start(make_config(job, dlcp=small_dlcp(threshold=2, capacity=6), routes=(route,)),
                 port_rates={PORT: 0})
    options = bytes([0x94, 0x04, 0x00, 0x00,        # router alert
                     0x01, 0x01, 0x01, 0x00])       # NOP NOP NOP EOL
    sent = []
    for seq in range(5):                           # band 0 (queue 6, K = 2), ECT(0)
        _, frame = raw_frame(job.members[0], seq.to_bytes(4, "big") + bytes(12), dport=53,
                             tos=tos_of(band=0, ecn=ECN_ECT0))
        frame = frame[:30] + bytes([10, 9, 0, 1]) + frame[34:]
        sent.append(with_options(frame, options, checksum_error=-1 if seq == 4 else 0))
    got = target.run([(0, f) for f in sent])
    assert [p for p, _ in got] == [PORT] * 5
    for k, (_, out) in enumerate(got):
        ihl = (out[14] & 0x0F) * 4
        assert ihl == 28 and out[14 + 20:14 + ihl] == options
        marked = k >= 3                            # occupancy 3 and 4 > K = 2
        assert out[15] & 3 == (ECN_CE if marked else ECN_ECT0), f"packet {k}"
        want = bytearray(sent[k])
        want[:12] = out[:12]                       # next-hop and switch MAC
        if marked:
            want[15] |= ECN_CE
            want[24:26] = rfc1624_eqn3(sent[k][24:26], sent[k][14:16], want[14:16])
        assert out == bytes(want), f"packet {k}: only ToS and checksum may change"
        assert internet_sum(out[14:14 + ihl]) == internet_sum(sent[k][14:14 + ihl]) == \
            (0xFFFF if k < 4 else 0xFFFE), "valid stays valid, bad stays bad by as much"
    check_counters(target, glob=dict(forwarded=5, dlcp_ce_marked=2), jobs={1: {}})


def rfc1624_eqn3(checksum: bytes, old_word: bytes, new_word: bytes) -> bytes:
    """HC' = ~(~HC + ~m + m'), in 16-bit ones'-complement arithmetic."""
    def word(b):
        return int.from_bytes(b, "big")
    total = (~word(checksum) & 0xFFFF) + (~word(old_word) & 0xFFFF) + word(new_word)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return (~total & 0xFFFF).to_bytes(2, "big")
