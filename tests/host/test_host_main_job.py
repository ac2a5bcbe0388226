"""The main job end to end: real worker processes, the embedded reference aggregator or
the DPDK switch."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_main_job(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "host.experiments.main_job", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_main_job_trains_thc_next_to_fp32(tmp_path):
    res = run_main_job("--workers", "2", "--steps", "30", "--hidden", "64", "--eval-every", "10",
                       "--loss-bound", "0.05", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "main_job.json").read_text())["runs"]
    assert set(summary) == {"thc", "none"}
    assert summary["thc"]["test_acc"] > 0.8               # it learned the digits
    assert abs(summary["thc"]["test_acc"] - summary["none"]["test_acc"]) < 0.1
    # 4-bit values up vs fp32 ring allreduce: far fewer bytes leave each worker.
    ratio = summary["none"]["bytes_sent_per_worker_per_step"] / \
        summary["thc"]["bytes_sent_per_worker_per_step"]
    assert ratio > 2        # n=2: the ring sends 1x fp32; THC 4 bits + headers, tail padding
    assert summary["thc"]["transport"]["results_accepted"] > 0
    # --loss-bound: the bounded-loss path ran (nothing is lost on loopback)
    loss = summary["thc"]["loss_stats"]
    assert loss["tensors"] > 0 and loss["chunks"] > 0 and loss["missing_agreed"] == 0
    assert (tmp_path / "main_job.png").stat().st_size > 10_000
    assert "THC in-network" in res.stdout and "fp32 allreduce" in res.stdout


def test_main_job_refuses_bad_options():
    res = run_main_job("--workers", "9", "--steps", "1", timeout=60)
    assert res.returncode != 0 and "at most 8 workers" in res.stderr
    res = run_main_job("--compressor", "zip", timeout=60)
    assert res.returncode != 0 and "invalid choice" in res.stderr
    res = run_main_job("--aggregator", "nohost", "--steps", "1", timeout=60)
    assert res.returncode != 0 and "--worker-port-base" in res.stderr
    res = run_main_job("--loss-bound", "1.0", "--steps", "1", timeout=60)
    assert res.returncode != 0 and "0 <= p < 1" in res.stderr
    res = run_main_job("--loss-bound", "0.1", "--compressor", "thc-allreduce", timeout=60)
    assert res.returncode != 0 and "--compressor thc" in res.stderr


def test_main_job_with_the_dpdk_switch(tmp_path):
    """--aggregator dpdk: the real DPDK switch behind a tap aggregates every step."""
    from host.experiments.main_job import dpdk_unavailable
    reason = dpdk_unavailable()
    if reason:
        pytest.skip(reason)
    res = run_main_job("--aggregator", "dpdk", "--workers", "2", "--steps", "30", "--hidden",
                       "64", "--eval-every", "10", "--no-baseline", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "DPDK switch at" in res.stdout
    summary = json.loads((tmp_path / "main_job.json").read_text())["runs"]
    assert summary["thc"]["test_acc"] > 0.8
    stats = json.loads((tmp_path / "main_job_dpdk_stats.json").read_text())
    job = stats["jobs"]["1"]
    # Every chunk of every step went through the switch: 2 contributions, 1 result each.
    results = summary["thc"]["transport"]["results_accepted"]
    assert job["results_multicast"] >= results > 0
    assert job["aggregated"] >= 2 * results
    assert job["drop_not_member"] == 0 and job["drop_bad_slot"] == 0


@pytest.mark.netns
def test_main_job_on_shaped_links_reports_time_to_accuracy(tmp_path):
    """--link-mbit: workers in network namespaces behind shaped links, the reference
    aggregator on the bridge; both runs, and each one's time to fp32's final accuracy."""
    from host.netlab.netem import netns_available
    reason = netns_available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    res = run_main_job("--link-mbit", "200", "--workers", "2", "--steps", "20", "--hidden",
                       "64", "--eval-every", "5", "--out-dir", str(tmp_path), timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "main_job.json").read_text())
    assert out["link_mbit"] == 200
    runs = out["runs"]
    assert set(runs) == {"thc", "none"}
    for run in runs.values():
        assert run["log"]["step"] == [5, 10, 15, 20]
        times = run["log"]["time_s"]
        assert times == sorted(times) and times[0] > 0
    assert runs["thc"]["transport"]["results_accepted"] > 0    # through the aggregator
    tta = out["time_to_accuracy"]
    assert tta["target"] == runs["none"]["test_acc"]
    assert tta["seconds"]["none"] == runs["none"]["log"]["time_s"][
        runs["none"]["log"]["test_acc"].index(tta["target"])]
    assert "training time to fp32's final test accuracy" in res.stdout
