"""thc_switch --bench: the generator runs through the live poll loop, busy or adaptive,
and every round it offers completes (a frame the switch drops would show here as a
missing result, not as a faster benchmark)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dataplane.config import MAX_VALUES
from dataplane.dpdk_config import write_config
from host.experiments.bench_dpdk import bench_config, run_switch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("busy_poll", [False, True], ids=["adaptive", "busy"])
def test_every_generated_round_completes(switch_bin, tmp_path, busy_poll):
    conf = write_config(bench_config(4, 16), tmp_path / "bench.conf")
    r = run_switch(conf, 4, 20_000, 1024, forward_only=False, busy_poll=busy_poll)
    assert r["polling"] == ("busy" if busy_poll else "adaptive")
    assert r["packets"] == 20_000 and r["results"] * 4 == 20_000
    assert r["packets_per_s"] > 0


def test_bursts_after_idle_gaps_are_picked_up_and_timed(switch_bin, tmp_path):
    """--bench-gap-us: a burst after each 300 us of idle; the adaptive loop has slept
    by then (timed back-off on net_null ports), and still picks every burst up."""
    conf = write_config(bench_config(4, 16), tmp_path / "bench.conf")
    r = run_switch(conf, 4, 32 * 50, 1024, forward_only=False, gap_us=300)
    assert r["results"] * 4 == 32 * 50
    assert r["bursts_after_gap"] == 49
    assert 0 <= r["pickup_us_median"] <= r["pickup_us_max"]


def test_the_benchmark_takes_the_largest_packets_it_advertises(switch_bin, tmp_path):
    """--values up to the software planes' limit: the job description the benchmark hands
    the switch says the same size, so the switch aggregates every round of them."""
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "host.experiments.bench_dpdk", "--no-live",
                          "--values", str(MAX_VALUES), "--packets", "20000", "--repeat", "1",
                          "--ref-packets", "40", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["values_per_packet"] == MAX_VALUES
    assert result["every_round_completed"]
    res = subprocess.run([sys.executable, "-m", "host.experiments.bench_dpdk", "--values",
                          str(MAX_VALUES + 1)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and f"1..{MAX_VALUES}" in res.stderr
