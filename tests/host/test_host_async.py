"""The asynchronous exchange and the pipelined THC allreduce, with real gloo process groups
and the reference aggregator (torch.multiprocessing, 3 workers).

One launch runs the scenarios in order and sends their outcomes back; a second launch has
a worker that dies in the middle of training.
"""
import datetime
import os
import time
import traceback

import numpy as np
import pytest

import thc
from host.allreduce import CHUNK_KEY_STRIDE

from hosttest_util import free_port, job_config, run_worker_processes

WORLD = 3
D = 50_000
PARTITION = 1 << 12
PIPELINE = 1 << 13            # 50,000 floats -> 7 chunks of whole partitions


def grad(rank, d=D, seed=0):
    return np.random.default_rng(1000 * seed + rank).standard_normal(d).astype(np.float32)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _states(rank, aggregator, members, **kw):
    """(through the aggregator, over gloo), both pipelined."""
    from host.ddp_hook import thc_hook_state
    codec = thc.THCCodec(seed=5, partition_size=PARTITION)
    gloo = thc_hook_state(codec=codec, pipeline_values=PIPELINE, **kw)
    if aggregator is None:
        return None, gloo
    agg = thc_hook_state(aggregator=aggregator, job_config=job_config(members, 16), codec=codec,
                         job=1, pool_size=16, worker_address=tuple(members[rank]),
                         values_per_packet=256,
                         pipeline_values=PIPELINE, **kw)
    return agg, gloo


def _scenarios(rank, aggregator, members):
    import torch
    import torch.nn as nn

    from host.ddp_hook import allreduce_gradients, thc_hook

    out = {}
    agg, gloo = _states(rank, aggregator, members, error_feedback=False, timeout=10)
    g = torch.from_numpy(grad(rank))
    # Pipelined: 7 chunks through the aggregator and over gloo.
    out["chunks"] = agg.allreduce.chunk_ranges(D)
    out["agg"] = agg.reduce(g, 0).numpy()
    out["gloo"] = gloo.reduce(g, 0).numpy()
    # Error feedback, chunk by chunk: the stored error after one call.
    _, ef = _states(rank, None, members)
    ef.reduce(g, 3)
    out["ef_error"] = ef.allreduce.error_feedback.error(3).numpy().copy()
    _, ef_grad = _states(rank, None, members, error_domain="gradient")
    ef_grad.reduce(g, 3)
    out["ef_error_gradient"] = ef_grad.allreduce.error_feedback.error(3).numpy().copy()
    # Asynchronous: the call returns before the exchange is done; futures complete in
    # submission order (the callbacks run as each completes).
    order = []
    sizes = [200_000, 3_000, 40_000, 10]
    inputs = [torch.from_numpy(grad(rank, n, seed=i + 1)) for i, n in enumerate(sizes)]
    futs = []
    for i, x in enumerate(inputs):
        futs.append(agg.reduce_async(x, 10 + i).then(lambda f, i=i: order.append(i)))
        if i == 0:
            out["returned_before_done"] = not futs[0].done()
    for f in futs:
        f.wait()
    out["order"] = order
    # allreduce_gradients, asynchronously.
    lin = nn.Linear(64, 32)
    lin.weight.grad = torch.full_like(lin.weight, float(rank))
    lin.bias.grad = torch.full_like(lin.bias, float(rank))
    done = allreduce_gradients(lin.parameters(), gloo, key=5, async_op=True)
    done.wait()
    out["function_async"] = lin.weight.grad.numpy().copy()
    # An error in the exchange thread reaches backward()'s caller: a NaN gradient on
    # worker 1 at step 2 fails every worker's backward with the NaN message.
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 8), nn.ReLU(),
                                                              nn.Linear(8, 1)))
    model.register_comm_hook(agg, thc_hook)
    steps = []
    for step in range(3):
        x = torch.randn(4, 16)
        if step == 2 and rank == 1:
            x[0, 0] = float("nan")
        steps.append(_outcome(lambda: model(x).square().mean().backward()))
    out["ddp_steps"] = steps
    # The NaN was refused by every worker before anything was sent: the state still works.
    out["after_nan"] = agg.reduce(g[:1000], 0).numpy()
    return out


def _dying_scenario(rank, aggregator, members):
    """Worker 2 exits at step 3; workers 0 and 1 see backward() fail, then fail fast."""
    import torch
    import torch.nn as nn

    from host.ddp_hook import thc_hook
    agg, _ = _states(rank, aggregator, members, timeout=3)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(32, 4))
    model.register_comm_hook(agg, thc_hook)
    for step in range(5):
        if step == 3 and rank == 2:
            os._exit(0)
        t0 = time.monotonic()
        result = _outcome(lambda: model(torch.randn(8, 32)).square().mean().backward())
        if result[0] != "ok":
            t1 = time.monotonic()
            again = _outcome(lambda: agg.reduce(torch.ones(100), 99))
            return {"step": step, "error": result, "seconds": t1 - t0, "again": again,
                    "again_seconds": time.monotonic() - t1}
    return {"step": None}


def _worker(rank, init, aggregator, members, queue, scenario):
    import numba
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        fn = _dying_scenario if scenario == "dying" else _scenarios
        queue.put((rank, fn(rank, aggregator, members)))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _launch(scenario, expect=WORLD):
    from dataplane.udp_service import serve
    members = [("127.0.0.1", free_port()) for _ in range(WORLD)]
    svc = serve(job_config(members, 16), "127.0.0.1", 0)
    aggregator = f"{svc.address[0]}:{svc.address[1]}"
    try:
        return run_worker_processes(
            _worker, lambda r, init, queue: (r, init, aggregator, members, queue, scenario),
            WORLD, expect=expect, seconds=240, fail_on_death=False)
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def run():
    return _launch("scenarios")


def simulate_pipelined(grads, ranges, codec, key=0, rnd=0):
    """What the pipelined allreduce computes: each chunk coded on its own, with the
    chunk's max norms and rounding key key + k * CHUNK_KEY_STRIDE; the decoded mean
    (no error feedback), and each worker's rotated-domain error after its first call with
    error feedback (e_rot = RHT(x) - own quantized values, over the padded chunks: the
    norms then are those of the rotated values), and in the gradient domain (e = x -
    RHT^-1(own quantized values))."""
    mean = np.zeros(len(grads[0]), np.float32)
    errors, gradient_errors = [[] for _ in grads], [[] for _ in grads]
    for k, (lo, hi) in enumerate(ranges):
        parts = [g[lo:hi] for g in grads]
        norms = np.max([codec.partition_norms(p) for p in parts], axis=0)
        tensor = key + k * CHUNK_KEY_STRIDE
        packed = [codec.quantize(codec.rotate(p), norms, worker=w, round=rnd, tensor=tensor)
                  for w, p in enumerate(parts)]
        total = np.sum([codec.lookup(q).astype(np.int32) for q in packed], axis=0)
        mean[lo:hi] = codec.decode(total, len(grads), norms, hi - lo)
        for w, q in enumerate(packed):
            own = codec.inverse_rotate(codec.dequantize(q, norms), hi - lo)
            gradient_errors[w].append(parts[w] - own)
        rotated = [codec.rotate_and_norms(p) for p in parts]
        norms = np.max([n for _, n in rotated], axis=0)
        for w, (rot, _) in enumerate(rotated):
            q = codec.quantize(rot, norms, worker=w, round=rnd, tensor=tensor)
            errors[w].append(rot - codec.dequantize(q, norms))
    return mean, [np.concatenate(e) for e in errors], \
        [np.concatenate(e) for e in gradient_errors]


def test_pipelined_allreduce_is_exact_chunk_by_chunk(run):
    grads = [grad(r) for r in range(WORLD)]
    codec = thc.THCCodec(seed=5, partition_size=PARTITION)
    ranges = [tuple(r) for r in run[0]["chunks"]]
    assert len(ranges) == 7 and ranges[0] == (0, PIPELINE) and ranges[-1][1] == D
    expected, _, _ = simulate_pipelined(grads, ranges, codec)
    _, errors, gradient_errors = simulate_pipelined(grads, ranges, codec, key=3)
    for r in range(WORLD):
        # Homomorphism: the sums are the same wherever they are added, chunk by chunk.
        assert np.array_equal(run[r]["agg"], run[r]["gloo"])
        np.testing.assert_allclose(run[r]["agg"], expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(run[r]["ef_error"], errors[r], rtol=0, atol=1e-6)
        np.testing.assert_allclose(run[r]["ef_error_gradient"], gradient_errors[r], rtol=0,
                                   atol=1e-6)
    mean = np.mean(grads, axis=0)
    assert np.sum((run[0]["agg"] - mean) ** 2) / np.sum(mean ** 2) < 0.05


def test_async_calls_return_at_once_and_complete_in_order(run):
    for r in range(WORLD):
        assert run[r]["returned_before_done"]
        assert run[r]["order"] == [0, 1, 2, 3]
        g = run[r]["function_async"]
        assert abs(g.mean() - 1.0) < 0.02                   # mean(0, 1, 2), THC-compressed


def test_an_exchange_error_reaches_backwards_caller(run):
    for r in range(WORLD):
        steps = run[r]["ddp_steps"]
        assert [kind for kind, _ in steps[:2]] == ["ok", "ok"]
        kind, msg = steps[2]
        assert kind == "RuntimeError" and "NonFiniteError" in msg and "worker(s) [1]" in msg
        assert np.isfinite(run[r]["after_nan"]).all()


def test_a_worker_that_dies_fails_the_others_backward_not_a_hang():
    results = _launch("dying", expect=WORLD - 1)
    for r in (0, 1):
        out = results[r]
        assert out["step"] == 3, out
        kind, msg = out["error"]
        assert kind == "RuntimeError"
        assert out["seconds"] < 60                          # an error, not a hang
        kind, msg = out["again"]
        assert kind == "AllreduceError" and "earlier THC exchange" in msg
        assert out["again_seconds"] < 1                     # fails at once


def test_the_codec_lets_the_training_thread_run():
    """The exchange thread's Numba kernels release the GIL: a Python thread keeps running
    while one long quantize call (a single kernel launch) is in progress. (A plain @njit
    loop without nogil=True holds the GIL for its whole run: one gap as long as the call.)
    The best of five calls counts: on a busy machine the OS may not run the other thread
    during any one of them."""
    import threading

    import numba
    codec = thc.THCCodec(seed=1)
    x = np.random.default_rng(0).standard_normal(1 << 24).astype(np.float32)
    rotated = codec.rotate(x)
    norms = codec.partition_norms(x)
    codec.quantize(rotated, norms, worker=0, round=0, tensor=0)       # compiled and warm
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    best = None
    try:
        for attempt in range(5):
            ticks, stop = [], threading.Event()

            def count():
                while not stop.is_set():
                    ticks.append(time.perf_counter())
            spinner = threading.Thread(target=count)
            spinner.start()
            time.sleep(0.02)
            t0 = time.perf_counter()
            codec.quantize(rotated, norms, worker=0, round=attempt + 1, tensor=0)
            t1 = time.perf_counter()
            stop.set()
            spinner.join()
            inside = [t for t in ticks if t0 <= t <= t1]
            gap = float(np.diff(np.concatenate([[t0], inside, [t1]])).max()) / (t1 - t0)
            best = gap if best is None else min(best, gap)
    finally:
        numba.set_num_threads(threads)
    # Holding the GIL, the kernel would leave one gap as long as itself (ratio ~1).
    assert best < 0.5, best


@pytest.mark.parametrize("cpus, local_workers, policy, available, expected", [
    (2, 1, None, 2, 1),          # spinning threads: one core of the two stays free
    (2, 1, "PASSIVE", 2, 2),     # threads that sleep when idle may take the whole share
    (2, 4, None, 2, 1),          # more workers than cores: one thread each, never zero
    (16, 2, None, 16, 7),
    (16, 2, "passive", 16, 8),
    (16, 1, None, 4, 4),         # never more than Numba has
])
def test_codec_threads_leave_a_core_to_the_worker_where_libgomp_spins(
        monkeypatch, cpus, local_workers, policy, available, expected):
    from host.allreduce import codec_threads
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_workers))
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert codec_threads(available) == expected


def test_the_exchange_thread_runs_the_codec_on_codec_threads():
    """The rule above is what the exchange thread's Numba kernels get (a fresh thread
    started by submit, in this process)."""
    import numba

    from host.allreduce import ExchangeThread, codec_threads
    thread = ExchangeThread()
    try:
        got = thread.submit(numba.get_num_threads).wait()
    finally:
        assert thread.stop()
    assert got == codec_threads(numba.get_num_threads())
