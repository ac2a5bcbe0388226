"""Sanitizer fuzzing of the switch core (ASan + UBSan, dataplane/dpdk/fuzz_harness.c).

A scapy-built corpus of random and mutated frames runs through one persistent switch;
the harness aborts on any sanitizer report or broken invariant (a dropped packet changed
a slot, an emitted frame with inconsistent lengths, the two lane kernels disagreeing).
Afterwards a valid round must still aggregate exactly. Then libFuzzer explores from that
corpus for a few seconds (frames and config files).
"""
import dataclasses
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import fuzz

from dataplane.config import SwitchConfig
from dataplane.dpdk_config import write_config
from dataplane.dpdk_runner import DPDK_DIR
from host.packets import AGG_PORT_BASE, TYPE_FLUSH, TYPE_RESULT, VERSION, AggHeader, parse_frame

from . import streams

BUILD = DPDK_DIR / "build"
SANITIZER_ENV = {**os.environ, "ASAN_OPTIONS": "abort_on_error=1:detect_leaks=1",
                 "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


@pytest.fixture(scope="module")
def fuzz_bins():
    if shutil.which("clang") is None:
        pytest.skip("clang not installed (Debian packages clang libclang-rt-14-dev)")
    res = subprocess.run(["make", "-C", str(DPDK_DIR), "fuzz"], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"sanitizer build failed:\n{res.stdout}\n{res.stderr}")
    return BUILD / "fuzz_replay", BUILD / "fuzz_agg"


def write_records(path, frames):
    with open(path, "wb") as f:
        for port, frame in frames:
            f.write(struct.pack("<IH", len(frame), port) + frame)


def corpus(cfg, rng, n_scapy=1500, n_mutants=20000):
    """Random (scapy fuzz()) headers, a random valid/invalid mix, and mutants of both."""
    members = [m for j in cfg.jobs for m in j.members]
    base = streams.random_mix(cfg, n_scapy, rng)
    for _ in range(n_scapy // 3):
        m = members[rng.integers(0, len(members))]
        pkt = Ether(src=m.mac, dst=streams.SWITCH_MAC) / IP(src=m.ip, dst=streams.SWITCH_IP) \
            / UDP(sport=m.udp_port, dport=AGG_PORT_BASE) / fuzz(AggHeader(version=VERSION))
        base.append((m.port, bytes(pkt)[:rng.integers(40, 1200)]))
    out = list(base)
    for _ in range(n_mutants):
        port, frame = base[rng.integers(0, len(base))]
        out.append((int(rng.integers(0, 8)) if rng.random() < 0.1 else port,
                    streams.mutate(frame, rng)))
    out += [(0, rng.integers(0, 256, rng.integers(0, 200)).astype(np.uint8).tobytes())
            for _ in range(500)]
    return out


def check_round(cfg, rng, round_=0, slot=1, values=1023):
    job = cfg.jobs[0]
    idx = rng.integers(0, 16, (len(job.members), values))
    frames = [(m.port, streams.data_frame(m, [], job=job.job, slot=slot, round_=0, expected=0,
                                          ptype=TYPE_FLUSH)) for m in job.members[:1]]
    frames += [(m.port, streams.data_frame(m, idx[k], job=job.job, slot=slot, round_=round_,
                                           expected=job.expected_all))
               for k, m in enumerate(job.members)]
    return frames, np.asarray(streams.TABLE)[idx].sum(axis=0).astype(np.uint8)


def test_corpus_under_sanitizers_then_a_valid_round_is_exact(fuzz_bins, tmp_path):
    replay, _ = fuzz_bins
    rng = np.random.default_rng(11)
    cfg = streams.config(n_workers=3, pool_size=4, jobs=(1, 2), routes=streams.routes(),
                         dlcp=streams.small_dlcp())
    conf = write_config(cfg, tmp_path / "switch.conf")
    frames = corpus(cfg, rng)
    write_records(tmp_path / "corpus.bin", frames)
    check, sums = check_round(cfg, rng)
    write_records(tmp_path / "check.bin", check)
    res = subprocess.run([str(replay), str(conf), str(tmp_path / "corpus.bin"),
                          str(tmp_path / "check.bin")], capture_output=True, text=True,
                         timeout=120, env=SANITIZER_ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "runtime error" not in res.stderr and "Sanitizer" not in res.stderr
    assert f"replayed {len(frames)} frames" in res.stderr
    # Emitted RESULTs of the check round: one per member, exact sums.
    lines = [line.split() for line in res.stdout.splitlines()]
    assert len(lines) == len(cfg.jobs[0].members)
    for (port, hexframe), m in zip(lines, cfg.jobs[0].members):
        p = parse_frame(bytes.fromhex(hexframe))
        assert int(port) == m.port and p.ptype == TYPE_RESULT and p.ip_checksum_ok
        assert int(p.header["contributors"]) == cfg.jobs[0].expected_all
        np.testing.assert_array_equal(np.frombuffer(p.payload, np.uint8), sums)


def test_libfuzzer_finds_nothing_in_a_short_run(fuzz_bins, tmp_path):
    _, libfuzzer = fuzz_bins
    rng = np.random.default_rng(12)
    cfg = streams.config(n_workers=3, pool_size=4, jobs=(1, 2), routes=streams.routes())
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    for i, (port, frame) in enumerate(corpus(cfg, rng, n_scapy=150, n_mutants=150)):
        (seeds / f"f{i}").write_bytes(frame)
    (seeds / "config").write_bytes(b"C" + write_config(cfg, tmp_path / "c.conf").read_bytes())
    res = subprocess.run([str(libfuzzer), "-max_total_time=8", "-timeout=10", "-rss_limit_mb=2048",
                          f"-artifact_prefix={tmp_path}/", str(seeds)],
                         capture_output=True, text=True, timeout=120, env=SANITIZER_ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Done" in res.stderr and "ERROR" not in res.stderr


def test_the_core_aggregates_8192_values_per_packet(fuzz_bins, tmp_path):
    """Protocol v2's largest packets (R7) through the core under the sanitizers: a job
    sized for 8192 values sums a round of 8192-value DATA exactly; one value more is
    drop_bad_length. (The live switch also needs mbufs for 8266-byte frames.)"""
    replay, _ = fuzz_bins
    rng = np.random.default_rng(13)
    base = streams.config(n_workers=3, pool_size=2)
    cfg = SwitchConfig(base.mac, base.ip, (dataclasses.replace(base.jobs[0],
                                                                values_per_packet=8192),))
    conf = write_config(cfg, tmp_path / "switch.conf")
    m0 = cfg.jobs[0].members[0]
    too_long = streams.data_frame(m0, rng.integers(0, 16, 8193), job=1, slot=0, round_=0,
                                  expected=cfg.jobs[0].expected_all)
    write_records(tmp_path / "corpus.bin", [(m0.port, too_long)])
    check, sums = check_round(cfg, rng, values=8192)
    write_records(tmp_path / "check.bin", check)
    res = subprocess.run([str(replay), str(conf), str(tmp_path / "corpus.bin"),
                          str(tmp_path / "check.bin")], capture_output=True, text=True,
                         timeout=120, env=SANITIZER_ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    assert '"drop_bad_length": 1' in res.stderr
    lines = [line.split() for line in res.stdout.splitlines()]
    assert len(lines) == 3
    for (port, hexframe), m in zip(lines, cfg.jobs[0].members):
        p = parse_frame(bytes.fromhex(hexframe))
        assert int(port) == m.port and p.ptype == TYPE_RESULT and p.ip_checksum_ok
        assert len(p.payload) == 8192
        np.testing.assert_array_equal(np.frombuffer(p.payload, np.uint8), sums)
