"""THC incast through the DPDK switch's DLCP queues: the main job trained with and without DLCP.

    sudo python -m host.experiments.dlcp.innetwork incast --json out/dlcp_incast.json

Testbed (host.netlab.topology.Topology, "routed" layout): 4 worker namespaces and one
aggregator namespace, each on a veth pair whose root end is a port of the DPDK switch (routing the
hosts' /24s through its DLCP egress stage, docs/protocol.md §6). The reference aggregator
(dataplane.udp_service) serves the job in the aggregator namespace on a UDP port outside
the switch's aggregation range, so the switch forwards the THC packets instead of adding
them: all four workers' DATA packets meet at the aggregator's port, served at
`--rate-pps`, with the DLCP thresholds and capacity given. The process group (gloo, for
the norm and agreement exchanges) runs over the same switch, best effort, on ports that
are not rate limited.

Runs, each training the main job's MLP (host.experiments.main_job's model and data) for `--steps`:
* "dlcp": DlcpPolicy marks (band per DDP bucket, ECT per RHT partition by norm) and
  bounded loss p = --loss-bound;
* "off": every packet best effort (DSCP 0, Not-ECT: only buffer drops), exact (p = 0),
  today's behaviour without DLCP.
With `--background-pps R`, a sixth namespace sends R datagrams/s of other traffic to the
aggregator's host, Not-ECT, in the queue THC's front band uses (DSCP of band 0 with DLCP,
DSCP 0 without: in both runs it shares a queue with THC's packets): the situation DLCP is
for, where what is dropped first when that queue builds up should be the unimportant.
Reported per run: allreduce time per call (median, p99, max), the switch's drops
(selective = Not-ECT above a threshold, buffer = queue full) and CE marks, the chunks
decoded as lost, retransmissions, and the final test accuracy.

`--paired` (no background) runs one training instead of two, DLCP on the even steps and
off on the odd ones (marks and loss bound switched between steps, same processes, switch
and moment), so the two modes' call times are compared under the same load: on this
shared machine two runs a minute apart differ by more than the effect measured. The
accuracy of such a run is of the two modes mixed; the two-run comparison gives each its own.
"""
from __future__ import annotations

import datetime
import functools
import os
import time
import traceback

import matplotlib.pyplot as plt     # the Agg backend: host.experiments.common selects it
import numba
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import thc
from dataplane.config import (NUM_DATA_BANDS, Dlcp, Job, Member, SwitchConfig, band_to_dscp,
                              default_thresholds, window_thresholds)
from dataplane.dpdk_runner import LiveSwitch, af_packet_vdevs
from dataplane.udp_service import serve
from host.ddp_hook import thc_hook, thc_hook_state
from host.dlcp.marking import DlcpPolicy
from host.experiments.common import load_digits_split, make_model
from host.netlab.dlcp_probes import live_switch_skip_reason
from host.netlab.background import send_paced
from host.netlab.links import enter_netns, in_netns
from host.netlab.topology import Topology
from host.transport import default_policy

AGG_UDP_PORT = 47100           # outside 50000-50015: the switch routes it, does not add it
WORKER_UDP_PORT = 47200
GLOO_PORT = 47300
BACKGROUND_BYTES = 600         # about a THC DATA packet of 1024 values


class _StepLog:
    """The mode each allreduce call ran in, and where each mode's calls spent their time
    (the worker's `seconds` parts and its process CPU), the first two steps (set-up) left out."""

    def __init__(self, allreduce):
        self.ar, self.call_modes, self.parts = allreduce, [], {"dlcp": {}, "off": {}}

    def begin(self) -> None:
        ar = self.ar
        self._seen, self._calls = dict(ar.seconds), len(ar.call_seconds)
        self._cpu = time.process_time()     # training, codec and I/O threads together

    def end(self, step: int, mode: str) -> None:
        new = len(self.ar.call_seconds) - self._calls
        self.call_modes += [mode] * new
        if step < 2:
            return
        part = self.parts[mode]
        part["calls"] = part.get("calls", 0) + new
        part["process_cpu"] = part.get("process_cpu", 0.0) + time.process_time() - self._cpu
        for name, total in self.ar.seconds.items():
            part[name] = part.get(name, 0.0) + total - self._seen.get(name, 0.0)


def _worker(rank, cfg, queue):
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    try:
        enter_netns(cfg["netns"][rank])
        os.environ["GLOO_SOCKET_IFNAME"] = cfg["ifnames"][rank]
        dist.init_process_group("gloo", init_method=cfg["init"], rank=rank,
                                world_size=cfg["world"],
                                timeout=datetime.timedelta(seconds=40))
        paired = cfg["mode"] == "paired"
        dlcp = cfg["mode"] in ("dlcp", "paired")
        codec = thc.THCCodec(seed=cfg["seed"], partition_size=cfg["partition_size"])
        state = thc_hook_state(aggregator=cfg["aggregator"], job=1, pool_size=cfg["pool"],
                               job_config=SwitchConfig.local(
                                   addresses=[(ip, WORKER_UDP_PORT) for ip in cfg["ips"]],
                                   pool_size=cfg["pool"], values_per_packet=cfg["vpp"]),
                               codec=codec, worker_address=(cfg["ips"][rank], WORKER_UDP_PORT),
                               timeout=30, values_per_packet=cfg["vpp"],
                               policy=DlcpPolicy(num_bands=cfg["bands"]) if dlcp
                               else default_policy,
                               loss_bound=cfg["loss_bound"] if dlcp else 0.0,
                               loss_wait=cfg["loss_wait"])
        torch.manual_seed(cfg["seed"])
        model = DDP(make_model(cfg["hidden"]), bucket_cap_mb=cfg["bucket_mb"])
        model.register_comm_hook(state, thc_hook)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        (xtr, ytr), (xte, yte) = load_digits_split(cfg["seed"])
        xs, ys = torch.from_numpy(xtr[rank::cfg["world"]]), torch.from_numpy(ytr[rank::cfg["world"]])
        rng = np.random.default_rng(cfg["seed"] + rank)
        ar, log = state.allreduce, _StepLog(state.allreduce)
        ar.exchange.transport.ce_window = cfg["ce_window"]
        marks = ar.exchange.transport.policy
        for step in range(cfg["steps"]):
            on = dlcp and (not paired or step % 2 == 0)
            if paired:                  # between steps: no call is in flight
                ar.exchange.transport.policy = marks if on else default_policy
                ar.loss_bound = cfg["loss_bound"] if on else 0.0
            log.begin()
            idx = torch.from_numpy(rng.choice(len(xs), cfg["batch"], replace=False))
            opt.zero_grad()
            F.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
            log.end(step, "dlcp" if on else "off")
        with torch.no_grad():
            logits = model.module(torch.from_numpy(xte))
            acc = float((logits.argmax(1) == torch.from_numpy(yte)).float().mean())
            test_loss = float(F.cross_entropy(logits, torch.from_numpy(yte)))
        out = {"call_seconds": list(ar.call_seconds), "call_modes": log.call_modes,
               "seconds_by_mode": log.parts,
               "loss_stats": dict(ar.loss_stats),
               "transport": ar.exchange.transport.stats.as_dict(), "test_acc": acc,
               "test_loss": test_loss,
               "buckets": len(state.bucket_sizes)}
        ar.exchange.transport.close()
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def run_mode(mode: str, args) -> dict:
    """One training run through a fresh switch; returns the workers' and switch's numbers."""
    world = args.workers
    # offloads off: plain MTU-sized frames (the switch's af_packet rings take no TSO/GRO
    # super-frames)
    extra = 1 if args.background_pps else 0
    with Topology(world + 1 + extra, layout="routed", offloads=False,
                  tag=f"ic{os.getpid() % 10000}") as tb:
        agg_host = tb.receiver
        workers = tb.senders[:world]
        members = [Member(worker=w, port=w, mac=h.mac, ip=h.ip, udp_port=WORKER_UDP_PORT)
                   for w, h in enumerate(workers)]
        job = Job.from_thc(1, args.pool, members, values_per_packet=args.vpp)
        service = in_netns(agg_host.ns, functools.partial(serve, core=args.aggregator == "core"),
                           SwitchConfig(ip=agg_host.ip, jobs=(job,)).validate(),
                           agg_host.ip, AGG_UDP_PORT)
        thresholds = (window_thresholds(world, args.pool, args.capacity, args.threshold_step)
                      if args.threshold is None
                      else default_thresholds(args.threshold, args.threshold_step))
        dlcp = Dlcp(thresholds=thresholds, capacity=args.capacity)
        switch = LiveSwitch(tb.switch_config(dlcp),
                            af_packet_vdevs([h.switch_if for h in tb.hosts]),
                            port_rates={agg_host.port: args.rate_pps})
        switch.start()
        cfg = {"mode": mode, "world": world, "netns": [h.ns for h in workers],
               "ifnames": [h.host_if for h in workers], "ips": [h.ip for h in workers],
               "init": f"tcp://{workers[0].ip}:{GLOO_PORT}",
               "aggregator": f"{agg_host.ip}:{AGG_UDP_PORT}", "pool": args.pool,
               "vpp": args.vpp, "partition_size": args.partition_size, "seed": args.seed,
               "hidden": args.hidden, "bucket_mb": args.bucket_mb, "lr": args.lr,
               "batch": args.batch, "steps": args.steps, "loss_bound": args.loss_bound,
               "loss_wait": args.loss_wait, "ce_window": args.ce_window == "on",
               "bands": args.bands}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, cfg, queue)) for r in range(world)]
        background = None
        if extra:
            # Not-ECT in the queue THC's front band uses in this mode.
            tos = (band_to_dscp(0) if mode == "dlcp" else 0) << 2
            background = ctx.Process(target=send_paced, daemon=True,
                                     args=(tb.senders[world].ns, agg_host.ip,
                                           args.background_pps, BACKGROUND_BYTES, tos))
        t0 = time.monotonic()
        for p in procs + ([background] if background else []):
            p.start()
        results = {}
        try:
            deadline = time.monotonic() + args.run_timeout
            while len(results) < world and time.monotonic() < deadline:
                try:
                    rank, value = queue.get(timeout=1)
                    results[rank] = value
                except Exception:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        break
        finally:
            if background is not None:
                background.kill()                    # it sends until stopped
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            stats = switch.stop()
            service.stop()
        wall = time.monotonic() - t0
    crashed = {r: v["crash"] for r, v in results.items() if "crash" in v}
    if crashed or len(results) < world:
        raise RuntimeError(f"{mode}: workers failed: {crashed or sorted(results)}")
    if mode == "paired":
        return [dict(summarize(f"{half} (paired)", results, stats, str(agg_host.port), wall,
                               calls_of=half), background_pps=0.0) for half in ("dlcp", "off")]
    summary = summarize(mode, results, stats, str(agg_host.port), wall)
    summary["background_pps"] = args.background_pps
    return summary


def summarize(mode, results, stats, port, wall, calls_of: str | None = None) -> dict:
    """calls_of: only the calls made in that mode (a paired run)."""
    seconds = np.array(results[0]["call_seconds"])
    picked = np.arange(1, len(seconds))                          # the first call sets up
    if calls_of is not None:
        picked = picked[np.array(results[0]["call_modes"])[picked] == calls_of]
    calls = seconds[picked] * 1e3
    g = stats["global"] if stats else {}
    parts = dict(results[0].get("seconds_by_mode", {}).get(calls_of or mode, {}))
    n = parts.pop("calls", 0)
    per_call_ms = {name: 1e3 * total / n for name, total in parts.items()} if n else {}
    port_stats = stats["ports"][port] if stats else {}
    loss = [results[r]["loss_stats"] for r in results]
    return {
        "mode": mode, "wall_s": wall, "calls": len(calls),
        "call_ms_median": float(np.median(calls)), "call_ms_p99": float(np.percentile(calls, 99)),
        "call_ms_max": float(calls.max()), "call_seconds_ms": calls.tolist(),
        "selective_drops": g.get("dlcp_selective_drop", 0),
        "buffer_drops": g.get("dlcp_buffer_drop", 0), "ce_marked": g.get("dlcp_ce_marked", 0),
        "bottleneck_port": port_stats,
        "chunks": loss[0]["chunks"], "chunks_lost": loss[0]["missing_agreed"],
        "lost_marks": loss[0].get("lost_marks", {}),
        "retransmissions": int(sum(results[r]["transport"]["retransmissions"]
                                   for r in results)),
        "ce_results": int(sum(results[r]["transport"]["ce_results"] for r in results)),
        "window_cuts": int(sum(results[r]["transport"]["window_cuts"] for r in results)),
        "packets_sent": int(sum(results[r]["transport"]["packets_sent"] for r in results)),
        "test_acc": results[0]["test_acc"], "test_loss": results[0]["test_loss"],
        "buckets": results[0]["buckets"],
        "identical_loss_stats": all(s["missing_agreed"] == loss[0]["missing_agreed"]
                                    for s in loss),
        "ms_per_call_by_part": per_call_ms,
    }


def add_arguments(ap) -> None:
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rate-pps", type=float, default=20000.0,
                    help="service rate of the aggregator's switch port (packets/s)")
    ap.add_argument("--threshold", type=float, default=None,
                    help="DLCP T (packets); default: from the slot pool, workers x pool "
                         "capped at the capacity (dataplane.config.window_thresholds)")
    ap.add_argument("--threshold-step", type=float, default=0.5, help="DLCP d")
    ap.add_argument("--capacity", type=int, default=64, help="packets per (port, queue)")
    ap.add_argument("--pool", type=int, default=None,
                    help="slot pool = window per worker (default: the capacity / workers, so "
                         "the job's window fits the queue it meets)")
    ap.add_argument("--vpp", type=int, default=1024, help="values per packet")
    ap.add_argument("--partition-size", type=int, default=1 << 12)
    ap.add_argument("--bucket-mb", type=float, default=0.1,
                    help="DDP bucket cap (MB): several buckets, several DLCP bands")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-bound", type=float, default=0.1)
    ap.add_argument("--loss-wait", type=float, default=2.0,
                    help="retransmission timeouts to wait for the missing chunks once 1 - p "
                         "of them are in (the hook's default, 2; 0: DLCP's immediate finish, "
                         "which gives up chunks that are only late)")
    ap.add_argument("--background-pps", type=float, default=0.0,
                    help="other traffic into the aggregator's port, Not-ECT, in the queue "
                         "of THC's front band (datagrams/s; 0 = none)")
    ap.add_argument("--run-timeout", type=float, default=300.0)
    ap.add_argument("--aggregator", choices=("reference", "core"), default="reference",
                    help="what serves the job in the aggregator namespace: the Python "
                         "reference (in this process) or the switch core in C "
                         "(thc_udp_service, its own process)")
    ap.add_argument("--bands", type=int, default=NUM_DATA_BANDS,
                    help="DLCP bands the layers are spread over (DlcpPolicy num_bands; 1: "
                         "every bucket in one queue, marks only)")
    ap.add_argument("--ce-window", choices=("on", "off"), default="on",
                    help="workers halve their window on CE-marked RESULTs (AggregatorTransport "
                         "ce_window); marks come only where a threshold is below the capacity")
    ap.add_argument("--paired", action="store_true",
                    help="one training, DLCP on even steps and off on odd ones (no background)")


def run(args) -> dict:
    why = live_switch_skip_reason()
    if why:
        raise SystemExit(f"cannot run the incast evaluation: {why}")
    if args.pool is None:
        # A window larger than the queue overflows it every round in either mode (with 4 x 32
        # against 64, a fifth of the packets were retransmitted, docs/dlcp.md).
        args.pool = max(1, args.capacity // args.workers)
    elif args.workers * args.pool > args.capacity:
        print(f"note: the job's window, {args.workers} workers x {args.pool} slots = "
              f"{args.workers * args.pool} packets, exceeds the queue's {args.capacity}: "
              "it overflows the queue every round, with DLCP or without")
    if args.paired:
        if args.background_pps:
            raise SystemExit("--paired compares the modes without background: the "
                             "background's queue differs between them")
        return {"runs": run_mode("paired", args), "load_average": os.getloadavg(),
                "args": vars(args)}
    runs = [run_mode(mode, args) for mode in ("dlcp", "off")]
    return {"runs": runs, "load_average": os.getloadavg(), "args": vars(args)}


def plot(result, path) -> None:
    """Allreduce time per call, DLCP vs off (CDF)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for r in result["runs"]:
        ms = np.sort(np.asarray(r["call_seconds_ms"]))
        ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms),
                label=f"{r['mode']}: acc {r['test_acc']:.3f}, "
                      f"{r['selective_drops']} sel./{r['buffer_drops']} buf. drops")
    ax.set_xscale("log")
    ax.set_xlabel("allreduce time per call (ms)")
    ax.set_ylabel("fraction of calls")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
