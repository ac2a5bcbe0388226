"""The main job end to end: real worker processes, the switch core's UDP service, the
embedded reference aggregator or the DPDK switch."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataplane import dpdk_runner
from dataplane.udp_service import core_unavailable
from host.experiments import main_job

ROOT = Path(__file__).resolve().parents[2]


def run_main_job(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "host.experiments.main_job", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_main_job_trains_thc_next_to_bf16_and_fp32(tmp_path):
    res = run_main_job("--workers", "2", "--steps", "30", "--hidden", "64", "--eval-every", "10",
                       "--loss-bound", "0.05", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "main_job.json").read_text())
    summary = out["runs"]
    assert list(summary) == ["thc", "bf16", "none"]        # the default runs, in order
    assert out["values_per_packet"] == 8192                 # loopback takes jumbo datagrams
    # the switch core in C serves by default where make build built it
    assert out["aggregator"] == ("reference" if core_unavailable() else "core")
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
    assert "bf16 hook" in res.stdout


def test_main_job_through_the_python_reference(tmp_path):
    """--aggregator reference: the Python reference serves the same job, to the same
    accuracy as the default run above reaches."""
    res = run_main_job("--workers", "2", "--steps", "30", "--hidden", "64", "--eval-every", "10",
                       "--runs", "thc", "--aggregator", "reference", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "main_job.json").read_text())
    assert out["aggregator"] == "reference" and "served by the Python reference" in res.stdout
    assert out["runs"]["thc"]["test_acc"] > 0.8
    assert out["runs"]["thc"]["transport"]["results_accepted"] > 0


def test_main_job_runs_torchs_hooks_past_powersgds_start(tmp_path):
    """--runs with torch's hooks. Buckets of 10 KB give DDP several buckets: PowerSGD's
    collectives from several buckets on one gloo group, which went out of order on the
    ranks (a hang or an abort) once PowerSGD started, here at step 6."""
    res = run_main_job("--workers", "2", "--steps", "30", "--hidden", "64", "--eval-every", "10",
                       "--runs", "bf16,fp16,powersgd,none", "--bucket-cap-mb", "0.01",
                       "--powersgd-start-iter", "5", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "main_job.json").read_text())
    runs = out["runs"]
    assert list(runs) == ["bf16", "fp16", "powersgd", "none"]
    for run in runs.values():
        assert run["test_acc"] > 0.7                       # each one learned the digits
        assert run["log"]["step"] == [10, 20, 30]
    fp32 = runs["none"]["bytes_sent_per_worker_per_step"]
    assert runs["bf16"]["bytes_sent_per_worker_per_step"] == pytest.approx(fp32 / 2)  # 2 bytes
    assert runs["fp16"]["bytes_sent_per_worker_per_step"] == pytest.approx(fp32 / 2)
    # PowerSGD compressed the 25 steps after its start: rank-4 factors, far below fp32.
    assert out["powersgd_start_iter"] == 5
    assert runs["powersgd"]["bytes_sent_per_worker_per_step"] < 0.6 * fp32
    assert "powerSGD_hook" in runs["powersgd"]["hook"]
    assert "bf16_compress_hook" in runs["bf16"]["hook"]
    # Time to accuracy: a target every run reaches, the lowest final accuracy less a margin.
    tta = out["time_to_accuracy"]
    lowest = min(run["test_acc"] for run in runs.values())
    assert tta["target"] == pytest.approx(lowest - tta["margin"]) and tta["margin"] > 0
    assert set(tta["seconds"]) == set(runs) and all(t > 0 for t in tta["seconds"].values())
    assert set(tta["speedup_vs_fp32"]) == {"bf16", "fp16", "powersgd"}
    assert "PowerSGD rank 4" in res.stdout and f"{tta['target']:.3f}" in res.stdout


@pytest.mark.parametrize("argv, message", [
    (["--workers", "9"], "at most 8 workers"),
    (["--compressor", "zip"], "invalid choice"),
    (["--aggregator", "nohost"], "--worker-port-base"),
    (["--loss-bound", "1.0"], "0 <= p < 1"),
    (["--loss-bound", "0.1", "--compressor", "thc-allreduce"], "--compressor thc"),
    (["--runs", "thc,zip"], "name runs from"),
    (["--runs", "thc,none", "--compressor", "bf16"], "leave out --compressor"),
    (["--runs", "powersgd", "--powersgd-start-iter", "1"], "step 2 or later"),
    (["--values-per-packet", "9000"], "1..8192"),
    (["--aggregator", "core", "--link-mbit", "1000"], "serves on loopback"),
])
def test_main_job_refuses_bad_options(argv, message, capsys):
    """The command line's checks (in this process: each refusal is parse_args's)."""
    with pytest.raises(SystemExit) as exit_:
        main_job.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_main_job_default_runs_and_packets():
    args = main_job.parse_args([])
    assert args.runs == ["thc", "bf16", "none"] and args.values_per_packet == 8192
    assert main_job.parse_args(["--compressor", "none"]).runs == ["none"]
    assert main_job.parse_args(["--compressor", "powersgd", "--no-baseline"]).runs == ["powersgd"]
    args = main_job.parse_args(["--runs", "powersgd,none", "--steps", "150"])
    assert args.runs == ["powersgd", "none"] and args.powersgd_start_iter == 15
    # A path to another host may not take jumbo datagrams; loopback does.
    assert main_job.parse_args(["--aggregator", "10.1.2.3:50000", "--worker-port-base",
                                "41000"]).values_per_packet == 1024
    assert main_job.parse_args(["--aggregator", "127.0.0.1:50000", "--worker-port-base",
                                "41000"]).values_per_packet == 8192


def test_main_job_with_the_dpdk_switch(tmp_path):
    """--aggregator dpdk: the real DPDK switch behind a tap aggregates every step."""
    reason = dpdk_runner.cannot_run()
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


def test_sigterm_stops_the_main_job_and_removes_its_switch(tmp_path):
    """SIGTERM mid-training: the workers stop, the DPDK switch exits and its veth pair goes."""
    reason = dpdk_runner.cannot_run()
    if reason:
        pytest.skip(reason)
    proc = subprocess.Popen([sys.executable, "-m", "host.experiments.main_job", "--aggregator",
                             "dpdk", "--workers", "2", "--steps", "5000", "--hidden", "64",
                             "--no-baseline", "--out-dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    veth = None
    try:
        for line in proc.stdout:                  # "DPDK switch at IP:PORT behind veth NAME"
            if "behind veth" in line:
                veth = line.split("behind veth")[1].split()[0]
                break
        assert veth, "the main job never started its switch"
        time.sleep(5)                             # training is under way
        assert subprocess.run(["ip", "link", "show", veth], capture_output=True).returncode == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert subprocess.run(["ip", "link", "show", veth], capture_output=True).returncode != 0
    left = subprocess.run(["pgrep", "-f", f"thc_switch.*{veth}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"thc_switch still running: {left.stdout}"


@pytest.mark.netns
def test_main_job_on_shaped_links_reports_time_to_accuracy(tmp_path):
    """--link-mbit: workers in network namespaces behind shaped links, the reference
    aggregator on the bridge; the default runs, and each one's time to an accuracy every
    run reaches."""
    from host.netlab.links import netns_available
    reason = netns_available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    res = run_main_job("--link-mbit", "200", "--workers", "2", "--steps", "20", "--hidden",
                       "64", "--eval-every", "5", "--out-dir", str(tmp_path), timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "main_job.json").read_text())
    assert out["link_mbit"] == 200
    assert out["values_per_packet"] == 8192                 # jumbo frames on the veth links
    runs = out["runs"]
    assert set(runs) == {"thc", "bf16", "none"}
    for run in runs.values():
        assert run["log"]["step"] == [5, 10, 15, 20]
        times = run["log"]["time_s"]
        assert times == sorted(times) and times[0] > 0
    assert runs["thc"]["transport"]["results_accepted"] > 0    # through the aggregator
    tta = out["time_to_accuracy"]
    lowest = tta["lowest_final"]["run"]
    assert tta["target"] == runs[lowest]["test_acc"] - tta["margin"]
    for name, run in runs.items():                       # the first evaluation at the target
        first = next(i for i, acc in enumerate(run["log"]["test_acc"]) if acc >= tta["target"])
        assert tta["seconds"][name] == run["log"]["time_s"][first]
    assert "training time to test accuracy" in res.stdout
