"""A new user's first hour: the job handshake, timeouts that say what happened, more than 8
workers without a switch, GradScaler, clean exits, one-line CLI refusals, the quick start.

Real sockets, real processes (gloo process groups, torchrun), the real UDP service.
"""
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import thc
from dataplane.config import ConfigError, SwitchConfig
from dataplane.udp_service import serve
from host.ddp_hook import JobMismatchError, thc_hook, thc_hook_state, worker_job
from host.transport import AggregatorTimeout, AggregatorTransport, AggregatorUnreachable

from hosttest_util import (free_port, job_config, one_rank_group,  # noqa: F401 (fixture)
                            run_worker_processes)

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def two_workers(**kw) -> SwitchConfig:
    return SwitchConfig.local(workers=2, port_base=41000, **kw)


# --------------------------------------------------------------------------- the handshake

def test_the_worker_takes_table_pool_packet_size_and_address_from_the_job():
    config = two_workers(granularity=20, pool_size=64, values_per_packet=512)
    spec = worker_job(config, job=1, rank=1, world=2)
    assert np.array_equal(spec.codec.table, config.jobs[0].table)
    assert spec.codec.granularity == 20
    assert (spec.pool_size, spec.values_per_packet, spec.expected) == (64, 512, 0b11)
    assert spec.address == ("127.0.0.1", 41001)      # member 1, no THC_WORKER_PORT_BASE


@pytest.mark.parametrize("granularity", [28, 20])
def test_a_codec_whose_table_differs_from_the_jobs_is_refused(granularity):
    # Before: 1.11x (g=28) or 2.12x (g=20) the true mean's norm, and no error.
    with pytest.raises(JobMismatchError) as err:
        worker_job(two_workers(), job=1, rank=0, world=2,
                   codec=thc.THCCodec(granularity=granularity))
    msg = str(err.value)
    assert f"(granularity {granularity})" in msg and "(granularity 30)" in msg
    assert "leave codec out" in msg


@pytest.mark.parametrize("kwargs, both", [
    ({"world": 3}, ("3 workers", "2 members")),                         # timed out before
    ({"values_per_packet": 2048}, ("values_per_packet=2048", "values_per_packet 1024")),
    ({"pool_size": 512}, ("pool_size=512", "pool_size 256")),
    ({"worker_address": ("127.0.0.1", 40000)}, ("127.0.0.1:40000", "127.0.0.1:41000")),
])
def test_each_mismatch_with_the_job_names_both_values(kwargs, both):
    args = {"job": 1, "rank": 0, "world": 2, **kwargs}
    with pytest.raises(JobMismatchError) as err:
        worker_job(two_workers(), **args)
    for text in both:
        assert text in str(err.value)


def test_a_stale_port_base_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("THC_WORKER_PORT_BASE", "45000")
    with pytest.raises(JobMismatchError, match="45000.*41000"):
        worker_job(two_workers(), job=1, rank=0, world=2)


def test_a_job_description_file_and_its_errors(tmp_path):
    path = two_workers().save(tmp_path / "job.json")
    assert worker_job(str(path), job=1, rank=0, world=2).address == ("127.0.0.1", 41000)
    with pytest.raises(JobMismatchError, match=r"job=7 is not in .*its jobs: \[1\]"):
        worker_job(path, job=7, rank=0, world=2)
    with pytest.raises(ConfigError, match="no-such.json.*dataplane.config local"):
        worker_job(tmp_path / "no-such.json", job=1, rank=0, world=2)


def test_the_in_network_path_refuses_at_set_up(one_rank_group, monkeypatch):
    monkeypatch.delenv("THC_JOB_CONFIG", raising=False)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        thc_hook_state(aggregator="127.0.0.1:50000")
    msg = str(err.value)
    assert "\n" not in msg and "job_config=" in msg and "THC_JOB_CONFIG" in msg
    assert "--aggregator" not in msg and "aggregator='127.0.0.1:50000'" in msg
    one = SwitchConfig.local(workers=1, port_base=free_port())
    with pytest.raises(JobMismatchError, match="granularity 28"):
        thc_hook_state(aggregator="127.0.0.1:50000", job_config=one,
                       codec=thc.THCCodec(granularity=28))
    assert time.monotonic() - t0 < 5                   # at once, not after a timeout


# --------------------------------------------------------------------------- timeouts

def test_a_timeout_says_what_the_worker_sent_and_where_the_counters_are():
    member, stranger = free_port(), free_port()
    with serve(job_config([("127.0.0.1", member)], 4), "127.0.0.1", 0) as svc:
        t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=4,
                                timeout=1.0, local=("127.0.0.1", stranger))
        with t, pytest.raises(AggregatorTimeout) as err:
            t.allreduce(np.zeros(1024, np.uint8), 2048, tensor=0)
        dropped = svc.counters()["jobs"][1]["drop_not_member"]
    msg = str(err.value)
    assert f"bound to 127.0.0.1:{stranger}" in msg
    assert f"aggregator 127.0.0.1:{svc.address[1]}" in msg
    assert re.search(r"sent \d+ packets", msg) and "received 0" in msg
    assert "nothing was ever received" in msg
    assert "chunks 0..1, slots 0..1 of pool 4" in msg
    assert "svc.counters()" in msg and "kill -USR1" in msg and "drop_not_member" in msg
    assert dropped > 0


def test_an_unreachable_aggregator_is_named_in_library_terms():
    port = free_port()                                 # nothing listens there
    with AggregatorTransport(("127.0.0.1", port), job=1, worker=0, expected=1, pool_size=2,
                             timeout=2.0) as t, pytest.raises(AggregatorUnreachable) as err:
        t.allreduce(np.zeros(8, np.uint8), 16, tensor=0)
    assert "aggregator=" in str(err.value) and "--aggregator" not in str(err.value)


# --------------------------------------------------------------------------- worker processes

def _init(rank, init, world):
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


NINE = 9
D = 20_000


def _nine_worker(rank, init, queue):
    try:
        _init(rank, init, NINE)
        state = thc_hook_state(codec=thc.THCCodec(seed=3, partition_size=1 << 12),
                               error_feedback=False)
        g = torch.from_numpy(np.random.default_rng(rank).standard_normal(D).astype(np.float32))
        mean = state.reduce(g, 0).numpy()
        queue.put((rank, {"mean": mean, "lanes": str(state.allreduce.exchange.lane_dtype)}))
        state.close()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def test_nine_workers_without_a_switch_get_the_right_mean():
    results = run_worker_processes(_nine_worker, lambda r, init, q: (r, init, q), NINE,
                                   seconds=240)
    codec = thc.THCCodec(seed=3, partition_size=1 << 12)
    grads = [np.random.default_rng(r).standard_normal(D).astype(np.float32)
             for r in range(NINE)]
    # What an integer-sum aggregator with wide enough lanes computes (9 x 30 > 255).
    norms = np.max([codec.partition_norms(g) for g in grads], axis=0)
    total = sum(codec.lookup(codec.compress(g, norms, worker=w, round=0, tensor=0))
                .astype(np.int32) for w, g in enumerate(grads))
    expected = codec.decode(total, NINE, norms, D)
    true_mean = np.mean(grads, axis=0)
    for r in range(NINE):
        assert results[r]["lanes"] == "torch.int32"
        np.testing.assert_allclose(results[r]["mean"], expected, rtol=0, atol=1e-6)
    nmse = np.sum((results[0]["mean"] - true_mean) ** 2) / np.sum(true_mean ** 2)
    assert nmse < 0.1


SCALER_STEPS = 5
INF_STEP = 2


def _scaler_worker(rank, init, aggregator, members, queue):
    try:
        _init(rank, init, 2)
        out = {}
        for path in ("collective", "aggregator"):
            kw = {} if path == "collective" else {
                "aggregator": aggregator, "job_config": job_config(members, 16), "timeout": 10}
            state = thc_hook_state(nonfinite="propagate", **kw)
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(nn.Sequential(
                nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
            model.register_comm_hook(state, thc_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
            data = torch.Generator().manual_seed(rank)
            params, scales, errors = [], [], []
            for step in range(SCALER_STEPS):
                x = torch.randn(8, 16, generator=data)
                loss = model(x).square().mean()
                if step == INF_STEP and rank == 1:
                    loss = loss * float("inf")            # overflow on one worker only
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                params.append(torch.cat([p.detach().reshape(-1).clone()
                                         for p in model.parameters()]).numpy())
                scales.append(scaler.get_scale())
                ef = state.allreduce.error_feedback._errors
                errors.append({k: np.asarray(v).copy() for k, v in ef.items()})
            out[path] = {"params": params, "scales": scales, "errors": errors,
                         "inf_calls": state.allreduce.nonfinite_calls}
            state.close()
        queue.put((rank, out))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def test_grad_scaler_skips_an_overflowing_step_on_every_worker():
    members = [("127.0.0.1", free_port()) for _ in range(2)]
    with serve(job_config(members, 16), "127.0.0.1", 0) as svc:
        aggregator = f"127.0.0.1:{svc.address[1]}"
        results = run_worker_processes(
            _scaler_worker, lambda r, init, q: (r, init, aggregator, members, q), 2, seconds=180)
    for path in ("collective", "aggregator"):
        runs = [results[r][path] for r in range(2)]
        for run in runs:
            p = run["params"]
            assert np.array_equal(p[INF_STEP], p[INF_STEP - 1])          # skipped
            assert not np.array_equal(p[INF_STEP + 1], p[INF_STEP])      # trains on
            assert run["scales"][INF_STEP] == run["scales"][INF_STEP - 1] / 2
            assert run["inf_calls"] >= 1
            before, after = run["errors"][INF_STEP - 1], run["errors"][INF_STEP]
            assert before and before.keys() == after.keys()
            for k in before:                          # error feedback untouched
                assert np.array_equal(before[k], after[k]), (path, k)
        for a, b in zip(runs[0]["params"], runs[1]["params"]):
            assert np.array_equal(a, b)                                   # replicas agree
        assert runs[0]["scales"] == runs[1]["scales"]


def test_close_is_idempotent_and_ends_the_state(one_rank_group):
    state = thc_hook_state(codec=thc.THCCodec(partition_size=1 << 12))
    state.reduce(torch.ones(100), 0)
    state.close()
    state.close()
    with pytest.raises(RuntimeError, match="closed"):
        state.reduce(torch.ones(100), 0)


NONFINITE_SCRIPT = """
import torch, torch.distributed as dist
import thc
from host.ddp_hook import thc_hook_state
torch.set_num_threads(1)
dist.init_process_group("gloo")
state = thc_hook_state()
g = torch.randn(5000)
state.reduce(g, 0)
if dist.get_rank() == 1:
    g[3] = float("nan")
try:
    state.reduce(g, 0)
except thc.NonFiniteError:
    print("caught", flush=True)
"""


def test_the_process_exits_cleanly_after_a_caught_nonfinite_error(tmp_path):
    """Before: SIGABRT ("terminate called without an active exception") at exit in about a
    third of the runs: the exchange thread was still alive while the interpreter ended."""
    script = tmp_path / "nonfinite.py"
    script.write_text(NONFINITE_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for attempt in range(5):
        res = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", str(free_port()), str(script)], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, (attempt, res.stdout[-2000:], res.stderr[-3000:])
        assert res.stdout.count("caught") == 2
        assert "terminate called" not in res.stderr


# --------------------------------------------------------------------------- CLIs

def _cli(*args, cwd=None):
    return subprocess.run([PYTHON, "-m", *args], cwd=cwd or ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("command", [["dataplane.udp_service"],
                                     ["dataplane.dpdk_runner", "host"]])
def test_the_services_refuse_a_bad_job_description_in_one_line(tmp_path, command):
    bad = tmp_path / "job.json"
    bad.write_text('{"jobs": [{"job": 1, "pool_size": 4, "table": [0, 30], '
                   '"members": [{"worker": 0, "ip": "127.0.0.1"}]}]}')
    res = _cli(*command, "--config", str(bad))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "missing field(s) ['udp_port']" in res.stderr


def test_the_dpdk_host_service_refuses_loopback_members(tmp_path):
    two_workers().save(tmp_path / "job.json")
    res = _cli("dataplane.dpdk_runner", "host", "--config", str(tmp_path / "job.json"))
    assert res.returncode == 2 and "loopback" in res.stderr and "Traceback" not in res.stderr


def test_the_local_job_cli_writes_a_job_and_refuses_too_many_workers(tmp_path):
    res = _cli("dataplane.config", "local", "--workers", "4", "--port-base", "43000",
               "-o", str(tmp_path / "job.json"))
    assert res.returncode == 0, res.stderr
    config = SwitchConfig.load(tmp_path / "job.json").validate()
    job = config.jobs[0]
    assert [(m.worker, m.ip, m.udp_port) for m in job.members] == \
        [(w, "127.0.0.1", 43000 + w) for w in range(4)]
    assert job.table[-1] == 30 and job.pool_size == 256
    res = _cli("dataplane.config", "local", "--workers", "9", "-o", str(tmp_path / "x.json"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "at most 8 workers" in res.stderr and not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- quick start

def _readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def _port_busy(port: int, kind=socket.SOCK_DGRAM) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_quick_start_runs_as_written(tmp_path):
    block = _readme_block("Quick start: your own script")
    assert "thc_hook_state(aggregator=\"127.0.0.1:50000\", job_config=\"job.json\")" in \
        (ROOT / "host/experiments/quickstart_train.py").read_text()
    busy = [p for p in (50000, 41000, 41001) if _port_busy(p)]
    if busy:
        pytest.skip(f"UDP port(s) {busy} of the quick start are in use on this machine")
    # The commands as written, from a directory that looks like the repository root (its
    # job.json must not land in the working tree).
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "host").symlink_to(ROOT / "host")
    env = {k: v for k, v in os.environ.items() if not k.startswith("THC_")}
    proc = subprocess.Popen(["bash", "-e", "-c", block + "wait\n"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    # (the two ranks share one stdout: a line may end without its newline before the other's)
    lines = re.findall(r"rank (\d): loss ([\d.]+) -> ([\d.]+), parameter checksum "
                       r"(-?\d+\.\d+(?:e[-+]?\d+)?)", out)
    assert sorted(r for r, *_ in lines) == ["0", "1"], out[-4000:]
    for _, first, last, _ in lines:
        assert float(last) < 0.2 * float(first)
    assert len({checksum for *_, checksum in lines}) == 1            # replicas agree
    counters = re.search(r"job 1: .*results_multicast=(\d+)", out)
    assert counters and int(counters.group(1)) >= 60                  # through the aggregator
