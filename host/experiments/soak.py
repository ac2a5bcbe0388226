"""Soak: train the main job's model with THC through the live DPDK switch for a while,
restarting the switch on a schedule, and check what is left at the end.

    sudo python -m host.experiments.soak --minutes 15 --restart-every 300 --json out/soak.json

N worker processes (gloo process group) train the main job's MLP (host/experiments/common.py)
on digits mini-batches with the THC comm hook (host/ddp_hook.py, fallback="collective") through
the DPDK switch behind a veth pair (dataplane.dpdk_runner.HostService). Every
--restart-every seconds the switch process is stopped and, --down-seconds later, a fresh one
started on the same veth (`LiveSwitch.restart`: empty slots, zeroed counters); the workers fall
back to the collective and return once their probes are answered. A fault counts as survived when training went on
and the new switch aggregated results afterwards.

Written to --json and printed: steps, faults injected and survived, worker and switch RSS at
start and end, whether the switch's counters balance (docs/protocol.md §4.5: every frame a
port received is counted once, and per job rx = aggregated + drop_duplicate +
results_reserved + straggler_notices + flushes), slots stuck (rounds with contributions but
no result when a switch process ended), the workers' retransmissions and final test accuracy.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numba
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dataplane.config import Job, Member, SwitchConfig
from dataplane.dpdk_runner import HostService, cannot_run, counter_balance
from dataplane.ports import free_port
from host.ddp_hook import thc_hook, thc_hook_state
from host.experiments.common import load_digits_split, make_model

HIDDEN = 64
BATCH = 64                  # samples per worker per step
LR = 0.1
POOL_SIZE = 64
VALUES_PER_PACKET = 1024
GRACE_S = 30.0              # the most training added at the end to see the last fault through
def rss_kib(pid: int | str = "self") -> int:
    """Resident set size of a process in KiB (/proc/<pid>/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def switch_config(workers: int) -> SwitchConfig:
    """One job, every member on switch port 0 behind the host end of the veth pair (a
    subnet of this process, so two soaks do not collide)."""
    net = f"10.215.{os.getpid() % 250}"
    members = tuple(Member(worker=w, port=0, mac="02:00:00:00:d5:01", ip=f"{net}.1",
                           udp_port=free_port("0.0.0.0")) for w in range(workers))
    job = Job.from_thc(1, POOL_SIZE, members, values_per_packet=VALUES_PER_PACKET)
    return SwitchConfig(mac="02:00:00:00:d5:fe", ip=f"{net}.254", jobs=(job,)).validate()


def slots_stuck(stats: dict, workers: int) -> int:
    """Contributions that never became a result: every completed round took one from each
    worker, so with 2 workers each stuck round holds exactly one (more workers: an upper
    bound on the stuck rounds)."""
    return sum(max(0, j["aggregated"] - workers * j["results_multicast"])
               for j in stats["jobs"].values())


# --------------------------------------------------------------------------- the workers

def _train(rank, world, init, cfg_dict, aggregator, args, ready, stop, progress, queue):
    """Mini-batch SGD with the THC hook until every worker agrees to stop (`stop` seen by
    any): the step count lives in progress[rank] for the conductor."""
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        (x, y), (x_test, y_test) = load_digits_split()
        x, y = torch.from_numpy(x[rank::world]), torch.from_numpy(y[rank::world])
        torch.manual_seed(0)
        model = DDP(make_model(HIDDEN))
        state = thc_hook_state(aggregator=aggregator, job_config=SwitchConfig.from_dict(cfg_dict),
                               timeout=args.timeout, probe_interval=args.probe_interval)
        model.register_comm_hook(state, thc_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(rank)
        step, rss_start, flag = 0, None, torch.zeros(1)
        ready.set()
        while True:
            flag[0] = float(stop.is_set())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)     # every worker stops at one step
            if flag[0]:
                break
            batch = torch.randint(len(x), (BATCH,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            step += 1
            progress[rank] = step
            rss_start = rss_start or rss_kib()
        with torch.no_grad():
            acc = float((model(torch.from_numpy(x_test)).argmax(1)
                         == torch.from_numpy(y_test)).float().mean())
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ar = state.allreduce
        out = {"steps": step, "test_acc": acc, "rss_start_kib": rss_start,
               "rss_end_kib": rss_kib(), "on_collective": ar.on_collective,
               "fallback_calls": ar.fallback_calls, "returns": ar.aggregator_returns,
               "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
               "transport": ar.exchange.transport.stats.as_dict()}
        state.close()
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def start_workers(args, config, aggregator):
    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(args.workers)]
    stop, queue = ctx.Event(), ctx.Queue()
    progress = ctx.Array("l", args.workers, lock=False)
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_train, args=(r, args.workers, init, config.to_dict(),
                                              aggregator, args, ready[r], stop, progress,
                                              queue), daemon=True)
             for r in range(args.workers)]
    for p in procs:
        p.start()
    return procs, ready, stop, progress, queue


def collect(procs, queue, seconds: float) -> dict:
    """{rank: result}; a worker that crashed or never answered raises with what it said."""
    results, deadline = {}, time.monotonic() + seconds
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            rank, out = queue.get(timeout=1.0)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        if "crash" in out:
            raise SystemExit(f"worker {rank} failed:\n{out['crash']}")
        results[rank] = out
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if len(results) < len(procs):
        raise SystemExit(f"workers {sorted(set(range(len(procs))) - set(results))} "
                         "returned nothing")
    return results


# --------------------------------------------------------------------------- the conductor

def soak(args) -> dict:
    config = switch_config(args.workers)
    service = HostService(config, iface=f"thcsk{os.getpid() % 100000}").start()
    aggregator = f"{config.ip}:50000"
    incarnations, faults = [], []
    procs, ready, stop, progress, queue = start_workers(args, config, aggregator)
    try:
        for r, ev in enumerate(ready):
            if not ev.wait(180):
                raise SystemExit(f"worker {r} did not start in 180 s")
        switch_rss_start = rss_kib(service.proc.pid)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_fault = t0 + args.restart_every if args.restart_every > 0 else float("inf")
        while time.monotonic() < end:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_fault and time.monotonic() < end:
                _judge_last_fault(faults, service, progress)
                faults.append({"at_s": round(time.monotonic() - t0, 1),
                               "step": int(progress[0])})
                incarnations.append(service.restart(args.down_seconds))
                next_fault += args.restart_every
        # A restart near the end gets up to GRACE_S more training to come back from.
        grace_end = time.monotonic() + GRACE_S
        while not _judge_last_fault(faults, service, progress) and time.monotonic() < grace_end:
            time.sleep(0.5)
        stop.set()
        results = collect(procs, queue, 120)
        duration = time.monotonic() - t0
        switch_rss_end = rss_kib(service.proc.pid)
    finally:
        stop.set()
        final = service.stop()
    incarnations.append(final)
    return summarize(args, results, incarnations, faults, duration,
                     switch_rss_start, switch_rss_end)


def _judge_last_fault(faults, service, progress) -> bool:
    """Whether the last restart (if any) was survived: training went on and the switch
    now running completed rounds (the workers came back to it)."""
    if not faults:
        return True
    jobs = service.counters()["jobs"]
    fault = faults[-1]
    fault["results_after"] = sum(j["results_multicast"] for j in jobs.values())
    fault["steps_after"] = int(progress[0]) - fault["step"]
    fault["survived"] = fault["results_after"] > 0 and fault["steps_after"] > 0
    return fault["survived"]


def summarize(args, results, incarnations, faults, duration, rss_start, rss_end) -> dict:
    stats = [s for s in incarnations if s is not None]
    balances = [counter_balance(s) for s in stats]
    r0 = results[0]
    return {
        "command": "python -m host.experiments.soak " + " ".join(sys.argv[1:]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "minutes_requested": args.minutes, "duration_s": round(duration, 1),
        "workers": args.workers, "steps": r0["steps"],
        "replicas_identical": len({r["params_sha256"] for r in results.values()}) == 1,
        "faults_injected": len(faults),
        "faults_survived": sum(bool(f.get("survived")) for f in faults), "faults": faults,
        "worker_rss_kib": {r: [o["rss_start_kib"], o["rss_end_kib"]]
                           for r, o in sorted(results.items())},
        "switch_rss_kib": [rss_start, rss_end],
        "switch_processes": len(incarnations),
        "counters_balanced": bool(balances) and all(b["balanced"] for b in balances),
        "counter_balance": balances,
        "slots_stuck": sum(slots_stuck(s, args.workers) for s in stats),
        "slots_stuck_at_end": slots_stuck(stats[-1], args.workers) if stats else None,
        "switch_results": [sum(j["results_multicast"] for j in s["jobs"].values())
                           for s in stats],
        "fallback_calls": r0["fallback_calls"], "aggregator_returns": r0["returns"],
        "on_collective_at_end": r0["on_collective"],
        "retransmissions": sum(o["transport"]["retransmissions"] for o in results.values()),
        "final_test_acc": r0["test_acc"],
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, required=True, help="how long to train")
    ap.add_argument("--json", required=True, help="where to write the figures")
    ap.add_argument("--restart-every", type=float, default=0.0, metavar="S",
                    help="restart the switch every S seconds (0: never)")
    ap.add_argument("--down-seconds", type=float, default=3.0,
                    help="how long the switch stays down at a restart (above --timeout: "
                         "the workers fall back to the collective meanwhile)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=2.0,
                    help="seconds without progress before an exchange falls back")
    ap.add_argument("--probe-interval", type=float, default=1.0,
                    help="seconds between probes of a silent switch")
    args = ap.parse_args(argv)
    if args.minutes <= 0:
        ap.error(f"--minutes {args.minutes}: give a positive duration")
    if not 2 <= args.workers <= 8:
        ap.error(f"--workers {args.workers}: give 2 to 8 (2 makes slots_stuck exact)")
    if args.down_seconds < 0:
        ap.error(f"--down-seconds {args.down_seconds}: give 0 or more seconds")
    if args.restart_every < 0:
        ap.error(f"--restart-every {args.restart_every}: give 0 (never) or more seconds")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = cannot_run()
    if reason:
        raise SystemExit(f"soak: {reason}")
    out = soak(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("counter_balance", "faults")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
