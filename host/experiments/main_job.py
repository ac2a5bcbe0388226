"""The main job: data-parallel training with THC in-network aggregation, next to plain fp32.

    python -m host.experiments.main_job                       # 4 workers, reference aggregator, THC vs fp32
    python -m host.experiments.main_job --workers 2 --steps 100 --compressor thc-allreduce

N worker processes (torch.multiprocessing, gloo process group) train the same MLP on
scikit-learn's digits (bundled with the package, no download), each on its own shard. Each
run uses a DDP model; the THC run attaches the THC comm hook (host.ddp_hook), the baseline
run DDP's own fp32 allreduce. With --aggregator reference the embedded reference aggregator
(dataplane.udp_service) serves the job on loopback; with --aggregator dpdk the DPDK switch
(make build; root) serves it behind a veth pair (dataplane.dpdk_runner.HostService, jumbo
frames; its
final counters go to OUT_DIR/main_job_dpdk_stats.json); HOST:PORT uses an aggregator that is
already running with this job's description:

    python -m host.experiments.main_job --aggregator 127.0.0.1:50000 --worker-port-base 41000 --write-job-config
    python -m dataplane.udp_service --config out/main_job_switch.json &
    python -m host.experiments.main_job --aggregator 127.0.0.1:50000 --worker-port-base 41000

With --link-mbit R the workers sit in network namespaces behind links shaped to R Mbit/s
both ways (host.netlab.netem.NetnsTestbed, as host.experiments.bench_allreduce builds them; root): fp32 and
THC over gloo cross the shaped links through a bridge; --aggregator reference serves the
job from the bridge (in-network: its traffic crosses only the workers' links); --aggregator
dpdk puts the DPDK switch on the links' switch ends, and the process group's few control
bytes (norm exchange, barriers) go over a separate unshaped network. A model whose fp32
exchange is bound by a 1 Gbit/s link:

    sudo python -m host.experiments.main_job --link-mbit 1000 --hidden 2048 --aggregator dpdk

Printed: final test accuracy, bytes sent per worker per step, time per step of both runs,
and the training time each run needed to reach fp32's final test accuracy (wall clock of
the steps on worker 0 after the first, evaluation excluded).
Saved: out/main_job.png (loss and accuracy vs step, accuracy vs training time),
out/main_job.json (all numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from host.experiments.common import load_digits_split, make_model
from host.ddp_hook import INNETWORK_PARTITION_SIZE

COMPRESSORS = ("thc", "thc-allreduce", "none")
IP_UDP_OVERHEAD = 28           # IPv4 + UDP header bytes per datagram on the wire


# --------------------------------------------------------------------------- one worker

def _train_run(rank, world, cfg, compressor, hook_state, progress):
    """Train from the same initial weights; return per-step metrics (rank 0 evaluates)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from host.ddp_hook import thc_hook

    torch.manual_seed(cfg["seed"])
    model = DDP(make_model(cfg["hidden"]))
    if compressor != "none":
        model.register_comm_hook(hook_state, thc_hook)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    (xtr, ytr), (xte, yte) = load_digits_split(cfg["seed"])
    xs, ys = torch.from_numpy(xtr[rank::world]), torch.from_numpy(ytr[rank::world])
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
    xte_t, yte_t = torch.from_numpy(xte), torch.from_numpy(yte)
    rng = np.random.default_rng(cfg["seed"] + rank)
    batch, steps = cfg["batch"], cfg["steps"]
    log = {"step": [], "train_loss": [], "test_acc": [], "time_s": []}
    step_times = []
    bytes0 = hook_state.bytes_sent if hook_state else 0
    packets0 = hook_state.allreduce.exchange.transport.stats.packets_sent \
        if hook_state and compressor == "thc" else 0
    order, pos = rng.permutation(len(xs)), 0
    seconds0 = {}
    bar = progress(total=steps, desc=f"{compressor:>13}", disable=rank != 0, mininterval=0.5)
    for step in range(1, steps + 1):
        if pos + batch > len(order):
            order, pos = rng.permutation(len(xs)), 0
        idx = torch.from_numpy(order[pos:pos + batch])
        pos += batch
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()                      # the comm hook runs here
        opt.step()
        step_times.append(time.perf_counter() - t0)
        if step == 1 and hook_state:
            seconds0 = dict(hook_state.allreduce.seconds)     # after the set-up step
        if rank == 0 and (step % cfg["eval_every"] == 0 or step == steps):
            with torch.no_grad():
                log["step"].append(step)
                # Training time without evaluation, from the end of step 1 (the first
                # step of either run sets up: kernels, buckets, the aggregator's flush).
                log["time_s"].append(float(sum(step_times[1:])))
                log["train_loss"].append(float(F.cross_entropy(model.module(xtr_t), ytr_t)))
                log["test_acc"].append(float((model.module(xte_t).argmax(1) == yte_t)
                                             .float().mean()))
            bar.set_postfix(loss=f"{log['train_loss'][-1]:.3f}", acc=f"{log['test_acc'][-1]:.3f}")
        bar.update(1)
    bar.close()
    n_params = sum(p.numel() for p in model.parameters())
    if compressor == "none":
        # DDP's fp32 ring allreduce: 2(n-1)/n of the gradient bytes leave each worker.
        sent = 2 * (world - 1) / world * 4 * n_params * steps
    else:
        sent = hook_state.bytes_sent - bytes0
        if compressor == "thc":
            packets = hook_state.allreduce.exchange.transport.stats.packets_sent - packets0
            sent += IP_UDP_OVERHEAD * packets
    seconds = {k: v - seconds0.get(k, 0.0) for k, v in hook_state.allreduce.seconds.items()} \
        if hook_state else None
    return {"log": log, "bytes_per_step": sent / steps, "seconds": seconds,
            "time_per_step": float(np.median(step_times)), "params": n_params}


def worker_main(rank, world, cfg, results):
    import datetime

    import numba
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    import thc
    from host.ddp_hook import thc_hook_state

    torch.set_num_threads(1)                 # N workers share this machine's cores
    numba.set_num_threads(1)
    try:
        if cfg.get("netns"):
            # On shaped links: this worker's namespace, before any socket or thread exists.
            from host.netlab.shaped_links import enter_netns
            enter_netns(cfg["netns"][rank])
            os.environ["GLOO_SOCKET_IFNAME"] = cfg["gloo_ifname"]
        os.environ.update(cfg["env"])
        dist.init_process_group("gloo", init_method=cfg["init_method"], rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        out = {}
        for compressor in cfg["runs"]:
            state = None
            if compressor != "none":
                codec = thc.THCCodec(seed=cfg["seed"], partition_size=INNETWORK_PARTITION_SIZE)
                aggregator = cfg["aggregator"] if compressor == "thc" else None
                state = thc_hook_state(aggregator=aggregator, job=cfg["job"],
                                       pool_size=cfg["pool_size"], codec=codec,
                                       worker_address=tuple(cfg["members"][rank])
                                       if aggregator else None, timeout=cfg["timeout"],
                                       values_per_packet=cfg["values_per_packet"],
                                       loss_bound=cfg["loss_bound"] if aggregator else 0.0)
            out[compressor] = _train_run(rank, world, cfg, compressor, state, tqdm)
            if state and compressor == "thc":
                out[compressor]["transport"] = \
                    state.allreduce.exchange.transport.stats.as_dict()
                out[compressor]["loss_stats"] = {     # counts (lost_marks is per mark)
                    k: v for k, v in state.allreduce.loss_stats.items() if isinstance(v, int)}
                state.allreduce.exchange.transport.close()
            dist.barrier()
        results.put((rank, out, None))
        dist.destroy_process_group()
    except Exception as exc:                 # reported by the parent with the worker's id
        import traceback
        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# --------------------------------------------------------------------------- the parent

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m host.experiments.main_job", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="worker processes (1..8 with thc)")
    ap.add_argument("--steps", type=int, default=150, help="training steps per run")
    ap.add_argument("--compressor", choices=COMPRESSORS, default="thc",
                    help="thc: THC through the aggregator; thc-allreduce: THC over gloo "
                         "all_reduce(SUM); none: plain fp32 only")
    ap.add_argument("--aggregator", default="reference",
                    help="reference (embedded, loopback) | dpdk | HOST:PORT (running already)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the fp32 comparison run")
    ap.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    ap.add_argument("--batch", type=int, default=32, help="batch per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--pool-size", type=int, default=128, help="aggregator slots of the job")
    ap.add_argument("--job", type=int, default=1)
    ap.add_argument("--worker-port-base", type=int, default=0,
                    help="UDP port of worker 0 (worker w uses base+w); 0 = free ports")
    ap.add_argument("--write-job-config", action="store_true",
                    help="with --aggregator HOST:PORT: write the job description the "
                         "aggregator must load (OUT_DIR/main_job_switch.json) and exit")
    ap.add_argument("--link-mbit", type=float, default=0.0,
                    help="workers in network namespaces behind links shaped to this rate "
                         "(Mbit/s, both ways; root); 0: loopback")
    ap.add_argument("--values-per-packet", type=int, default=1024,
                    help="values per AGG packet (up to the aggregator's MAX_VALUES; on "
                         "shaped links above 1440 the links get jumbo frames)")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds without progress before a worker gives up")
    ap.add_argument("--loss-bound", type=float, default=0.0,
                    help="DLCP's bounded loss p on the in-network THC path (0 = exact): a "
                         "tensor may finish with up to p of its chunks lost, decoded as zero "
                         "on every worker alike (docs/dlcp.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="out")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if args.compressor == "thc" and args.workers * 30 > 255:
        ap.error(f"--workers {args.workers}: THC's 8-bit switch lanes hold at most 8 workers "
                 "(8 x granularity 30 = 240 <= 255); use --compressor thc-allreduce for more")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if not 0.0 <= args.loss_bound < 1.0:
        ap.error(f"--loss-bound {args.loss_bound}: a fraction of chunks, 0 <= p < 1")
    if args.loss_bound and args.compressor != "thc":
        ap.error("--loss-bound applies to the in-network path: use it with --compressor thc")
    external = args.aggregator not in ("reference", "dpdk")
    if external and args.compressor == "thc" and not args.worker_port_base:
        ap.error(f"--aggregator {args.aggregator}: give --worker-port-base so the aggregator's "
                 "member table can name each worker's UDP port (worker w uses base+w), write "
                 "it with --write-job-config, and start the aggregator with that file")
    if args.write_job_config and not external:
        ap.error("--write-job-config goes with --aggregator HOST:PORT")
    if args.link_mbit < 0:
        ap.error("--link-mbit must be positive (or 0 for loopback)")
    if args.link_mbit and external and args.compressor == "thc":
        ap.error(f"--link-mbit puts the aggregator on the emulated links: use --aggregator "
                 f"reference or dpdk, not {args.aggregator}")
    if args.link_mbit:
        from host.netlab.netem import netns_available
        reason = netns_available()
        if reason:
            ap.error(f"--link-mbit needs network namespaces: {reason}")
    return args


def _member_addresses(args, agg_host: str) -> list[tuple[str, int]]:
    from host.ddp_hook import free_udp_port
    ip = "127.0.0.1" if agg_host.startswith("127.") or agg_host == "localhost" else "0.0.0.0"
    if args.worker_port_base:
        return [(ip, args.worker_port_base + w) for w in range(args.workers)]
    return [(ip, free_udp_port()) for _ in range(args.workers)]


def _job_description(args, members):
    from dataplane.config import Job, Member, SwitchConfig
    mems = [Member(worker=w, port=w, mac=f"02:00:00:00:00:{w + 1:02x}",
                   ip=ip if ip != "0.0.0.0" else "127.0.0.1", udp_port=port)
            for w, (ip, port) in enumerate(members)]
    job = Job.from_thc(args.job, args.pool_size, mems, values_per_packet=args.values_per_packet)
    return SwitchConfig(mac="02:00:00:00:00:fe", ip="127.0.0.1", jobs=(job,)).validate()


def start_aggregator(args):
    """(address, member addresses, stop()) for the chosen aggregator."""
    if args.aggregator == "reference":
        from dataplane.udp_service import serve
        members = _member_addresses(args, "127.0.0.1")
        config = _job_description(args, members)
        # Its own process: the aggregator loop does not share a GIL with anything.
        service = serve(config, "127.0.0.1", 0, process=True)
        return service.address, members, service.stop
    if args.aggregator == "dpdk":
        return start_dpdk_switch(args)
    from host.transport import parse_address
    host, port = parse_address(args.aggregator)
    members = _member_addresses(args, host)
    path = Path(args.out_dir) / "main_job_switch.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _job_description(args, members).save(path)
    if args.write_job_config:
        print(f"wrote {path}: start the aggregator with it, e.g. python -m "
              f"dataplane.udp_service --config {path} --host {host} --port {port}")
        raise SystemExit(0)
    print(f"using the aggregator at {host}:{port} (job description: {path})")
    return (host, port), members, lambda: None


def dpdk_unavailable() -> str | None:
    """Why the embedded DPDK switch cannot run here (None when it can)."""
    from dataplane.dpdk_runner import SWITCH_BIN
    if not SWITCH_BIN.is_file():
        return f"{SWITCH_BIN} is not built: run `make build` (needs libdpdk-dev)"
    if os.geteuid() != 0:
        return "the DPDK switch needs root (EAL, and a veth pair for the workers)"
    return None


def start_dpdk_switch(args):
    """The DPDK switch (dataplane/dpdk/build/thc_switch) behind a veth pair (MTU 9000):
    the workers are UDP sockets on this host bound to the host end's address (every member
    on switch port 0, one MAC/IP, its own UDP port); they reach the switch's IP through it."""
    from dataplane.config import Job, Member, SwitchConfig
    from dataplane.dpdk_runner import HostService, SwitchError
    from host.ddp_hook import free_udp_port
    reason = dpdk_unavailable()
    if reason:
        raise SystemExit(f"--aggregator dpdk: {reason}; or use --aggregator reference")
    # A subnet and interface name of this process, so two main jobs do not collide.
    net = f"10.214.{os.getpid() % 250}"
    host_ip, switch_ip = f"{net}.1", f"{net}.254"
    ports = [free_udp_port("0.0.0.0") for _ in range(args.workers)]
    mems = tuple(Member(worker=w, port=0, mac="02:00:00:00:d0:01", ip=host_ip, udp_port=p)
                 for w, p in enumerate(ports))
    config = SwitchConfig(mac="02:00:00:00:d0:fe", ip=switch_ip,
                          jobs=(Job.from_thc(args.job, args.pool_size, mems,
                                             values_per_packet=args.values_per_packet),)
                          ).validate()
    service = HostService(config, iface=f"thcmj{os.getpid() % 100000}")
    try:
        service.start()
    except SwitchError as exc:
        raise SystemExit(f"--aggregator dpdk: {exc}") from exc
    stats = {}

    def stop():
        stats.update(service.stop() or {})
        path = Path(args.out_dir) / "main_job_dpdk_stats.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stats, indent=1))
    print(f"DPDK switch at {switch_ip}:50000 behind veth {service.iface}")
    return (switch_ip, 50000), [(host_ip, p) for p in ports], stop


def planned_runs(args) -> list[str]:
    return [args.compressor] if args.no_baseline or args.compressor == "none" \
        else [args.compressor, "none"]


def run_workers(args, aggregator, members, runs=None, links=None):
    """Start the workers (forkserver processes), train `runs` in order; {rank: results}.

    links: on shaped links, {"netns": per-rank namespace, "gloo_ifname", "master": the
    process group's rendezvous address}; None: loopback."""
    import socket

    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "sklearn.datasets", "thc"])
    runs = runs or planned_runs(args)
    if links:
        from host.netlab.shaped_links import GLOO_PORT
        init_method = f"tcp://{links['master']}:{GLOO_PORT}"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    cfg = {"init_method": init_method, "runs": runs, "seed": args.seed,
           "hidden": args.hidden, "batch": args.batch, "lr": args.lr, "steps": args.steps,
           "eval_every": args.eval_every, "job": args.job, "pool_size": args.pool_size,
           "aggregator": f"{aggregator[0]}:{aggregator[1]}" if aggregator else None,
           "members": members, "timeout": args.timeout,
           "values_per_packet": args.values_per_packet, "loss_bound": args.loss_bound,
           "netns": links["netns"] if links else None,
           "gloo_ifname": links["gloo_ifname"] if links else None,
           "env": links["env"] if links else {}}
    results = ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(r, args.workers, cfg, results))
             for r in range(args.workers)]
    for p in procs:
        p.start()
    outs, errors = {}, []
    deadline = time.monotonic() + 60 + args.steps * 5 * len(runs)
    while len(outs) + len(errors) < args.workers:
        try:
            rank, out, err = results.get(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outs]
            errors.append(f"timed out waiting for workers; exited without a result: {dead}")
            break
        if err:
            errors.append(f"worker {rank}: {err}")
        else:
            outs[rank] = out
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors:
        raise SystemExit("main job failed:\n" + "\n".join(errors))
    return outs


def run_on_links(args) -> dict:
    """Each run on its own testbed of shaped links (--link-mbit): {rank: {run: results}}."""
    import tempfile

    from host.experiments.bench_allreduce import link_mtu
    from host.netlab.netem import NetnsTestbed
    from host.netlab.shaped_links import (AGG_PORT, WORKER_UDP_PORT, job_config, start_dpdk,
                                   start_reference, stop)
    outs: dict = {}
    mtu = link_mtu(args.values_per_packet)
    for run in planned_runs(args):
        dpdk = run == "thc" and args.aggregator == "dpdk"
        if dpdk and dpdk_unavailable():
            raise SystemExit(f"--aggregator dpdk: {dpdk_unavailable()}")
        print(f"{run}: {args.workers} workers on {args.link_mbit:g} Mbit/s links (MTU {mtu})"
              + (", DPDK switch on the links" if dpdk else
                 ", reference aggregator on the bridge" if run == "thc" else ""))
        with NetnsTestbed(args.workers, args.link_mbit, switch="ports" if dpdk else "bridge",
                          mtu=mtu) as tb, tempfile.TemporaryDirectory() as tmp:
            aggregator, members, agg = None, None, None
            if run == "thc":
                config = job_config(tb, args.pool_size, args.job, args.values_per_packet)
                agg = start_dpdk(tb, config, Path(tmp)) if dpdk else \
                    start_reference(tb, config, Path(tmp))
                aggregator = (tb.switch_ip, AGG_PORT)
                members = [(tb.host_ip(w), WORKER_UDP_PORT) for w in range(args.workers)]
            links = {"netns": tb.host_ns, "gloo_ifname": "ctl0" if dpdk else "eth0",
                     "master": tb.control_ip(0) if dpdk else tb.host_ip(0), "env": {}}
            try:
                per_rank = run_workers(args, aggregator, members, [run], links)
            finally:
                stop(agg)
            for rank, result in per_rank.items():
                outs.setdefault(rank, {}).update(result)
    return outs


def report(args, runs, outs):
    names = {"thc": "THC in-network", "thc-allreduce": "THC over gloo", "none": "fp32 allreduce"}
    summary = {}
    print(f"\n{args.workers} workers, {args.steps} steps, MLP with "
          f"{outs[0][runs[0]]['params']} parameters")
    print(f"{'run':<16}{'test acc':>10}{'train loss':>12}{'KB sent/step':>14}{'ms/step':>10}")
    for run in runs:
        r0 = outs[0][run]
        per_step = sum(outs[w][run]["bytes_per_step"] for w in outs) / len(outs)
        ms = 1e3 * sum(outs[w][run]["time_per_step"] for w in outs) / len(outs)
        summary[run] = {"test_acc": r0["log"]["test_acc"][-1],
                        "train_loss": r0["log"]["train_loss"][-1],
                        "bytes_sent_per_worker_per_step": per_step, "ms_per_step": ms,
                        "log": r0["log"], "transport": r0.get("transport"),
                        "loss_stats": r0.get("loss_stats"),
                        "allreduce_seconds": r0.get("seconds")}
        print(f"{names[run]:<16}{summary[run]['test_acc']:>10.3f}"
              f"{summary[run]['train_loss']:>12.4f}{per_step / 1024:>14.1f}{ms:>10.2f}")
    if len(runs) == 2:
        ratio = summary[runs[1]]["bytes_sent_per_worker_per_step"] / \
            summary[runs[0]]["bytes_sent_per_worker_per_step"]
        print(f"bytes sent: fp32 / {runs[0]} = {ratio:.1f}x")
    tta = time_to_accuracy(summary, runs)
    if tta:
        print(f"training time to fp32's final test accuracy {tta['target']:.3f} (worker 0, "
              "evaluation excluded): " + ", ".join(
                  f"{names[run]} {t:.1f} s" if t is not None else f"{names[run]} not reached"
                  for run, t in tta["seconds"].items()) +
              (f"; fp32 / {runs[0]} = {tta['speedup']:.2f}x" if tta["speedup"] else ""))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "main_job.json").write_text(json.dumps(
        {"workers": args.workers, "steps": args.steps, "link_mbit": args.link_mbit,
         "hidden": args.hidden, "values_per_packet": args.values_per_packet,
         "loss_bound": args.loss_bound, "aggregator": args.aggregator, "runs": summary,
         "time_to_accuracy": tta},
        indent=1))
    plot(summary, names, out_dir / "main_job.png")
    print(f"saved {out_dir / 'main_job.png'} and {out_dir / 'main_job.json'}")
    return summary


def time_to_accuracy(summary, runs) -> dict | None:
    """Training time (worker 0's steps, evaluation excluded) at the first evaluation where
    each run's test accuracy reached fp32's final one; None without an fp32 run."""
    if "none" not in summary or len(runs) < 2:
        return None
    target = summary["none"]["test_acc"]
    seconds = {}
    for run in runs:
        log = summary[run]["log"]
        reached = [t for t, acc in zip(log["time_s"], log["test_acc"]) if acc >= target]
        seconds[run] = reached[0] if reached else None
    first = seconds[runs[0]]
    speedup = seconds["none"] / first if first and seconds["none"] else None
    return {"target": target, "seconds": seconds, "speedup": speedup}


def plot(summary, names, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(15, 4))
    for run, s in summary.items():
        ax_loss.plot(s["log"]["step"], s["log"]["train_loss"], label=names[run])
        ax_acc.plot(s["log"]["step"], s["log"]["test_acc"], label=names[run])
        ax_time.plot(s["log"]["time_s"], s["log"]["test_acc"], label=names[run])
    ax_loss.set(xlabel="step", ylabel="training loss (full train set)", yscale="log")
    ax_acc.set(xlabel="step", ylabel="test accuracy")
    ax_time.set(xlabel="training time, worker 0 (s)", ylabel="test accuracy")
    for ax in (ax_loss, ax_acc, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("digits MLP: THC vs fp32 allreduce")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stop = lambda: None  # noqa: E731
    aggregator, members = None, None
    if args.compressor == "thc" and not args.link_mbit:
        aggregator, members, stop = start_aggregator(args)
    try:
        t0 = time.monotonic()
        outs = run_on_links(args) if args.link_mbit else \
            run_workers(args, aggregator, members)
        summary = report(args, planned_runs(args), outs)
        print(f"total {time.monotonic() - t0:.1f} s")
    finally:
        stop()
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
