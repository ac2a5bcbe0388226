"""Checkpoint and resume of the THC hook state (THCHookState.state_dict / load_state_dict).

Real processes: the README's script (host/experiments/resume_train.py) under torchrun
trains N steps and saves, FRESH processes load and train M more, and the parameters must
equal those of N+M uninterrupted steps bit for bit: over gloo, and through the reference
UDP service (one service for every run: the resumed job flushes its slots at start and is
not taken for a straggler). Then the refusals and the warning of a resume that forgot the
hook state, in gloo worker processes.
"""
import datetime
import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import numba
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import thc
from dataplane.config import SwitchConfig
from dataplane.udp_service import serve
from host.ddp_hook import ResumeWarning, thc_hook, thc_hook_state

from hosttest_util import free_port, run_worker_processes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "host/experiments/resume_train.py"
N, M = 4, 3


def _torchrun(tmp_path, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("THC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(SCRIPT), *map(str, args)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def _train_three_ways(tmp_path, *extra):
    """(params of N+M uninterrupted steps, params of N saved + M resumed, the runs' stderr)."""
    _torchrun(tmp_path, "--steps", N + M, "--params", tmp_path / "full.pt", *extra)
    first = _torchrun(tmp_path, "--steps", N, "--save", tmp_path / "ckpt", *extra)
    second = _torchrun(tmp_path, "--steps", M, "--resume", tmp_path / "ckpt",
                       "--params", tmp_path / "resumed.pt", *extra)
    return (torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt"),
            first.stderr + second.stderr)


def _assert_bit_for_bit(full, resumed):
    assert len(full) == len(resumed) == 6
    for a, b in zip(full, resumed):
        assert torch.equal(a, b), f"max difference {(a - b).abs().max().item()}"


def test_resume_continues_bit_for_bit_over_gloo(tmp_path):
    full, resumed, stderr = _train_three_ways(tmp_path)
    _assert_bit_for_bit(full, resumed)
    assert "ResumeWarning" not in stderr
    saved = torch.load(tmp_path / "ckpt/rank1.pt")["thc"]
    # several DDP buckets (bucket_cap_mb=0.01), each with its own error and round counter
    assert len(saved["bucket_sizes"]) >= 2
    assert saved["allreduce"]["calls"] == {k: N - 1 for k in saved["bucket_sizes"]} | \
        {0: N}   # key 0 also ran DDP's first, single-bucket step
    assert all(e.device.type == "cpu" and e.abs().sum() > 0
               for e in saved["allreduce"]["error_feedback"].values())


def test_resume_continues_bit_for_bit_through_the_udp_service(tmp_path):
    base = free_port()
    while base + 1 >= 65536:
        base = free_port()
    config = SwitchConfig.local(workers=2, port_base=base)
    config.save(tmp_path / "job.json")
    with serve(config, "127.0.0.1", 0) as svc:         # one aggregator for all three runs
        full, resumed, _ = _train_three_ways(
            tmp_path, "--aggregator", f"127.0.0.1:{svc.address[1]}",
            "--job-config", tmp_path / "job.json")
        counters = svc.counters()["jobs"][1]
    _assert_bit_for_bit(full, resumed)
    assert counters["straggler_notices"] == 0
    assert counters["flushes"] > 0 and counters["results_multicast"] >= 2 * (N + M)


def test_the_readme_training_loop_commands_run_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using THC from your training loop", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    assert "custom_loop_train.py" in block and "--resume ckpt" in block
    # As written, from a directory that looks like the repository root (its ckpt/ must not
    # land in the working tree); torchrun's port from its environment (PET_MASTER_PORT).
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "host").symlink_to(ROOT / "host")
    env = {k: v for k, v in os.environ.items() if not k.startswith("THC_")}
    env.update(PET_MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400)
    assert res.returncode == 0, res.stdout[-4000:]
    # (the ranks share one stdout: a line may end without its newline before the other's)
    loop = re.findall(r"rank (\d): loss ([\d.]+) -> ([\d.]+), parameter checksum "
                      r"(-?\d+\.\d+(?:e[-+]?\d+)?)", res.stdout)
    assert sorted(r for r, *_ in loop) == ["0", "1"], res.stdout[-4000:]
    assert all(float(last) < 0.2 * float(first) for _, first, last, _ in loop)
    assert len({checksum for *_, checksum in loop}) == 1              # replicas agree
    assert sorted(re.findall(r"rank (\d): step 40,", res.stdout)) == ["0", "1"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert "ResumeWarning" not in res.stdout


# --------------------------------------------------------------------------- in processes

def _init(rank, init, world=2):
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def _ddp_model():
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 8), nn.ReLU(),
                                                             nn.Linear(8, 2)))


def _steps(model, opt, state, n, rank):
    model.register_comm_hook(state, thc_hook)
    for step in range(n):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _warned(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, ResumeWarning)]


def _resume_worker(rank, init, queue):
    try:
        _init(rank, init)
        out = {}
        model = _ddp_model()
        state = thc_hook_state()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        out["fresh"] = _warned(lambda: _steps(model, opt, state, 2, rank))
        saved_opt, saved_thc = opt.state_dict(), state.state_dict()
        state.close()

        # A resumed job that restores model and optimizer but not the hook state.
        model = _ddp_model()
        state = thc_hook_state()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.load_state_dict(saved_opt)
        out["forgot"] = _warned(lambda: _steps(model, opt, state, 2, rank))
        out["load_late"] = _error(lambda: state.load_state_dict(saved_thc))
        state.close()

        # Restored: no warning.
        model = _ddp_model()
        state = thc_hook_state()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.load_state_dict(saved_opt)
        state.load_state_dict(saved_thc)
        out["restored"] = _warned(lambda: _steps(model, opt, state, 1, rank))
        state.close()

        # Refusals, each naming both values.
        other = [None, None]
        dist.all_gather_object(other, saved_thc)
        out["other_rank"] = _error(lambda: thc_hook_state().load_state_dict(other[1 - rank]))
        out["codec"] = _error(lambda: thc_hook_state(
            codec=thc.THCCodec(granularity=20)).load_state_dict(saved_thc))
        out["domain"] = _error(lambda: thc_hook_state(
            error_domain="gradient").load_state_dict(saved_thc))
        out["entries"] = _error(lambda: thc_hook_state().load_state_dict(
            saved_thc["allreduce"]))
        queue.put((rank, out))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.fixture(scope="module")
def resume_results():
    return run_worker_processes(_resume_worker, lambda r, init, q: (r, init, q), 2)


def test_a_resume_that_forgot_the_hook_state_warns_once(resume_results):
    for out in resume_results.values():
        assert out["fresh"] == [] and out["restored"] == []
        assert len(out["forgot"]) == 1                    # two steps, one warning
        assert "state.load_state_dict" in out["forgot"][0]


def test_loading_refuses_other_settings_ranks_and_states(resume_results):
    for rank, out in resume_results.items():
        assert out["load_late"].startswith("RuntimeError") and \
            "before the first step" in out["load_late"]
        assert f"rank {1 - rank}" in out["other_rank"] and f"rank is {rank}" in out["other_rank"]
        assert "granularity=30" in out["codec"] and "granularity=20" in out["codec"]
        assert "error_domain='rotated'" in out["domain"] and \
            "error_domain='gradient'" in out["domain"]
        assert "missing entries ['allreduce'" in out["entries"]
