"""Training survives its aggregator: real worker processes (gloo), the main job's model and
data, the reference UDP service on loopback (dataplane.udp_service.serve), real sockets.

* The service is stopped at a chosen step and started again (same port) later: every step
  completes, every worker's parameters are identical after each step, the loss goes on
  falling, and the workers go back to the aggregator (its bytes grow again).
* The service stops answering one worker only (a relay drops its results): the others,
  who got every sum, join its redo over the collective, with the same parameters after.
* A worker killed in the middle of a step: the others' backward raises an error that
  names its rank (host.allreduce.WorkerLostError, from a roll call of its heartbeat).
"""
import datetime
import hashlib
import os
import signal
import threading
import time
import traceback
import warnings

import pytest

from dataplane.config import SwitchConfig
from dataplane.udp_service import serve
from host.allreduce import HEARTBEAT_INTERVAL, ROLL_CALL_BEATS
from host.netlab.relay import DOWN, LossyRelay, agg_worker

from hosttest_util import free_port, run_worker_processes

WORLD = 3
HIDDEN = 32
STOP_AT = 5            # the service stops before this step
RESTART_AT = 11        # ... and is back before this one
STEPS = 18             # at least; more while the workers are still on the collective
MAX_STEPS = 60
TIMEOUT = 2.0          # the hook's no-progress timeout (seconds)
PROBE_INTERVAL = 0.05  # seconds between probes of the silent aggregator


def _train(rank, init, cfg_dict, aggregator, events, queue):
    """Full-batch SGD on this worker's shard; per step: the loss on the whole training set,
    a hash of the parameters, bytes through the aggregator, and whether on the collective."""
    import numba
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from host.ddp_hook import thc_hook, thc_hook_state
    from host.experiments.common import load_digits_split, make_model
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    stop_request, stopped, restart_request, restarted = events
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        (x, y), _ = load_digits_split()
        x_all, y_all = torch.from_numpy(x), torch.from_numpy(y)
        x_mine, y_mine = x_all[rank::WORLD], y_all[rank::WORLD]
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(make_model(HIDDEN))
        state = thc_hook_state(aggregator=aggregator, job_config=SwitchConfig.from_dict(cfg_dict),
                               timeout=TIMEOUT, probe_interval=PROBE_INTERVAL)
        model.register_comm_hook(state, thc_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        loss_fn = nn.CrossEntropyLoss()
        ar = state.allreduce
        steps = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = 0
            while step < STEPS or (ar.on_collective and step < MAX_STEPS):
                if step == STOP_AT:
                    if rank == 0:
                        stop_request.set()
                    assert stopped.wait(60)
                if step == RESTART_AT:
                    if rank == 0:
                        restart_request.set()
                    assert restarted.wait(60)
                opt.zero_grad()
                loss_fn(model(x_mine), y_mine).backward()
                opt.step()
                with torch.no_grad():
                    loss = float(loss_fn(model(x_all), y_all))
                params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                steps.append({"loss": loss, "on_collective": ar.on_collective,
                              "params": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
                              "aggregator_bytes": ar.exchange.bytes_sent})
                step += 1
        out = {"steps": steps, "fallback_calls": ar.fallback_calls,
               "returns": ar.aggregator_returns, "probes": ar.exchange.transport.probes,
               "warnings": [str(w.message) for w in caught
                            if "THC: the aggregator" in str(w.message)]}
        state.close()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _orchestrate(stop, restart, events):
    """The test's side: stop() when rank 0 asks, restart() when it asks again."""
    stop_request, stopped, restart_request, restarted = events
    if not stop_request.wait(120):
        return
    stop()
    stopped.set()
    if not restart_request.wait(120):
        return
    restart()
    restarted.set()


def _restart_service(svc_box, cfg, port) -> None:
    svc_box[0] = serve(cfg, "127.0.0.1", port)


@pytest.fixture(scope="module")
def failover_run():
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    events = tuple(ctx.Event() for _ in range(4))
    cfg = SwitchConfig.local(addresses=[("127.0.0.1", free_port()) for _ in range(WORLD)],
                             pool_size=64)
    svc_box = [serve(cfg, "127.0.0.1", 0)]
    host, port = svc_box[0].address
    conductor = threading.Thread(
        target=_orchestrate, daemon=True,
        args=(lambda: svc_box[0].stop(), lambda: _restart_service(svc_box, cfg, port), events))
    conductor.start()
    try:
        yield run_worker_processes(
            _train, lambda r, init, queue: (r, init, cfg.to_dict(), f"{host}:{port}", events,
                                            queue), WORLD, seconds=240)
    finally:
        for e in events:
            e.set()                     # lets the conductor end if a worker never asked
        conductor.join(10)
        svc_box[0].stop()


def test_every_step_completes_with_identical_parameters_on_every_worker(failover_run):
    runs = [failover_run[r]["steps"] for r in range(WORLD)]
    assert len({len(steps) for steps in runs}) == 1
    assert len(runs[0]) >= STEPS
    for i in range(len(runs[0])):
        assert len({steps[i]["params"] for steps in runs}) == 1, f"step {i} differs"
        assert len({steps[i]["on_collective"] for steps in runs}) == 1


def test_the_steps_without_aggregator_go_over_the_collective_and_warn_once(failover_run):
    steps = failover_run[0]["steps"]
    on = [s["on_collective"] for s in steps]
    assert not any(on[:STOP_AT])
    assert all(on[STOP_AT:RESTART_AT])
    # Nothing went through the aggregator while it was down (the probes are not counted).
    down = [s["aggregator_bytes"] for s in steps[STOP_AT:RESTART_AT]]
    assert down[0] == down[-1]
    for r in range(WORLD):
        out = failover_run[r]
        assert out["fallback_calls"] >= RESTART_AT - STOP_AT
        assert sum("did not answer" in w for w in out["warnings"]) == 1
        assert out["probes"] >= 1


def test_the_loss_keeps_decreasing_through_the_failover(failover_run):
    loss = [s["loss"] for s in failover_run[0]["steps"]]
    assert loss[STOP_AT - 1] < loss[0]
    assert loss[RESTART_AT - 1] < loss[STOP_AT - 1]          # trained on the collective
    assert loss[-1] < loss[RESTART_AT - 1]


def test_the_workers_return_to_the_aggregator_when_it_answers_again(failover_run):
    steps = failover_run[0]["steps"]
    assert not steps[-1]["on_collective"]
    back = next(i for i in range(RESTART_AT, len(steps)) if not steps[i]["on_collective"])
    assert back < len(steps) - 1
    # Every step on the aggregator again sends the whole bucket through it.
    per_step = steps[STOP_AT - 1]["aggregator_bytes"] - steps[STOP_AT - 2]["aggregator_bytes"]
    assert per_step > 0
    grown = steps[-1]["aggregator_bytes"] - steps[back - 1]["aggregator_bytes"]
    assert grown >= (len(steps) - back) * per_step
    for r in range(WORLD):
        assert failover_run[r]["returns"] == 1
        assert any("answers every worker again" in w for w in failover_run[r]["warnings"])


# ------------------------------------------- the aggregator stops answering one worker only

SILENT_RANK = 2


def _service_behind_a_cutting_relay():
    """The reference service behind a relay that drops every datagram back to worker
    SILENT_RANK while `cut` is set; the workers' own job description."""
    cut = threading.Event()
    relay = LossyRelay(("127.0.0.1", 0), lambda d: cut.is_set() and d.direction == DOWN
                       and d.member == SILENT_RANK, members=WORLD, member_of=agg_worker).start()
    svc = serve(SwitchConfig.local(addresses=relay.member_addresses, pool_size=64),
                "127.0.0.1", 0)
    relay.target = tuple(svc.address)
    worker_cfg = SwitchConfig.local(addresses=[("127.0.0.1", free_port()) for _ in range(WORLD)],
                                    pool_size=64)
    return cut, relay, svc, worker_cfg


@pytest.fixture(scope="module")
def one_silent_run():
    """Every worker reaches the service through a relay, which drops the datagrams back to
    worker SILENT_RANK from step STOP_AT to RESTART_AT: the others get every sum of that
    step's call (and return from it at once), worker SILENT_RANK times out."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    events = tuple(ctx.Event() for _ in range(4))
    cut, relay, svc, worker_cfg = _service_behind_a_cutting_relay()
    conductor = threading.Thread(target=_orchestrate, args=(cut.set, cut.clear, events),
                                 daemon=True)
    conductor.start()
    aggregator = f"{relay.address[0]}:{relay.address[1]}"
    try:
        yield run_worker_processes(
            _train, lambda r, init, queue: (r, init, worker_cfg.to_dict(), aggregator, events,
                                            queue), WORLD, seconds=240)
    finally:
        for e in events:
            e.set()
        conductor.join(10)
        relay.stop()
        svc.stop()


def test_one_silenced_worker_gets_the_sums_the_others_decoded(one_silent_run):
    """The workers with every sum returned from the call without waiting for the end
    agreement, and joined the silenced worker's redo at their next call: the parameters
    stay identical after every step, and every worker went to the collective and back."""
    runs = [one_silent_run[r]["steps"] for r in range(WORLD)]
    assert len({len(steps) for steps in runs}) == 1
    for i in range(len(runs[0])):
        assert len({steps[i]["params"] for steps in runs}) == 1, f"step {i} differs"
    assert len({one_silent_run[r]["fallback_calls"] for r in range(WORLD)}) == 1
    for r in range(WORLD):
        out = one_silent_run[r]
        assert out["fallback_calls"] >= 1
        assert out["returns"] == 1
        assert sum("did not answer" in w for w in out["warnings"]) == 1
        assert not out["steps"][-1]["on_collective"]
    loss = [s["loss"] for s in runs[0]]
    assert loss[-1] < loss[STOP_AT - 1] < loss[0]


def _silenced_in_the_last_call(rank, init, cfg_dict, aggregator, events, queue):
    """Two calls; before the second the relay stops passing results to worker SILENT_RANK,
    so the others' first collective after it is the one in close()."""
    import torch
    import torch.distributed as dist

    from host.ddp_hook import thc_hook_state
    torch.set_num_threads(1)
    cut_request, cut_done = events
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        grad = torch.linspace(-1, 1, 20000) * (rank + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = thc_hook_state(aggregator=aggregator, job_config=SwitchConfig.from_dict(
                cfg_dict), timeout=TIMEOUT)
            first = state.reduce(grad, 0)
            if rank == 0:
                cut_request.set()
                assert cut_done.wait(60)
            dist.barrier()
            last = state.reduce(2 * grad, 0)
            state.close()
        queue.put((rank, {"first": first.numpy(), "last": last.numpy(),
                          "fallback_calls": state.allreduce.fallback_calls}))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def test_a_worker_silenced_in_the_last_call_gets_its_sums_in_close():
    import numpy as np
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    events = (ctx.Event(), ctx.Event())
    cut, relay, svc, worker_cfg = _service_behind_a_cutting_relay()
    conductor = threading.Thread(
        target=lambda: events[0].wait(120) and (cut.set() or events[1].set()), daemon=True)
    conductor.start()
    aggregator = f"{relay.address[0]}:{relay.address[1]}"
    try:
        results = run_worker_processes(
            _silenced_in_the_last_call,
            lambda r, init, queue: (r, init, worker_cfg.to_dict(), aggregator, events, queue),
            WORLD, seconds=120)
    finally:
        for e in events:
            e.set()
        relay.stop()
        svc.stop()
    for r in range(1, WORLD):
        np.testing.assert_array_equal(results[r]["first"], results[0]["first"])
        np.testing.assert_array_equal(results[r]["last"], results[0]["last"])
    assert [results[r]["fallback_calls"] for r in range(WORLD)] == [1] * WORLD


def _one_worker_does_not_close(rank, init, cfg_dict, aggregator, events, queue):
    """Worker 1 waits to close until worker 0's close() has returned."""
    import torch
    import torch.distributed as dist

    from host.ddp_hook import thc_hook_state
    torch.set_num_threads(1)
    closed_0, _ = events
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        state = thc_hook_state(aggregator=aggregator, job_config=SwitchConfig.from_dict(
            cfg_dict), timeout=TIMEOUT, start_timeout=CLOSE_WAIT)
        state.reduce(torch.ones(5000), 0)
        if rank == 1:
            assert closed_0.wait(60)
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state.close()
        if rank == 0:
            closed_0.set()
        queue.put((rank, {"seconds": time.monotonic() - t0,
                          "warnings": [str(w.message) for w in caught]}))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


CLOSE_WAIT = 3.0


def test_close_waits_for_the_others_at_most_start_timeout():
    import torch.multiprocessing as mp
    events = (mp.get_context("forkserver").Event(), None)
    cfg = SwitchConfig.local(addresses=[("127.0.0.1", free_port()) for _ in range(2)],
                             pool_size=8)
    with serve(cfg, "127.0.0.1", 0) as svc:
        aggregator = f"{svc.address[0]}:{svc.address[1]}"
        results = run_worker_processes(
            _one_worker_does_not_close,
            lambda r, init, queue: (r, init, cfg.to_dict(), aggregator, events, queue), 2,
            seconds=120)
    assert CLOSE_WAIT <= results[0]["seconds"] < CLOSE_WAIT + 10, results[0]
    assert any("last control exchange" in w for w in results[0]["warnings"]), results[0]


# --------------------------------------------------------------------------- a dead worker

KILL_AT = 3


def _killed_worker(rank, init, cfg_dict, aggregator, queue):
    """Worker 2 kills itself (SIGKILL) after its forward pass of step KILL_AT; the others
    report the error their backward raised and how long it took."""
    import numba
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from host.ddp_hook import thc_hook, thc_hook_state
    from host.experiments.common import load_digits_split, make_model
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        (x, y), _ = load_digits_split()
        x, y = torch.from_numpy(x[rank::WORLD]), torch.from_numpy(y[rank::WORLD])
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(make_model(HIDDEN))
        state = thc_hook_state(aggregator=aggregator, job_config=SwitchConfig.from_dict(cfg_dict),
                               timeout=TIMEOUT)
        model.register_comm_hook(state, thc_hook)
        for step in range(KILL_AT + 2):
            loss = nn.functional.cross_entropy(model(x), y)
            if step == KILL_AT and rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            try:
                loss.backward()
            except RuntimeError as exc:
                queue.put((rank, {"step": step, "error": str(exc),
                                  "seconds": time.monotonic() - t0}))
                if rank == 0:
                    # Rank 0 hosts the store: the other survivor's roll call reads it.
                    time.sleep(ROLL_CALL_BEATS * HEARTBEAT_INTERVAL + 2)
                return
        queue.put((rank, {"step": None}))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def test_a_killed_worker_is_named_in_the_others_error_within_the_timeout():
    cfg = SwitchConfig.local(addresses=[("127.0.0.1", free_port()) for _ in range(WORLD)],
                             pool_size=64)
    with serve(cfg, "127.0.0.1", 0) as svc:
        aggregator = f"{svc.address[0]}:{svc.address[1]}"
        results = run_worker_processes(
            _killed_worker, lambda r, init, queue: (r, init, cfg.to_dict(), aggregator, queue),
            WORLD, expect=WORLD - 1, seconds=120, fail_on_death=False)
    for r in (0, 1):
        out = results[r]
        assert out["step"] == KILL_AT, out
        assert "WorkerLostError" in out["error"] and "worker(s) [2] of 3" in out["error"], out
        # Noticed at once (gloo sees the closed connection), then a roll call of 3 beats.
        assert out["seconds"] < ROLL_CALL_BEATS * HEARTBEAT_INTERVAL + TIMEOUT, out


# --------------------------------------------------------------------------- the parts

def test_a_probe_is_answered_only_while_the_aggregator_serves():
    from host.transport import AggregatorTransport
    cfg = SwitchConfig.local(addresses=[("127.0.0.1", free_port()) for _ in range(2)],
                             pool_size=4)
    member = cfg.jobs[0].members[1]
    svc = serve(cfg, "127.0.0.1", 0)
    host, port = svc.address
    transport = AggregatorTransport((host, port), job=1, worker=1, expected=0b11, pool_size=4,
                                    local=(member.ip, member.udp_port))
    try:
        assert transport.probe()
        job = svc.counters()["jobs"][1]
        assert job["flushes"] == 1 and job["results_multicast"] == 1
        assert transport.stats.bytes_sent == 0          # probes are not gradient bytes
        svc.stop()
        assert not transport.probe()
        svc = serve(cfg, "127.0.0.1", port)
        assert transport.probe()
        assert (transport.probes, transport.probes_answered) == (3, 2)
    finally:
        transport.close()
        svc.stop()


def _silent_aggregator(rank, init, cfg_dict, aggregator, queue):
    """Nothing listens at `aggregator`: with fallback="collective" two calls complete over
    the collective; with fallback="raise" the call raises as it always did."""
    import torch
    import torch.distributed as dist

    from host.ddp_hook import thc_hook_state
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        cfg = SwitchConfig.from_dict(cfg_dict)
        grad = torch.arange(5000, dtype=torch.float32) * (rank + 1) / 5000
        out = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = thc_hook_state(aggregator=aggregator, job_config=cfg, timeout=TIMEOUT)
            out["means"] = [state.reduce(grad, 0).numpy() for _ in range(2)]
            out["on_collective"] = state.allreduce.on_collective
            out["warnings"] = sum("did not answer" in str(w.message) for w in caught)
            state.close()
        raising = thc_hook_state(aggregator=aggregator, job_config=cfg, timeout=TIMEOUT,
                                 fallback="raise")
        try:
            raising.reduce(grad, 0)
            out["raise"] = "no error"
        except Exception as exc:
            out["raise"] = type(exc).__name__
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def test_fallback_raise_keeps_the_old_behaviour_and_collective_carries_on():
    import numpy as np
    cfg = SwitchConfig.local(addresses=[("127.0.0.1", free_port()) for _ in range(2)],
                             pool_size=16)
    nobody = f"127.0.0.1:{free_port()}"
    results = run_worker_processes(
        _silent_aggregator, lambda r, init, queue: (r, init, cfg.to_dict(), nobody, queue),
        2, seconds=120)
    for r in range(2):
        out = results[r]
        assert out["on_collective"] and out["warnings"] == 1
        for got, other in zip(out["means"], results[1 - r]["means"]):
            np.testing.assert_array_equal(got, other)
        want = np.arange(5000, dtype=np.float32) * 1.5 / 5000
        assert np.mean((out["means"][1] - want) ** 2) < 0.05 * np.mean(want ** 2)
    # fallback="raise": the call fails as before. A worker whose flush at start went out
    # before the ICMP error came back fails at the start barrier instead, and names its peer
    # lost when that peer has already raised and left the process group.
    raised = {results[r]["raise"] for r in range(2)}
    assert "AggregatorUnreachable" in raised and raised <= {"AggregatorUnreachable",
                                                            "AllreduceError",
                                                            "WorkerLostError"}
