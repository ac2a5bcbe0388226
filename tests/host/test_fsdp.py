"""THC as FSDP2's reduce-scatter (host/fsdp.py), with real processes on gloo.

FSDP2 runs on the CPU with gloo in this torch (2.13): gloo reduce-scatters float32, uint8
and int32 tensors and takes ReduceOp.AVG, which fully_shard passes for float32 gradients.
"""
import datetime
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import thc
from dataplane.config import SwitchConfig
from dataplane.udp_service import serve
from host.allreduce import CHUNK_KEY_STRIDE
from host.fsdp import THCReduceScatter, op_scale, thc_fully_shard_comm

from hosttest_util import free_port, run_worker_processes

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
PARTITION = 1 << 10
SHARD = 2500                 # 2 whole partitions and a tail of 452 (padded to 512) per shard
TRAIN_STEPS = 60
README_COMMAND = "torchrun --nproc-per-node 2 host/experiments/fsdp_train.py"


def gradient(rank, d=WORLD * SHARD, seed=0):
    return np.random.default_rng(100 * seed + rank).standard_normal(d).astype(np.float32)


def _outcome(fn):
    try:
        fn()
        return ("ok", "")
    except Exception as exc:
        return (type(exc).__name__, str(exc))


# --------------------------------------------------------------------------- workers

def _reduce_scatter_scenarios(rank, aggregator, job_path):
    from host.ddp_hook import thc_hook_state
    codec = thc.THCCodec(seed=3, partition_size=PARTITION)
    gloo = thc_hook_state(codec=codec)
    agg = thc_hook_state(aggregator=aggregator, job_config=job_path, codec=codec, timeout=10)
    world_group = dist.group.WORLD
    out = {}
    x = torch.from_numpy(gradient(rank))
    rs_gloo, rs_agg, rs_sum = (THCReduceScatter(gloo), THCReduceScatter(agg),
                               THCReduceScatter(gloo))
    out["keys"] = [rs_gloo.key, rs_agg.key, rs_sum.key]
    # Its max-norm exchange shares the state's group: calls on it keep their end agreement.
    out["defers_end_agreement"] = agg.allreduce.defer_end_agreement
    for name, rs, op in (("gloo", rs_gloo, dist.ReduceOp.AVG), ("agg", rs_agg, dist.ReduceOp.AVG),
                         ("gloo_sum", rs_sum, dist.ReduceOp.SUM)):
        y = rs.allocate((SHARD,), dtype=torch.float32, device=torch.device("cpu"))
        rs(y, x.clone(), world_group, op)
        out[name] = y.numpy().copy()
    out["error_after_1"] = gloo.allreduce.error_feedback.error(rs_gloo.key).numpy().copy()
    # Round 2: the stored error goes into the rotation (error feedback per buffer).
    y = torch.empty(SHARD)
    rs_gloo(y, torch.from_numpy(gradient(rank, seed=1)), world_group, dist.ReduceOp.AVG)
    out["gloo_round2"] = y.numpy().copy()
    # bfloat16 in, bfloat16 out (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)).
    y = torch.empty(SHARD, dtype=torch.bfloat16)
    rs_half = THCReduceScatter(gloo)
    rs_half(y, x.to(torch.bfloat16), world_group, dist.ReduceOp.AVG)
    out["bf16"] = (str(y.dtype), y.float().numpy().copy())

    # Bad input: a clear error, on every worker alike; the reduce-scatter stays usable.
    groups = [dist.new_group([0]), dist.new_group([1])]
    out["wrong_group"] = _outcome(lambda: rs_gloo(torch.empty(SHARD), x, groups[rank],
                                                  dist.ReduceOp.AVG))
    out["integer"] = _outcome(lambda: rs_gloo(torch.empty(SHARD, dtype=torch.int32),
                                              x.int(), world_group, dist.ReduceOp.AVG))
    out["odd_length"] = _outcome(lambda: rs_gloo(torch.empty(3), torch.ones(7), world_group,
                                                 dist.ReduceOp.AVG))
    out["wrong_output"] = _outcome(lambda: rs_gloo(torch.empty(SHARD - 1), x, world_group,
                                                   dist.ReduceOp.AVG))
    out["max_op"] = _outcome(lambda: rs_gloo(torch.empty(SHARD), x, world_group,
                                             dist.ReduceOp.MAX))
    bad = x.clone()
    if rank == 1:
        bad[17] = float("nan")
    out["nan"] = _outcome(lambda: rs_gloo(torch.empty(SHARD), bad, world_group,
                                          dist.ReduceOp.AVG))
    out["after_errors"] = _outcome(lambda: rs_gloo(torch.empty(SHARD), x, world_group,
                                                   dist.ReduceOp.AVG))
    gloo.close()
    agg.close()
    return out


def _training_runs(rank, aggregator, job_path):
    from host.experiments.fsdp_train import train
    return {"fp32": train("fp32", steps=TRAIN_STEPS),
            "thc": train("thc", steps=TRAIN_STEPS),
            "thc_agg": train("thc", steps=TRAIN_STEPS,
                             thc_options={"aggregator": aggregator, "job_config": job_path})}


def _worker(rank, init, aggregator, job_path, queue, scenario):
    import numba
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        fn = _training_runs if scenario == "training" else _reduce_scatter_scenarios
        queue.put((rank, fn(rank, aggregator, job_path)))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _launch(scenario, tmp_path):
    """Run `scenario` on WORLD worker processes next to a reference UDP aggregator; returns
    (per-rank results, the aggregator's job counters)."""
    config = SwitchConfig.local(addresses=[("127.0.0.1", free_port()) for _ in range(WORLD)])
    job_path = str(tmp_path / "job.json")
    config.save(job_path)
    with serve(config, "127.0.0.1", 0) as svc:
        aggregator = f"127.0.0.1:{svc.address[1]}"
        results = run_worker_processes(
            _worker, lambda r, init, queue: (r, init, aggregator, job_path, queue, scenario),
            WORLD, seconds=400)
        counters = svc.counters()["jobs"][1]
    return results, counters


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    return _launch("scenarios", tmp_path_factory.mktemp("fsdp_rs"))


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return _launch("training", tmp_path_factory.mktemp("fsdp_train"))


# --------------------------------------------------------------------------- reference

def reference(inputs, codec, key, errors=None, rnd=0):
    """What every rank's shard should decode to: each shard coded on its own (own max
    norms, rounding key key + r * CHUNK_KEY_STRIDE), every worker's rotated error added
    first (errors[w][r], or none); returns (the mean of each shard, each worker's new
    error per shard)."""
    means, new_errors = [], [[None] * WORLD for _ in inputs]
    for r in range(WORLD):
        rotated = [codec.rotate_and_norms(x[r * SHARD:(r + 1) * SHARD],
                                          add=None if errors is None else errors[w][r])
                   for w, x in enumerate(inputs)]
        norms = np.max([n for _, n in rotated], axis=0)
        packed = [codec.quantize(rot, norms, worker=w, round=rnd,
                                 tensor=key + r * CHUNK_KEY_STRIDE)
                  for w, (rot, _) in enumerate(rotated)]
        sums = np.sum([codec.lookup(q).astype(np.int32) for q in packed], axis=0)
        means.append(codec.decode(sums, WORLD, norms, SHARD))
        for w, ((rot, _), q) in enumerate(zip(rotated, packed)):
            new_errors[w][r] = rot - codec.dequantize(q, norms)
    return means, new_errors


# --------------------------------------------------------------------------- tests

def test_each_rank_decodes_its_own_shard_exactly_as_thc_would(scenarios):
    results, counters = scenarios
    codec = thc.THCCodec(seed=3, partition_size=PARTITION)
    inputs = [gradient(w) for w in range(WORLD)]
    key_gloo, key_agg, key_sum = results[0]["keys"]
    # Keys per state: the same on every rank, one per reduce-scatter of a state.
    assert results[1]["keys"] == results[0]["keys"] and key_gloo != key_sum
    expected, errors = reference(inputs, codec, key_gloo)
    expected_agg, _ = reference(inputs, codec, key_agg)
    expected_sum, _ = reference(inputs, codec, key_sum)
    second, _ = reference([gradient(w, seed=1) for w in range(WORLD)], codec, key_gloo,
                          errors=errors, rnd=1)
    for r in range(WORLD):
        out = results[r]
        np.testing.assert_allclose(out["gloo"], expected[r], rtol=0, atol=1e-6)
        np.testing.assert_allclose(out["agg"], expected_agg[r], rtol=0, atol=1e-6)
        # SUM: FSDP divides itself (float16, set_force_sum_reduction_for_comms).
        np.testing.assert_allclose(out["gloo_sum"], WORLD * expected_sum[r], rtol=0, atol=2e-6)
        # This worker's error for every shard it sent, fed into the next call.
        np.testing.assert_allclose(out["error_after_1"], np.concatenate(errors[r]), rtol=0,
                                   atol=1e-6)
        np.testing.assert_allclose(out["gloo_round2"], second[r], rtol=0, atol=1e-6)
        dtype, half = out["bf16"]
        assert dtype == "torch.bfloat16"
        true_mean = np.mean(inputs, axis=0)[r * SHARD:(r + 1) * SHARD]
        assert np.sum((half - true_mean) ** 2) / np.sum(true_mean ** 2) < 0.05
        assert out["defers_end_agreement"] is False
    assert counters["results_multicast"] > 0 and counters["drop_not_member"] == 0


def test_bad_input_gets_a_clear_error(scenarios):
    results, _ = scenarios
    for r in range(WORLD):
        out = results[r]
        kind, msg = out["wrong_group"]
        assert kind == "ValueError" and "group of 1 ranks" in msg and "2 workers" in msg \
            and "thc_hook_state(group=" in msg
        kind, msg = out["integer"]
        assert kind == "TypeError" and "not floating" in msg and "worker(s) [0, 1]" in msg
        kind, msg = out["odd_length"]
        assert kind == "ValueError" and "7 values" in msg and "multiple of 2" in msg
        kind, msg = out["wrong_output"]
        assert kind == "ValueError" and f"{SHARD - 1} values" in msg and f"has {SHARD}" in msg
        kind, msg = out["max_op"]
        assert kind == "ValueError" and "AVG, SUM or PREMUL_SUM" in msg
        kind, msg = out["nan"]
        assert kind == "NonFiniteError" and "worker(s) [1]" in msg
        assert out["after_errors"] == ("ok", "")


def test_fsdp_with_thc_trains_to_fp32_accuracy(training):
    results, counters = training
    for r in range(WORLD):
        out = results[r]
        for run in ("fp32", "thc", "thc_agg"):          # one model: every rank agrees
            assert out[run]["test_acc"] == results[0][run]["test_acc"]
            assert out[run]["train_loss"] == results[0][run]["train_loss"]
        fp32 = out["fp32"]["test_acc"]
        assert fp32 > 0.9, out
        for run in ("thc", "thc_agg"):
            assert abs(out[run]["test_acc"] - fp32) <= 0.01, out
            # fp32's reduce-scatter sends (W-1)/W of 4 bytes per parameter (85,002).
            assert out[run]["bytes_per_step"] < 0.5 * 85_002 * 4 * (WORLD - 1) / WORLD
        # The same codec settings, keys and integer sums on both paths: the same training.
        assert out["thc_agg"]["train_loss"] == out["thc"]["train_loss"]
    assert counters["results_multicast"] > 0 and counters["drop_not_member"] == 0


def test_readme_command_runs_under_torchrun():
    readme = (ROOT / "README.md").read_text()
    assert README_COMMAND in readme
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    args = README_COMMAND.split()[1:]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--master-port",
                          str(free_port()), *args, "--steps", "10"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    # torchrun relays both ranks' output into one stream, sometimes without line breaks.
    reports = dict(re.findall(r"rank (\d): (thc test accuracy [\d.]+, train loss [\d.]+)",
                              res.stdout))
    assert sorted(reports) == ["0", "1"], res.stdout
    assert reports["0"] == reports["1"], res.stdout                   # one model


def test_scale_for_fsdp_reduce_ops():
    assert op_scale(dist.ReduceOp.AVG, 4) == 1.0
    assert op_scale(dist.ReduceOp.SUM, 4) == 4.0
    assert op_scale(dist.ReduceOp.PREMUL_SUM(0.125), 4) == 0.5
    with pytest.raises(ValueError, match="AVG, SUM or PREMUL_SUM"):
        op_scale(dist.ReduceOp.MAX, 4)


def test_helper_and_constructor_refuse_what_they_cannot_use():
    with pytest.raises(ValueError, match="call torch.distributed.fsdp.fully_shard"):
        thc_fully_shard_comm(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="THCHookState"):
        THCReduceScatter(object())
