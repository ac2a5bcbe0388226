"""The main job: data-parallel training with THC, next to torch's DDP hooks and fp32.

What a PyTorch user already has is the baseline: torch's bf16/fp16 and PowerSGD DDP
communication hooks, and DDP's plain fp32 allreduce.

    python -m host.experiments.main_job                       # 4 workers: THC, bf16 hook, fp32
    python -m host.experiments.main_job --runs thc,bf16,powersgd,none
    python -m host.experiments.main_job --workers 2 --steps 100 --compressor thc-allreduce

N worker processes (torch.multiprocessing, gloo process group) train the same MLP on
scikit-learn's digits (bundled with the package, no download), each on its own shard. Each
run uses a DDP model with one communication scheme (--runs, in order, same seed):
  thc            the THC comm hook (host.ddp_hook) through the aggregator (in-network);
  thc-allreduce  the THC comm hook over gloo all_reduce(SUM) on uint8 lanes;
  bf16, fp16     torch's bf16_compress_hook / fp16_compress_hook (cast, divide by the world
                 size, all_reduce, cast back). DDP refuses bf16_compress_hook unless CUDA
                 and NCCL 2.10+ are there, though gloo all_reduces bf16 on the CPU: there the
                 same function runs under another name, and the output says so;
  powersgd       torch's powerSGD_hook (rank --powersgd-rank, error feedback, warm start,
                 fp32 allreduce for the first --powersgd-start-iter steps), each bucket's
                 collectives after the previous bucket's (bucket_ordered_powersgd_hook);
  none           DDP's own fp32 allreduce.
With --aggregator core (the default once `make build` has built it) the switch core in C
serves the job over UDP on loopback (dataplane.udp_service.serve(core=True): the DPDK
switch's aggregation code without DPDK); with --aggregator reference the Python reference
aggregator (dataplane.udp_service) does; with --aggregator dpdk the DPDK switch
(make build; root) serves it behind a veth pair (dataplane.dpdk_runner.HostService, jumbo
frames; its
final counters go to OUT_DIR/main_job_dpdk_stats.json); HOST:PORT uses an aggregator that is
already running with this job's description:

    python -m host.experiments.main_job --aggregator 127.0.0.1:50000 --worker-port-base 41000 --write-job-config
    python -m dataplane.udp_service --config out/main_job_switch.json &
    python -m host.experiments.main_job --aggregator 127.0.0.1:50000 --worker-port-base 41000

With --link-mbit R the workers sit in network namespaces behind links shaped to R Mbit/s
both ways (host.netlab.topology.Topology, as host.experiments.bench_allreduce builds them; root): fp32 and
THC over gloo cross the shaped links through a bridge; --aggregator reference serves the
job from the bridge (in-network: its traffic crosses only the workers' links); --aggregator
dpdk puts the DPDK switch on the links' switch ends, and the process group's few control
bytes (norm exchange, barriers) go over a separate unshaped network. A model whose fp32
exchange is bound by a 1 Gbit/s link:

    sudo python -m host.experiments.main_job --link-mbit 1000 --hidden 2048 --aggregator dpdk

Printed: final test accuracy, bytes sent per worker per step, time per step of every run,
and the training time each run needed to reach a test accuracy every run reaches (the
lowest final accuracy over the runs minus TTA_MARGIN; wall clock of the steps on worker 0
after the first, evaluation excluded).
Saved: out/main_job.png (loss and accuracy vs training time, accuracy vs step),
out/main_job.json (all numbers).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numba
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import thc
from dataplane.config import MAX_VALUES, Job, Member, SwitchConfig
from dataplane.dpdk_runner import HostService, SwitchError, cannot_run
from dataplane.ports import free_port
from dataplane.udp_service import core_unavailable, serve
from dataplane.wire import AGG_PORT_BASE
from host.ddp_hook import INNETWORK_PARTITION_SIZE, thc_hook, thc_hook_state
from host.experiments.bench_allreduce import link_mtu
from host.experiments.common import load_digits_split, make_model, worker_context
from host.transport import parse_address

COMPRESSORS = ("thc", "thc-allreduce", "bf16", "fp16", "powersgd", "none")
THC_RUNS = ("thc", "thc-allreduce")     # the runs with host.ddp_hook's THC hook
BASELINES = ("bf16", "none")            # what a user runs without THC, next to it by default
IP_UDP_OVERHEAD = 28           # IPv4 + UDP header bytes per datagram on the wire
STANDARD_VALUES_PER_PACKET = 1024       # fits a 1500-byte MTU (a path we know nothing of)
TTA_MARGIN = 0.005             # time to accuracy: below the lowest final accuracy by this


# --------------------------------------------------------------------------- torch's hooks
# No annotations on the hooks below: DDP compares them with dist.GradBucket and
# Future[Tensor] as objects, and this module's annotations are strings.

def bf16_hook_for_gloo(process_group, bucket):
    """torch's bf16_compress_hook itself, under a name DDP does not refuse.

    DDP's register_comm_hook refuses a function named bf16_compress_hook unless CUDA and
    NCCL 2.10+ are there, yet gloo all_reduces bf16 tensors on the CPU."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


class BucketOrderedPowerSGD:
    """torch's PowerSGDState, and the future of the bucket whose collectives are under way.

    powerSGD_hook issues a bucket's all_reduce of the Ps and of the Qs from the callbacks of
    its previous all_reduce, on a gloo worker thread, while the autograd thread goes on to
    the next bucket's first all_reduce. gloo pairs the collectives of a process group by the
    order in which each rank issued them, so with two or more buckets the ranks disagreed
    as soon as PowerSGD started (a hang, or an abort on mismatched sizes); before it starts
    every bucket is one plain all_reduce from the autograd thread, in bucket order."""

    def __init__(self, powersgd: PowerSGDState):
        self.powersgd = powersgd
        self.pending = None


def bucket_ordered_powersgd_hook(state, bucket):
    """powerSGD_hook, each bucket's first collective issued only once the previous
    bucket's last one is done: the same order on every rank (BucketOrderedPowerSGD).
    DDP hands buckets over in index order; backward still runs while a bucket is reduced."""
    if state.pending is not None:
        state.pending.wait()
    fut = powerSGD_hook(state.powersgd, bucket)
    state.pending = None if bucket.is_last() else fut
    return fut


def powersgd_start_iter(steps: int, start_iter: int) -> int:
    """The step PowerSGD starts at: as given, or torch's advice of 10% of the training
    steps; at least 2 (PowerSGDState refuses less with error feedback or warm start)."""
    return start_iter or max(2, steps // 10)


def register_hook(model, compressor, state) -> str:
    """Attach the run's communication hook to the DDP model; say which hook runs."""
    if compressor in THC_RUNS:
        model.register_comm_hook(state, thc_hook)
        return "host.ddp_hook.thc_hook"
    if compressor == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return "torch's fp16_compress_hook"
    if compressor == "bf16":
        try:
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
            return "torch's bf16_compress_hook"
        except TypeError as exc:        # DDP's check for CUDA and NCCL, before registering
            model.register_comm_hook(None, bf16_hook_for_gloo)
            return (f"torch's bf16_compress_hook refused here ({exc}): the same function "
                    "under another name")
    if compressor == "powersgd":
        model.register_comm_hook(state, bucket_ordered_powersgd_hook)
        ps = state.powersgd
        return (f"torch's powerSGD_hook, rank {ps.matrix_approximation_rank}, from step "
                f"{ps.start_powerSGD_iter + 1} (fp32 allreduce before), buckets in order")
    return "DDP's fp32 allreduce"


def bytes_sent_per_worker(compressor, state, n_params: int, world: int, steps: int) -> float:
    """Gradient bytes one worker sent over the run. The gloo runs count the ring bound,
    2(n-1)/n of each all_reduce's buffer; THC counts what its transport sent."""
    ring = 2 * (world - 1) / world
    if compressor == "none":
        return ring * 4 * n_params * steps
    if compressor in ("bf16", "fp16"):
        return ring * 2 * n_params * steps
    if compressor == "powersgd":
        # fp32 allreduce until the start step, then the uncompressed tensors, Ps and Qs.
        ps = state.powersgd
        vanilla = min(steps, ps.start_powerSGD_iter)
        return ring * 4 * (vanilla * n_params + ps.total_numel_after_compression)
    sent = state.bytes_sent
    if compressor == "thc":
        sent += IP_UDP_OVERHEAD * state.allreduce.exchange.transport.stats.packets_sent
    return sent


# --------------------------------------------------------------------------- one worker

def _train_run(rank, world, cfg, compressor, hook_state):
    """Train from the same initial weights; return per-step metrics (rank 0 evaluates)."""
    torch.manual_seed(cfg["seed"])
    model = DDP(make_model(cfg["hidden"]), bucket_cap_mb=cfg["bucket_cap_mb"])
    hook = register_hook(model, compressor, hook_state)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    (xtr, ytr), (xte, yte) = load_digits_split(cfg["seed"])
    xs, ys = torch.from_numpy(xtr[rank::world]), torch.from_numpy(ytr[rank::world])
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
    xte_t, yte_t = torch.from_numpy(xte), torch.from_numpy(yte)
    rng = np.random.default_rng(cfg["seed"] + rank)
    batch, steps = cfg["batch"], cfg["steps"]
    log = {"step": [], "train_loss": [], "test_acc": [], "time_s": []}
    step_times = []
    sent0 = bytes_sent_per_worker(compressor, hook_state, n_params, world, 0)
    order, pos = rng.permutation(len(xs)), 0
    seconds0 = {}
    thc_run = compressor in THC_RUNS
    bar = tqdm(total=steps, desc=f"{compressor:>13}", disable=rank != 0, mininterval=0.5)
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
        if step == 1 and thc_run:
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
    sent = bytes_sent_per_worker(compressor, hook_state, n_params, world, steps) - sent0
    seconds = {k: v - seconds0.get(k, 0.0) for k, v in hook_state.allreduce.seconds.items()} \
        if thc_run else None
    return {"log": log, "bytes_per_step": sent / steps, "seconds": seconds, "hook": hook,
            "time_per_step": float(np.median(step_times)), "params": n_params}


def worker_main(rank, world, cfg, results):
    torch.set_num_threads(1)                 # N workers share this machine's cores
    numba.set_num_threads(1)
    try:
        if cfg.get("netns"):
            # On shaped links: this worker's namespace, before any socket or thread exists.
            from host.netlab.links import enter_netns
            enter_netns(cfg["netns"][rank])
            os.environ["GLOO_SOCKET_IFNAME"] = cfg["gloo_ifname"]
        os.environ.update(cfg["env"])
        dist.init_process_group("gloo", init_method=cfg["init_method"], rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        out = {}
        for compressor in cfg["runs"]:
            state = None
            if compressor in THC_RUNS:
                codec = thc.THCCodec(seed=cfg["seed"], partition_size=INNETWORK_PARTITION_SIZE)
                aggregator = cfg["aggregator"] if compressor == "thc" else None
                state = thc_hook_state(aggregator=aggregator, job=cfg["job"],
                                       job_config=SwitchConfig.local(
                                           addresses=cfg["members"], job=cfg["job"],
                                           pool_size=cfg["pool_size"],
                                           values_per_packet=cfg["values_per_packet"])
                                       if aggregator else None,
                                       pool_size=cfg["pool_size"], codec=codec,
                                       worker_address=tuple(cfg["members"][rank])
                                       if aggregator else None, timeout=cfg["timeout"],
                                       values_per_packet=cfg["values_per_packet"],
                                       loss_bound=cfg["loss_bound"] if aggregator else 0.0)
            elif compressor == "powersgd":
                state = BucketOrderedPowerSGD(PowerSGDState(
                    process_group=None, matrix_approximation_rank=cfg["powersgd_rank"],
                    use_error_feedback=True, warm_start=True,
                    start_powerSGD_iter=cfg["powersgd_start_iter"], random_seed=cfg["seed"]))
            out[compressor] = _train_run(rank, world, cfg, compressor, state)
            if compressor == "thc":
                out[compressor]["transport"] = \
                    state.allreduce.exchange.transport.stats.as_dict()
                out[compressor]["loss_stats"] = {     # counts (lost_marks is per mark)
                    k: v for k, v in state.allreduce.loss_stats.items() if isinstance(v, int)}
                state.allreduce.exchange.transport.close()
            dist.barrier()
        results.put((rank, out, None))
        dist.destroy_process_group()
    except Exception as exc:                 # reported by the parent with the worker's id
        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# --------------------------------------------------------------------------- the parent

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m host.experiments.main_job", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="worker processes (1..8 with thc)")
    ap.add_argument("--steps", type=int, default=150, help="training steps per run")
    ap.add_argument("--runs", help="comma list of the runs, in order, from "
                    f"{','.join(COMPRESSORS)} (default: --compressor, then bf16 and none)")
    ap.add_argument("--compressor", choices=COMPRESSORS,
                    help="the first run (default thc): thc: THC through the aggregator; "
                         "thc-allreduce: THC over gloo all_reduce(SUM); bf16/fp16: torch's "
                         "compress hooks; powersgd: torch's PowerSGD hook; none: plain fp32 "
                         "only (no baselines)")
    ap.add_argument("--aggregator",
                    help="core (the switch core in C over UDP on loopback; the default where "
                         "make build has built it) | reference (the Python reference over "
                         "UDP; the default elsewhere) | dpdk | HOST:PORT (running already)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the baseline runs (bf16 hook, fp32) after --compressor")
    ap.add_argument("--powersgd-rank", type=int, default=4,
                    help="powersgd: matrix_approximation_rank of PowerSGDState")
    ap.add_argument("--powersgd-start-iter", type=int, default=0,
                    help="powersgd: fp32 allreduce for this many steps first (at least 2; "
                         "0 = 10%% of --steps, torch's advice)")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="DDP's bucket_cap_mb (its default: 25)")
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
    ap.add_argument("--values-per-packet", type=int,
                    help=f"values per AGG packet (default: {MAX_VALUES}, the software "
                         "aggregators' limit, where the path takes jumbo frames: loopback, "
                         "the DPDK switch's veth, shaped links (which get MTU 9000 above "
                         f"1440); {STANDARD_VALUES_PER_PACKET} to another host)")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds without progress before a worker gives up")
    ap.add_argument("--loss-bound", type=float, default=0.0,
                    help="DLCP's bounded loss p on the in-network THC path (0 = exact): a "
                         "tensor may finish with up to p of its chunks lost, decoded as zero "
                         "on every worker alike (docs/dlcp.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="out")
    args = ap.parse_args(argv)
    args.runs = _runs(ap, args)
    thc_in_network = "thc" in args.runs
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if thc_in_network and args.workers * 30 > 255:
        ap.error(f"--workers {args.workers}: THC's 8-bit switch lanes hold at most 8 workers "
                 "(8 x granularity 30 = 240 <= 255); use --compressor thc-allreduce for more")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.powersgd_rank < 1:
        ap.error(f"--powersgd-rank {args.powersgd_rank}: the rank of PowerSGD's "
                 "approximation is at least 1")
    if args.powersgd_start_iter == 1 or args.powersgd_start_iter < 0:
        ap.error(f"--powersgd-start-iter {args.powersgd_start_iter}: PowerSGD with error "
                 "feedback and warm start starts at step 2 or later (0: 10% of --steps)")
    args.powersgd_start_iter = powersgd_start_iter(args.steps, args.powersgd_start_iter)
    if args.bucket_cap_mb <= 0:
        ap.error(f"--bucket-cap-mb {args.bucket_cap_mb}: a bucket holds more than 0 MB")
    if not 0.0 <= args.loss_bound < 1.0:
        ap.error(f"--loss-bound {args.loss_bound}: a fraction of chunks, 0 <= p < 1")
    if args.loss_bound and not thc_in_network:
        ap.error("--loss-bound applies to the in-network path: use it with a thc run "
                 "(--compressor thc, or thc in --runs)")
    no_core = core_unavailable()
    if args.aggregator is None:          # shaped links serve the reference on their bridge
        args.aggregator = "core" if not args.link_mbit and no_core is None else "reference"
        if not args.link_mbit and no_core:
            print(f"note: the Python reference serves THC ({no_core} for the switch core "
                  "in C, which needs about a sixth of its CPU per step)", file=sys.stderr)
    elif args.aggregator == "core" and args.link_mbit:
        ap.error("--aggregator core serves on loopback: with --link-mbit use --aggregator "
                 "reference (on the links' bridge) or dpdk (on the links)")
    elif args.aggregator == "core" and no_core:
        ap.error(f"--aggregator core: {no_core}; or use --aggregator reference")
    external = args.aggregator not in ("reference", "core", "dpdk")
    args.values_per_packet = _values_per_packet(ap, args, external)
    if external and thc_in_network and not args.worker_port_base:
        ap.error(f"--aggregator {args.aggregator}: give --worker-port-base so the aggregator's "
                 "member table can name each worker's UDP port (worker w uses base+w), write "
                 "it with --write-job-config, and start the aggregator with that file")
    if args.write_job_config and not external:
        ap.error("--write-job-config goes with --aggregator HOST:PORT")
    if args.link_mbit < 0:
        ap.error("--link-mbit must be positive (or 0 for loopback)")
    if args.link_mbit and external and thc_in_network:
        ap.error(f"--link-mbit puts the aggregator on the emulated links: use --aggregator "
                 f"reference or dpdk, not {args.aggregator}")
    if args.link_mbit:
        from host.netlab.links import netns_available
        reason = netns_available()
        if reason:
            ap.error(f"--link-mbit needs network namespaces: {reason}")
    return args


def _runs(ap, args) -> list[str]:
    """The runs in order: --runs, or --compressor followed by the baselines."""
    if args.runs is None:
        first = args.compressor or "thc"
        if args.no_baseline or first == "none":
            return [first]
        return [first] + [b for b in BASELINES if b != first]
    if args.compressor or args.no_baseline:
        ap.error("--runs lists every run: leave out --compressor and --no-baseline")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in COMPRESSORS]
    if unknown or not runs:
        ap.error(f"--runs {args.runs!r}: name runs from {','.join(COMPRESSORS)}, "
                 "comma-separated")
    if len(set(runs)) != len(runs):
        ap.error(f"--runs {args.runs!r}: each run at most once")
    return runs


def _values_per_packet(ap, args, external: bool) -> int:
    """--values-per-packet, or the largest the path takes: loopback, the veth of the DPDK
    switch and the shaped links carry jumbo frames, a path to another host may not."""
    vpp = args.values_per_packet
    if vpp is None:
        host = args.aggregator.rsplit(":", 1)[0]
        local = not external or args.link_mbit or host.startswith("127.") or host == "localhost"
        return MAX_VALUES if local else STANDARD_VALUES_PER_PACKET
    if not 1 <= vpp <= MAX_VALUES:
        ap.error(f"--values-per-packet {vpp}: give 1..{MAX_VALUES} (the software "
                 "aggregators' limit; a hardware switch may take fewer)")
    return vpp


def _member_addresses(args, agg_host: str) -> list[tuple[str, int]]:
    ip = "127.0.0.1" if agg_host.startswith("127.") or agg_host == "localhost" else "0.0.0.0"
    if args.worker_port_base:
        return [(ip, args.worker_port_base + w) for w in range(args.workers)]
    return [(ip, free_port()) for _ in range(args.workers)]


def _job_description(args, members):
    mems = [Member(worker=w, port=w, mac=f"02:00:00:00:00:{w + 1:02x}",
                   ip=ip if ip != "0.0.0.0" else "127.0.0.1", udp_port=port)
            for w, (ip, port) in enumerate(members)]
    job = Job.from_thc(args.job, args.pool_size, mems, values_per_packet=args.values_per_packet)
    return SwitchConfig(mac="02:00:00:00:00:fe", ip="127.0.0.1", jobs=(job,)).validate()


def start_aggregator(args):
    """(address, member addresses, stop()) for the chosen aggregator."""
    if args.aggregator in ("reference", "core"):
        members = _member_addresses(args, "127.0.0.1")
        config = _job_description(args, members)
        # Its own process: the aggregator loop does not share a GIL with anything.
        service = serve(config, "127.0.0.1", 0, process=True, core=args.aggregator == "core")
        return service.address, members, service.stop
    if args.aggregator == "dpdk":
        return start_dpdk_switch(args)
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


def start_dpdk_switch(args):
    """The DPDK switch (dataplane/dpdk/build/thc_switch) behind a veth pair (MTU 9000):
    the workers are UDP sockets on this host bound to the host end's address (every member
    on switch port 0, one MAC/IP, its own UDP port); they reach the switch's IP through it."""
    reason = cannot_run()
    if reason:
        raise SystemExit(f"--aggregator dpdk: {reason}; or use --aggregator reference")
    # A subnet and interface name of this process, so two main jobs do not collide.
    net = f"10.214.{os.getpid() % 250}"
    host_ip, switch_ip = f"{net}.1", f"{net}.254"
    ports = [free_port("0.0.0.0") for _ in range(args.workers)]
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
    print(f"DPDK switch at {switch_ip}:{AGG_PORT_BASE} behind veth {service.iface}")
    return (switch_ip, AGG_PORT_BASE), [(host_ip, p) for p in ports], stop


def run_workers(args, aggregator, members, runs=None, links=None):
    """Start the workers (forkserver processes), train `runs` in order; {rank: results}.

    links: on shaped links, {"netns": per-rank namespace, "gloo_ifname", "master": the
    process group's rendezvous address}; None: loopback."""
    ctx = worker_context()
    runs = runs or args.runs
    if links:
        from host.netlab.shaped_links import GLOO_PORT
        init_method = f"tcp://{links['master']}:{GLOO_PORT}"
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    cfg = {"init_method": init_method, "runs": runs, "seed": args.seed,
           "hidden": args.hidden, "batch": args.batch, "lr": args.lr, "steps": args.steps,
           "eval_every": args.eval_every, "job": args.job, "pool_size": args.pool_size,
           "aggregator": f"{aggregator[0]}:{aggregator[1]}" if aggregator else None,
           "members": members, "timeout": args.timeout,
           "values_per_packet": args.values_per_packet, "loss_bound": args.loss_bound,
           "bucket_cap_mb": args.bucket_cap_mb, "powersgd_rank": args.powersgd_rank,
           "powersgd_start_iter": args.powersgd_start_iter,
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
    from host.netlab.aggregators import stop
    from host.netlab.shaped_links import (AGG_PORT, WORKER_UDP_PORT, job_config, start_dpdk,
                                          start_reference)
    from host.netlab.topology import Topology
    outs: dict = {}
    mtu = link_mtu(args.values_per_packet)
    for run in args.runs:
        dpdk = run == "thc" and args.aggregator == "dpdk"
        if dpdk and cannot_run():
            raise SystemExit(f"--aggregator dpdk: {cannot_run()}")
        print(f"{run}: {args.workers} workers on {args.link_mbit:g} Mbit/s links (MTU {mtu})"
              + (", DPDK switch on the links" if dpdk else
                 ", reference aggregator on the bridge" if run == "thc" else ""))
        with Topology(args.workers, args.link_mbit, layout="ports" if dpdk else "bridge",
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


def run_names(args) -> dict[str, str]:
    """What the table and the plot call each run."""
    return {"thc": "THC in-network", "thc-allreduce": "THC over gloo", "bf16": "bf16 hook",
            "fp16": "fp16 hook", "powersgd": f"PowerSGD rank {args.powersgd_rank}",
            "none": "fp32 allreduce"}


def report(args, runs, outs):
    names = run_names(args)
    summary = {}
    served = {"core": ", THC served by the switch core in C (thc_udp_service)",
              "reference": ", THC served by the Python reference",
              "dpdk": ", THC served by the DPDK switch"}
    print(f"\n{args.workers} workers, {args.steps} steps, MLP with "
          f"{outs[0][runs[0]]['params']} parameters"
          + (served.get(args.aggregator, f", THC served at {args.aggregator}")
             if "thc" in runs else ""))
    print(f"{'run':<18}{'test acc':>10}{'train loss':>12}{'KB sent/step':>14}{'ms/step':>10}")
    for run in runs:
        r0 = outs[0][run]
        per_step = sum(outs[w][run]["bytes_per_step"] for w in outs) / len(outs)
        ms = 1e3 * sum(outs[w][run]["time_per_step"] for w in outs) / len(outs)
        summary[run] = {"test_acc": r0["log"]["test_acc"][-1],
                        "train_loss": r0["log"]["train_loss"][-1],
                        "bytes_sent_per_worker_per_step": per_step, "ms_per_step": ms,
                        "hook": r0["hook"], "log": r0["log"], "transport": r0.get("transport"),
                        "loss_stats": r0.get("loss_stats"),
                        "allreduce_seconds": r0.get("seconds")}
        print(f"{names[run]:<18}{summary[run]['test_acc']:>10.3f}"
              f"{summary[run]['train_loss']:>12.4f}{per_step / 1024:>14.1f}{ms:>10.2f}")
    for run in runs:
        print(f"  {names[run]}: {summary[run]['hook']}")
    if "none" in summary and len(runs) > 1:
        fp32 = summary["none"]["bytes_sent_per_worker_per_step"]
        print("bytes sent per worker, fp32 / run: " + ", ".join(
            f"{names[run]} {fp32 / summary[run]['bytes_sent_per_worker_per_step']:.1f}x"
            for run in runs if run != "none"))
    tta = time_to_accuracy(summary, runs)
    if tta:
        print_time_to_accuracy(tta, names)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "main_job.json").write_text(json.dumps(
        {"workers": args.workers, "steps": args.steps, "link_mbit": args.link_mbit,
         "hidden": args.hidden, "values_per_packet": args.values_per_packet,
         "bucket_cap_mb": args.bucket_cap_mb, "loss_bound": args.loss_bound,
         "aggregator": args.aggregator, "powersgd_rank": args.powersgd_rank,
         "powersgd_start_iter": args.powersgd_start_iter, "runs": summary,
         "time_to_accuracy": tta},
        indent=1))
    plot(summary, names, tta, out_dir / "main_job.png")
    print(f"saved {out_dir / 'main_job.png'} and {out_dir / 'main_job.json'}")
    return summary


def time_to_accuracy(summary, runs) -> dict | None:
    """Training time (worker 0's steps, evaluation excluded) at the first evaluation where
    each run's test accuracy reached the target: the lowest final test accuracy over the
    runs minus TTA_MARGIN, so that every run reaches it; None with a single run."""
    if len(runs) < 2:
        return None
    lowest = min(runs, key=lambda run: summary[run]["test_acc"])
    target = summary[lowest]["test_acc"] - TTA_MARGIN
    seconds = {}
    for run in runs:
        log = summary[run]["log"]
        seconds[run] = next(t for t, acc in zip(log["time_s"], log["test_acc"]) if acc >= target)
    fp32 = seconds.get("none")
    speedup = {run: fp32 / t for run, t in seconds.items() if run != "none" and t > 0} \
        if fp32 else None
    return {"target": target, "lowest_final": {"run": lowest,
                                               "test_acc": summary[lowest]["test_acc"]},
            "margin": TTA_MARGIN, "seconds": seconds, "speedup_vs_fp32": speedup}


def print_time_to_accuracy(tta, names) -> None:
    lowest = tta["lowest_final"]
    print(f"training time to test accuracy {tta['target']:.3f} (the lowest final one, "
          f"{names[lowest['run']]}'s {lowest['test_acc']:.3f}, minus {tta['margin']}; "
          "worker 0, evaluation excluded): " + ", ".join(
              f"{names[run]} {t:.1f} s" for run, t in tta["seconds"].items()))
    if tta["speedup_vs_fp32"]:
        print("  fp32's time / run's (above 1: sooner than fp32): " + ", ".join(
            f"{names[run]} {x:.2f}x" for run, x in tta["speedup_vs_fp32"].items()))


def plot(summary, names, tta, path):
    """Loss and accuracy against worker 0's training time, and accuracy against steps."""
    fig = Figure(figsize=(15, 4))
    ax_loss, ax_acc, ax_step = fig.subplots(1, 3)
    for run, s in summary.items():
        ax_loss.plot(s["log"]["time_s"], s["log"]["train_loss"], label=names[run])
        ax_acc.plot(s["log"]["time_s"], s["log"]["test_acc"], label=names[run])
        ax_step.plot(s["log"]["step"], s["log"]["test_acc"], label=names[run])
    if tta:
        ax_acc.axhline(tta["target"], color="grey", linestyle=":", label="time-to-accuracy target")
    ax_loss.set(xlabel="training time, worker 0 (s)", ylabel="training loss (full train set)",
                yscale="log")
    ax_acc.set(xlabel="training time, worker 0 (s)", ylabel="test accuracy")
    ax_step.set(xlabel="step", ylabel="test accuracy")
    for ax in (ax_loss, ax_acc, ax_step):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("digits MLP: " + ", ".join(names[run] for run in summary))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _exit_on_sigterm(signum, frame):
    for worker in multiprocessing.active_children():   # the training processes first
        worker.terminate()
    raise SystemExit(128 + signum)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The workers share this machine: each codec takes its share of the cores (host.allreduce).
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(args.workers))
    stop = lambda: None  # noqa: E731
    aggregator, members = None, None
    # SIGTERM ends the job like Ctrl-C: the finally below stops the aggregator (the DPDK
    # switch and its veth pair) and the network lab tears its links down.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if "thc" in args.runs and not args.link_mbit:
        aggregator, members, stop = start_aggregator(args)
    try:
        t0 = time.monotonic()
        outs = run_on_links(args) if args.link_mbit else \
            run_workers(args, aggregator, members)
        summary = report(args, args.runs, outs)
        print(f"total {time.monotonic() - t0:.1f} s")
    finally:
        stop()
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
