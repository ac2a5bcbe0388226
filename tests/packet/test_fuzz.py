"""Fuzzing the reference aggregator: random, mutated and scapy-fuzzed frames.

No input may raise; every frame is accounted for by exactly one counter; everything
emitted is well formed; and after the storm (and a FLUSH) a valid round still
aggregates exactly.
"""
import random

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw, fuzz

from dataplane.config import Route
from dataplane.reference import GLOBAL_COUNTERS
from host.packets import AGG_PORT_BASE, VERSION, AggHeader, parse_frame
from .scenario import (SWITCH_IP, SWITCH_MAC, check_result, data_frames, flush_frame,
                       make_config, make_job, outputs, sums_of)
from .targets.reference import ReferenceTarget

N_FRAMES = 3000
POOL = 8


def valid_frame(rng, jobs):
    job = jobs[rng.integers(len(jobs))]
    m = job.members[rng.integers(len(job.members))]
    n = int(rng.integers(1, 40))
    expected = int(rng.integers(0, 1 << len(job.members))) if rng.random() < 0.3 else job.expected_all
    return data_frames(m, rng.integers(0, 16, n), job=job.job, slot=int(rng.integers(0, POOL + 2)),
                       round_=int(rng.integers(0, 6)), expected=expected,
                       min_count=int(rng.integers(0, 3)) * (rng.random() < 0.3),
                       vpp=int(rng.integers(1, 50)), flags=int(rng.integers(0, 8)),
                       tos=int(rng.integers(0, 256)))


def mutate(rng, frame):
    f = bytearray(frame)
    for _ in range(int(rng.integers(1, 5))):
        f[int(rng.integers(len(f)))] = int(rng.integers(256))
    if rng.random() < 0.3:
        f = f[:int(rng.integers(0, len(f) + 1))]
    if rng.random() < 0.2:
        f += bytes(rng.integers(0, 256, int(rng.integers(1, 30)), dtype=np.uint8))
    return bytes(f)


def scapy_fuzzed(rng):
    dport = AGG_PORT_BASE + int(rng.integers(0, 16)) if rng.random() < 0.8 else int(rng.integers(1, 65536))
    pkt = (Ether(dst=SWITCH_MAC) / IP(dst=SWITCH_IP if rng.random() < 0.7 else "10.99.0.1")
           / UDP(dport=dport) / fuzz(AggHeader()) / Raw(bytes(int(rng.integers(0, 60)))))
    return bytes(pkt)


def as_fragment(rng, frame):
    """The frame with random IPv4 fragment bits (MF and/or an offset), checksum left as is."""
    f = bytearray(frame)
    f[20:22] = (int(rng.integers(0, 2)) << 13 | int(rng.integers(0, 3)) * 7).to_bytes(2, "big")
    if f[20:22] == b"\0\0":
        f[20] = 0x20
    return bytes(f)


def storm(rng, jobs):
    for _ in range(N_FRAMES):
        port = int(rng.integers(0, 6))
        kind = rng.random()
        if kind < 0.31:
            yield from valid_frame(rng, jobs)[:1]
        elif kind < 0.35:
            p, f = valid_frame(rng, jobs)[0]
            yield p, as_fragment(rng, f)
        elif kind < 0.7:
            p, f = valid_frame(rng, jobs)[0]
            yield (p if rng.random() < 0.8 else port), mutate(rng, f)
        elif kind < 0.9:
            yield port, scapy_fuzzed(rng)
        elif kind < 0.98:
            yield port, bytes(rng.integers(0, 256, int(rng.integers(0, 120)), dtype=np.uint8))
        else:                                  # over MAX_FRAME, padded after a valid packet
            p, f = valid_frame(rng, jobs)[0]
            yield p, f + bytes(int(rng.integers(9217, 12001)) - len(f))


def accounted(counters) -> int:
    """Frames accounted for: each ends in exactly one of these counters."""
    g = counters["global"]
    total = sum(g[k] for k in GLOBAL_COUNTERS if not k.startswith("dlcp_"))
    for jc in counters["jobs"].values():
        total += (jc["rx"] + jc["drop_bad_slot"] + jc["drop_not_member"]
                  + jc["drop_bad_expected"] + jc["drop_unsatisfiable"])
        assert jc["rx"] == (jc["aggregated"] + jc["drop_duplicate"] + jc["results_reserved"]
                            + jc["straggler_notices"] + jc["flushes"])
    return total


def test_fuzzed_input_never_raises_and_every_frame_is_counted():
    random.seed(1234)                      # scapy's fuzz() draws from `random`
    rng = np.random.default_rng(1234)
    jobs = [make_job(1, 3, pool_size=POOL, first_port=0), make_job(2, 2, pool_size=POOL, first_port=3)]
    target = ReferenceTarget()
    target.start(make_config(*jobs, routes=(Route("10.99.0.0/16", 5, "02:00:00:00:63:01"),)),
                 port_rates={4: 0})
    frames = list(storm(rng, jobs))
    emitted = target.run(frames)
    c = target.counters()
    assert accounted(c) == len(frames)
    assert c["global"]["forwarded"] > 0 and c["jobs"][1]["aggregated"] > 0
    assert sum(c["global"][k] for k in ("drop_truncated", "drop_bad_version", "drop_bad_length")) > 0
    assert c["global"]["drop_fragment"] > 0 and c["jobs"][1]["drop_unsatisfiable"] > 0
    assert c["global"]["drop_oversize"] > 0
    for port, frame in emitted:
        if port == 5:
            continue                      # forwarded ordinary traffic, passed through
        p = parse_frame(frame)
        assert p.eth_src == SWITCH_MAC and p.ip_src == SWITCH_IP and p.ip_checksum_ok
        assert p.header is not None and int(p.header["ver_type"]) >> 4 == VERSION

    # After the storm: flush, then one valid round per job aggregates exactly.
    for job in jobs:
        target.run([flush_frame(job.members[0], job=job.job, slot=s) for s in range(POOL)])
    for job in jobs:
        idx = rng.integers(0, 16, (len(job.members), 30))
        round_frames = [f for w, m in enumerate(job.members)
                        for f in data_frames(m, idx[w], job=job.job, slot=3, round_=0,
                                             expected=job.expected_all, vpp=30)]
        got = outputs(target.run(round_frames))
        assert len(got) == len(job.members)
        for m, o in zip(job.members, sorted(got, key=lambda o: o.worker)):
            check_result(o, m, job=job.job, slot=3, round_=0, sums=sums_of(idx),
                         contributors=job.expected_all, expected=job.expected_all)
    added = 2 * POOL + 5
    assert accounted(target.counters()) == len(frames) + added
