"""Training through faults, with real worker processes (gloo), the main job's model and data
(host/experiments/common.py) and real sockets:

* the DPDK switch (HostService, behind a veth pair) is stopped mid-training and a fresh
  switch process started on the same veth (`LiveSwitch.stop_process` / `start_process`):
  every step completes, the replicas agree after every step, each step's parameters are
  bit-identical to a run of the same seeds that no fault touched (THC's lane sums are exact
  integers, on the switch and on the collective alike, so a wrong sum would show), and the
  workers go back to the new switch process;
* 5 % random loss both ways on every worker's link (host.netlab.relay.LossyRelay between
  the workers and the reference UDP service) for a whole run: it ends within 1 % of the
  accuracy of DDP's loss-free fp32 run of the same model and steps, and the transport
  reports its retransmissions;
* the soak command (host/experiments/soak.py) for a few seconds, with one restart.
"""
import datetime
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from dataplane.config import Job, Member, SwitchConfig
from dataplane.dpdk_runner import HostService, cannot_run
from dataplane.udp_service import serve
from host.netlab.relay import LossyRelay, agg_worker, random_loss

from hosttest_util import free_port, run_worker_processes

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TIMEOUT = 2.0              # the hook's no-progress timeout (seconds)
PROBE_INTERVAL = 0.05      # seconds between probes of the silent switch


def host_service_config() -> SwitchConfig:
    """One job, every member on switch port 0 behind the veth's host end (a subnet of this
    process, so that two runs do not collide)."""
    net = f"10.216.{os.getpid() % 250}"
    members = tuple(Member(worker=w, port=0, mac="02:00:00:00:d6:01", ip=f"{net}.1",
                           udp_port=free_port()) for w in range(WORLD))
    return SwitchConfig(mac="02:00:00:00:d6:fe", ip=f"{net}.254",
                        jobs=(Job.from_thc(1, 64, members, values_per_packet=1024),)).validate()


def _setup_worker(rank, init):
    """The process group and this worker's shard of the main job's data (torch tensors)."""
    import numba
    import torch
    import torch.distributed as dist

    from host.experiments.common import load_digits_split
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    (x, y), (x_test, y_test) = load_digits_split()
    return [torch.from_numpy(a) for a in (x, y, x_test, y_test)]


def _params_hash(model) -> str:
    import torch
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(params.numpy().tobytes()).hexdigest()


# --------------------------------------------------------------------------- switch restart

HIDDEN = 32
FAULT_AT = 5               # the switch process is stopped before this step
BACK_AT = 9                # ... and a new one runs before this one
STEPS = 20                 # at least; more while the workers are still on the collective
MAX_STEPS = 60


def _restart_run(rank, init, cfg_dict, aggregator, events, queue):
    """Full-batch SGD on this worker's shard, twice with the same seeds: a clean run through
    the switch, then (after a fresh switch process) a run during which the switch goes
    down and comes back. Per step: loss on the whole training set, parameter hash, whether
    on the collective."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from host.ddp_hook import thc_hook, thc_hook_state
    from host.experiments.common import make_model
    fresh_request, fresh, stop_request, stopped, back_request, back = events
    try:
        x, y, _, _ = _setup_worker(rank, init)
        x_mine, y_mine = x[rank::WORLD], y[rank::WORLD]
        out = {}
        for run in ("clean", "fault"):
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(make_model(HIDDEN))
            state = thc_hook_state(aggregator=aggregator,
                                   job_config=SwitchConfig.from_dict(cfg_dict),
                                   timeout=TIMEOUT, probe_interval=PROBE_INTERVAL)
            model.register_comm_hook(state, thc_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
            ar, steps, step = state.allreduce, [], 0
            faulty = run == "fault"
            while step < (STEPS if faulty else MAX_STEPS) or (ar.on_collective
                                                                and step < MAX_STEPS):
                if faulty and step == FAULT_AT:
                    _ask(rank, stop_request, stopped)
                if faulty and step == BACK_AT:
                    _ask(rank, back_request, back)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x_mine), y_mine).backward()
                opt.step()
                with torch.no_grad():
                    loss = float(nn.functional.cross_entropy(model(x), y))
                steps.append({"loss": loss, "params": _params_hash(model),
                              "on_collective": ar.on_collective})
                step += 1
            out[run] = {"steps": steps, "fallback_calls": ar.fallback_calls,
                        "returns": ar.aggregator_returns}
            state.close()
            dist.barrier()
            if not faulty:
                _ask(rank, fresh_request, fresh)      # the next run starts on empty slots
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _ask(rank, request, done, seconds: float = 60) -> None:
    """Rank 0 asks the test for something; every worker waits until it is done."""
    if rank == 0:
        request.set()
    assert done.wait(seconds), "the test did not answer"


def _conduct_restart(svc, events, log):
    """The test's side: a fresh switch between the runs, then stop it at FAULT_AT and start
    a new process on the same veth TIMEOUT + 1 s later (the workers fall back meanwhile)."""
    fresh_request, fresh, stop_request, stopped, back_request, back = events
    if not fresh_request.wait(120):
        return
    log["clean_run"] = svc.restart()
    fresh.set()
    if not stop_request.wait(120):
        return
    log["before_fault"] = svc.stop_process()
    stopped.set()
    time.sleep(TIMEOUT + 1.0)
    svc.start_process()
    back.set()
    back_request.wait(120)


@pytest.fixture(scope="module")
def restart_run():
    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    events = tuple(ctx.Event() for _ in range(6))
    config = host_service_config()
    svc = HostService(config, iface=f"thcft{os.getpid() % 100000}").start()
    log = {}
    conductor = threading.Thread(target=_conduct_restart, args=(svc, events, log), daemon=True)
    conductor.start()
    try:
        results = run_worker_processes(
            _restart_run, lambda r, init, queue: (r, init, config.to_dict(),
                                                  f"{config.ip}:50000", events, queue),
            WORLD, seconds=150)
        conductor.join(10)
        log["after_fault"] = svc.counters()
    finally:
        for e in events:
            e.set()
        conductor.join(10)
        svc.stop()
    return results, log


def test_every_step_completes_and_the_replicas_agree_through_a_switch_restart(restart_run):
    results, _ = restart_run
    for run in ("clean", "fault"):
        steps = [results[r][run]["steps"] for r in range(WORLD)]
        assert len({len(s) for s in steps}) == 1
        assert len(steps[0]) >= STEPS
        for i in range(len(steps[0])):
            assert len({s[i]["params"] for s in steps}) == 1, f"{run}: step {i} differs"


def test_no_wrong_sum_reaches_a_gradient(restart_run):
    """Each step of the faulted run has the parameters of the clean run's same step."""
    results, _ = restart_run
    clean, fault = results[0]["clean"]["steps"], results[0]["fault"]["steps"]
    assert len(fault) <= len(clean)
    on = [s["on_collective"] for s in fault]
    assert any(on) and not any(on[:FAULT_AT]) and not on[-1]
    for i, (c, f) in enumerate(zip(clean, fault)):
        assert c["params"] == f["params"], f"step {i} (on collective: {on[i]}) differs"


def test_the_loss_keeps_falling_through_the_restart(restart_run):
    loss = [s["loss"] for s in restart_run[0][0]["fault"]["steps"]]
    assert loss[FAULT_AT - 1] < loss[0]
    assert loss[BACK_AT - 1] < loss[FAULT_AT - 1]
    assert loss[-1] < loss[BACK_AT - 1]


def test_the_workers_go_back_to_the_new_switch_process(restart_run):
    results, log = restart_run
    for r in range(WORLD):
        assert results[r]["clean"]["fallback_calls"] == 0
        assert results[r]["fault"]["fallback_calls"] >= 1
        assert results[r]["fault"]["returns"] == 1
    before, after = log["before_fault"]["jobs"]["1"], log["after_fault"]["jobs"]["1"]
    assert before["results_multicast"] > 0
    # The new process completed rounds for every step after the return (at least one
    # each) with every worker's share, and dropped nothing as foreign or malformed. (Its
    # results_multicast also counts the probes' FLUSH completions, so it is only a bound.)
    back = next(i for i, s in enumerate(results[0]["fault"]["steps"])
                if i >= BACK_AT and not s["on_collective"])
    rounds = after["aggregated"] // WORLD
    assert after["aggregated"] % WORLD == 0
    assert rounds >= len(results[0]["fault"]["steps"]) - back
    assert after["results_multicast"] >= rounds
    assert after["flushes"] >= 1
    assert after["drop_not_member"] == after["drop_bad_slot"] == 0


# --------------------------------------------------------------------------- 5 % loss

LOSS = 0.05
LOSSY_HIDDEN = 64
LOSSY_STEPS = 150
BATCH = 64


def _lossy_run(rank, init, cfg_dict, aggregator, queue):
    """Mini-batch SGD with the THC hook through the lossy relay, then DDP's own fp32
    allreduce (no hook, no relay) from the same seeds and batches: test accuracy of both."""
    import torch
    import torch.nn as nn

    from host.ddp_hook import thc_hook, thc_hook_state
    from host.experiments.common import make_model
    try:
        x, y, x_test, y_test = _setup_worker(rank, init)
        x_mine, y_mine = x[rank::WORLD], y[rank::WORLD]
        out = {}
        for run in ("thc", "fp32"):
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(make_model(LOSSY_HIDDEN))
            state = None
            if run == "thc":
                state = thc_hook_state(aggregator=aggregator,
                                       job_config=SwitchConfig.from_dict(cfg_dict))
                model.register_comm_hook(state, thc_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            batches = torch.Generator().manual_seed(rank)
            for _ in range(LOSSY_STEPS):
                idx = torch.randint(len(x_mine), (BATCH,), generator=batches)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x_mine[idx]), y_mine[idx]).backward()
                opt.step()
            with torch.no_grad():
                acc = float((model(x_test).argmax(1) == y_test).float().mean())
            out[run] = {"acc": acc, "params": _params_hash(model)}
            if state is not None:
                out[run].update(transport=state.allreduce.exchange.transport.stats.as_dict(),
                                fallback_calls=state.allreduce.fallback_calls)
                state.close()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


@pytest.fixture(scope="module")
def lossy_run():
    relay = LossyRelay(("127.0.0.1", 0), random_loss(LOSS, seed=1), members=WORLD,
                       member_of=agg_worker).start()
    # The service sees each worker at its relay proxy; the workers send from their own port.
    service_config = SwitchConfig.local(addresses=relay.member_addresses, pool_size=64)
    worker_config = SwitchConfig.local(
        addresses=[("127.0.0.1", free_port()) for _ in range(WORLD)], pool_size=64)
    svc = serve(service_config, "127.0.0.1", 0)
    relay.target = tuple(svc.address)
    aggregator = f"{relay.address[0]}:{relay.address[1]}"
    try:
        results = run_worker_processes(
            _lossy_run, lambda r, init, queue: (r, init, worker_config.to_dict(), aggregator,
                                                queue), WORLD, seconds=150)
    finally:
        counters = relay.stop()
        svc.stop()
    return results, counters


def test_five_percent_loss_both_ways_ends_within_one_percent_of_fp32(lossy_run):
    results, _ = lossy_run
    assert results[0]["thc"]["params"] == results[1]["thc"]["params"]
    thc_acc, fp32_acc = results[0]["thc"]["acc"], results[0]["fp32"]["acc"]
    print(f"test accuracy with {LOSS:.0%} loss: THC {thc_acc:.4f}, loss-free fp32 {fp32_acc:.4f}")
    assert fp32_acc > 0.9
    assert thc_acc >= fp32_acc - 0.01, (thc_acc, fp32_acc)


def test_the_loss_was_real_and_the_transport_retransmitted(lossy_run):
    results, counters = lossy_run
    sent_up = counters["up"] + counters["dropped_up"]
    for direction, sent in (("up", sent_up), ("down", counters["down"]
                                              + counters["dropped_down"])):
        dropped = counters[f"dropped_{direction}"]
        assert 0.03 < dropped / sent < 0.07, (direction, dropped, sent)
    for r in range(WORLD):
        thc = results[r]["thc"]
        print(f"worker {r}: {thc['transport']['retransmissions']} retransmissions of "
              f"{thc['transport']['packets_sent']} packets")
        assert thc["transport"]["retransmissions"] > 0
        assert thc["fallback_calls"] == 0           # loss is retransmitted, not fallen back on
    total = sum(results[r]["thc"]["transport"]["retransmissions"] for r in range(WORLD))
    assert total >= counters["dropped_up"]          # a lost contribution is always resent


# --------------------------------------------------------------------------- the soak command

def test_a_short_soak_writes_its_figures(tmp_path):
    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, "-m", "host.experiments.soak", "--minutes", "0.1",
                          "--restart-every", "3", "--down-seconds", "2.5", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["steps"] > 0 and figures["replicas_identical"]
    assert figures["faults_injected"] >= 1
    assert figures["faults_survived"] == figures["faults_injected"]
    assert figures["switch_processes"] == figures["faults_injected"] + 1
    assert figures["counters_balanced"] and figures["slots_stuck_at_end"] == 0
    assert all(a > 0 and b > 0 for a, b in figures["worker_rss_kib"].values())
    assert all(v > 0 for v in figures["switch_rss_kib"])
    assert 0.8 < figures["final_test_acc"] <= 1.0
    assert '"faults_survived"' in res.stdout


def test_the_soak_refuses_a_bad_duration():
    res = subprocess.run([sys.executable, "-m", "host.experiments.soak", "--minutes", "0",
                          "--json", "/dev/null"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "give a positive duration" in res.stderr
