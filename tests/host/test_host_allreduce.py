"""THC allreduce and the DDP hook with real gloo process groups (torch.multiprocessing).

One set of 3 worker processes runs every scenario in order (process start-up dominates on
this machine); each scenario's outcome comes back to the parent, and the tests below check
them one by one.
"""
import datetime
import traceback

import numpy as np
import pytest

import thc
from host.allreduce import CALL_HISTORY

from hosttest_util import free_port, job_config, run_worker_processes

WORLD = 3
D = 50_000
PARTITION = 1 << 14


def grad(rank, d=D, seed=0):
    return np.random.default_rng(1000 * seed + rank).standard_normal(d).astype(np.float32)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _scenarios(rank, aggregator, members):
    import torch
    import torch.nn as nn

    from host.ddp_hook import allreduce_gradients, thc_hook, thc_hook_state

    out = {}
    codec = thc.THCCodec(seed=5, partition_size=PARTITION)
    sum_state = thc_hook_state(codec=codec, error_feedback=False)
    agg_state = thc_hook_state(aggregator=aggregator, job_config=job_config(members, 16),
                               codec=codec, job=1, pool_size=16,
                               worker_address=tuple(members[rank]), error_feedback=False,
                               timeout=10)
    g = torch.from_numpy(grad(rank))
    out["sum_path"] = sum_state.reduce(g, 0).numpy()
    out["aggregator_path"] = agg_state.reduce(g, 0).numpy()
    out["transport"] = agg_state.allreduce.exchange.transport.stats.as_dict()
    calls = agg_state.allreduce.call_seconds
    out["call_history"] = (len(calls), calls.maxlen, min(calls))
    # Error feedback: the stored error is x - own decoded, non-zero and finite.
    ef_state = thc_hook_state(codec=codec)
    ef_state.reduce(g, 7)
    err = ef_state.allreduce.error_feedback.error(7)
    out["ef_error_norm"] = float(err.norm()) / float(g.norm())
    # bfloat16 in -> bfloat16 out, same shape.
    bf = ef_state.reduce(g[:1000].reshape(10, 100).to(torch.bfloat16), 8)
    out["bf16"] = (str(bf.dtype), tuple(bf.shape))
    # Misuse: mismatched sizes, NaN on one worker, an integer tensor.
    out["mismatch"] = _outcome(lambda: sum_state.reduce(torch.zeros(100 + (rank == 1)), 1))
    bad = g[:500].clone()
    if rank == 2:
        bad[17] = float("nan")
    out["nan"] = _outcome(lambda: agg_state.reduce(bad, 2))
    dtype = torch.int64 if rank == 1 else torch.float32     # only worker 1 is wrong
    out["int"] = _outcome(lambda: sum_state.reduce(torch.zeros(10, dtype=dtype), 3))
    # The same checks on a tensor whose size was verified before (one combined exchange),
    # and a size change made by every worker at once (DDP rebuilding its buckets).
    sum_state.reduce(g[:300], 11)
    sum_state.reduce(g[:300], 11)
    out["mismatch_verified"] = _outcome(lambda: sum_state.reduce(g[:300 + (rank == 0)], 11))
    nan_later = g[:300].clone()
    nan_later[0] = float("inf") if rank == 0 else 0.0
    out["nan_verified"] = _outcome(lambda: sum_state.reduce(nan_later, 11))
    out["resized_everywhere"] = sum_state.reduce(g[:500], 11).numpy()
    out["resized_again"] = sum_state.reduce(g[:500], 11).numpy()
    sum_state.reduce(g[:2000], 12)
    out["combined_round1"] = sum_state.reduce(g[:2000], 12).numpy()   # combined exchange
    # Both paths keep working after the errors (the checks run before anything is sent).
    out["after_errors"] = agg_state.reduce(g[:3000], 4).numpy()
    # DDP hook: a small regression model trains, replicas stay identical.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(agg_state, thc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rng = np.random.default_rng(rank)
    w_true = np.random.default_rng(99).standard_normal((16, 1)).astype(np.float32)
    losses = []
    for _ in range(40):
        x = torch.from_numpy(rng.standard_normal((32, 16)).astype(np.float32))
        y = x @ torch.from_numpy(w_true)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    out["ddp_losses"] = losses
    out["ddp_params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    # Plain function API on a custom loop.
    model2 = nn.Linear(64, 32)
    model2.weight.grad = torch.full_like(model2.weight, float(rank))
    model2.bias.grad = torch.full_like(model2.bias, float(rank))
    allreduce_gradients(model2.parameters(), sum_state, key=5)
    out["function_api"] = model2.weight.grad.numpy().copy()
    return out


def _worker(rank, init, aggregator, members, queue, absent):
    import numba
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)             # three workers share two cores
    numba.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        if absent:
            queue.put((rank, _absent_rank_scenario(rank)))
        else:
            queue.put((rank, _scenarios(rank, aggregator, members)))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _absent_rank_scenario(rank):
    """Rank 2 joins the process group but never calls the THC allreduce."""
    import time

    import torch

    from host.ddp_hook import thc_hook_state
    if rank == 2:
        time.sleep(6)
        return {}
    state = thc_hook_state(start_timeout=2)
    t0 = time.monotonic()
    result = _outcome(lambda: state.reduce(torch.ones(10), 0))
    return {"absent": result, "seconds": time.monotonic() - t0}


def _launch(absent=False):
    from dataplane.udp_service import serve
    members = [("127.0.0.1", free_port()) for _ in range(WORLD)]
    svc = serve(job_config(members, 16), "127.0.0.1", 0)
    aggregator = f"{svc.address[0]}:{svc.address[1]}"
    try:
        results = run_worker_processes(
            _worker, lambda r, init, queue: (r, init, aggregator, members, queue, absent),
            WORLD, seconds=150)
    finally:
        counters = svc.stop()
    return results, counters


@pytest.fixture(scope="module")
def run():
    return _launch()


def test_sum_path_equals_codec_simulation_and_aggregator_path(run):
    results, _ = run
    grads = [grad(r) for r in range(WORLD)]
    codec = thc.THCCodec(seed=5, partition_size=PARTITION)
    simulated = codec.simulate_allreduce(grads, round=0, tensor=0)
    for r in range(WORLD):
        assert np.array_equal(results[r]["sum_path"], results[0]["sum_path"])
        # Homomorphism: the integer sums are the same wherever they are added.
        assert np.array_equal(results[r]["aggregator_path"], results[r]["sum_path"])
        np.testing.assert_allclose(results[r]["sum_path"], simulated, rtol=0, atol=1e-6)
    mean = np.mean(grads, axis=0)
    nmse = np.sum((results[0]["sum_path"] - mean) ** 2) / np.sum(mean ** 2)
    assert nmse < 0.05                                   # THC b=4: ~0.02 for n=3 Gaussians
    # one timed call so far, in a history bounded for long jobs
    n, maxlen, shortest = results[0]["call_history"]
    assert n == 1 and maxlen == CALL_HISTORY and shortest > 0


def test_error_feedback_and_dtypes(run):
    results, _ = run
    for r in range(WORLD):
        assert 0 < results[r]["ef_error_norm"] < 0.5
        assert results[r]["bf16"] == ("torch.bfloat16", (10, 100))


def test_misuse_gives_the_same_clear_error_on_every_worker(run):
    results, _ = run
    for r in range(WORLD):
        kind, msg = results[r]["mismatch"]
        assert kind == "SizeMismatchError" and "smallest 100, largest 101" in msg
        kind, msg = results[r]["nan"]
        assert kind == "NonFiniteError" and "worker(s) [2]" in msg
        kind, msg = results[r]["int"]
        assert kind == "TypeError" and "worker(s) [1]" in msg
        assert ("torch.int64" in msg) == (r == 1)
        assert np.isfinite(results[r]["after_errors"]).all()
        kind, msg = results[r]["mismatch_verified"]
        assert kind == "SizeMismatchError" and "smallest 300, largest 301" in msg
        kind, msg = results[r]["nan_verified"]
        assert kind == "NonFiniteError" and "worker(s) [0]" in msg
    codec = thc.THCCodec(seed=5, partition_size=PARTITION)
    simulated = codec.simulate_allreduce([grad(r)[:2000] for r in range(WORLD)], round=1,
                                         tensor=12)
    np.testing.assert_allclose(results[0]["combined_round1"], simulated, rtol=0, atol=1e-6)
    mean500 = np.mean([grad(r)[:500] for r in range(WORLD)], axis=0)
    for key in ("resized_everywhere", "resized_again"):
        got = results[0][key]
        assert np.array_equal(got, results[1][key])
        assert np.sum((got - mean500) ** 2) / np.sum(mean500 ** 2) < 0.05


def test_ddp_hook_trains_and_replicas_agree(run):
    results, counters = run
    losses = np.array(results[0]["ddp_losses"])
    assert losses[-10:].mean() < 0.2 * losses[:5].mean()
    for r in range(1, WORLD):
        assert np.array_equal(results[r]["ddp_params"], results[0]["ddp_params"])
    assert counters["jobs"][1]["results_multicast"] >= 40


def test_function_api_averages_gradients(run):
    results, _ = run
    for r in range(WORLD):
        g = results[r]["function_api"]
        assert np.array_equal(g, results[0]["function_api"])
        assert abs(g.mean() - 1.0) < 0.02                # mean(0, 1, 2), THC-compressed
        assert np.mean((g - 1.0) ** 2) < 0.05            # codec error, not a wrong mean


def test_a_worker_that_never_shows_up_is_named():
    results, _ = _launch(absent=True)
    for r in (0, 1):
        kind, msg = results[r]["absent"]
        assert kind == "AllreduceError" and "waiting for every worker" in msg
        assert results[r]["seconds"] < 10                  # the start timeout, not a hang
    assert "Rank 2 failed to pass" in results[0]["absent"][1]   # rank 0 names the absent one
