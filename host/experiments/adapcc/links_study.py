"""AdapCC on shaped links: profiler + synthesizer + executor against gloo, measured (root).

    python -m host.experiments.adapcc.links_study [--json FILE] [--rates 200,200,100,50]
        [--delays 0,1,2,4] [--mb 4] [--reps 3] [--change 0:30|none] [--m 1]
        [--servers 0,0,1,1] [--background SRC:DST:MBIT] [--restart]

Four worker processes, each in its own network namespace of the lab (host.netlab.topology,
bridge layout) on links of different rates (and latencies, where the kernel has netem), form
a gloo process group over those links.  In each phase every rank profiles the links
(``profile_links``), rank 0 synthesizes an AllReduce strategy (``Synthesizer``) on the
profile read as hosts whose one link is their NIC, shared by all their flows
(``shared_nic_network``; ``--pairwise-model``: on the pairwise profile itself, which
cannot see that a star's flows into one host share its link) and broadcasts it, with the
NIC relays left out of its routes (``on_gpus``), and on the same tensor the ranks time,
interleaved, rep by rep:
gloo's own ``dist.all_reduce`` (ring), the synthesized strategy and the executor's fixed ring,
binary tree and star (``host/adapcc/strategies.py``, rooted at rank 0, at the builders' 8
chunks and at the synthesized strategy's chunk count).  A time is the slowest
rank's, after a barrier; the table gives the median over reps.  Between the phases the parent
re-shapes one host's link (``Topology.set_rate``, --change host:mbit), and the same processes
re-profile, re-synthesize (the same Synthesizer, the same executor) and time again.  Every
result is compared with the expected sum (integers in float32, so exact).  With
``--train-steps N`` each phase also trains the main job's model (host.experiments.common: the
MLP on scikit-learn digits, --hidden wide) for N steps twice from the same weights, once with
DDP's own gloo allreduce and once with the synthesized strategy as DDP's comm hook
(``executor_hook``), and reports the median step time of the slowest rank and the final
parameters' largest difference between the two.  The tests call ``run_study``.

The synthesizer builds one sub-collective (--m 1) by default: on a shared 2-core machine every
chunk step of the executor costs milliseconds of scheduling that the profiled alpha does not
show, and with M = 2 the synthesizer's picks (twice the chunk steps) measured slower than the
fixed strategies.  Without netem (some kernels) the links are shaped by tbf, rate only: the
delays are then not applied, and the JSON says so (``netem``, ``delays_ms``).

``--background src:dst:mbit`` starts paced UDP from host src to host dst when phase 1
begins (before its profile), so the other traffic on the links changes during the run, with
or without a re-shape (``--change none``).

``--restart`` then times the paper's baseline for changing a strategy (Fig. 19c) on the
same links: rank 0 checkpoints the main job's model and optimizer, every rank exits, and
the parent relaunches the ranks, which join a new process group, load the checkpoint and
(as a job planning afresh) profile and solve; against phase 1's reconstruction in place.

``--servers`` emulates servers with several GPUs: servers[r] is rank r's server, each server
one namespace with one shaped link (its NIC, --rates and --delays per server), so the ranks
of a server talk over the namespace's loopback and share the NIC for everything else, and
the synthesizer's model has several GPUs behind each NIC.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from host.adapcc import strategies
from host.adapcc.costmodel import evaluate, on_gpus
from host.adapcc.executor import TreeExecutor
from host.adapcc.profiler import profile_links, server_layout, shared_nic_network
from host.adapcc.synthesizer import Synthesizer
from host.netlab.background import mbit_to_pps, send_paced
from host.experiments.common import load_digits_split, make_model

GLOO_PORT = 29611
PROFILE_KB = (16, 128)         # profile_links piece sizes: small enough for 50 Mbit/s links
FIXED = ("ring", "binary tree", "star")
GLOO = "gloo all_reduce (ring)"
SYNTH = "synthesized"


# --------------------------------------------------------------------------- the workers

def _local(rank: int, numel: int):
    """Small integers, so float32 sums are exact in any order of addition."""
    return ((torch.arange(numel) % 1024) * (rank + 1) + rank).to(torch.float32)


def _expected(world: int, numel: int):
    return sum(_local(r, numel).double() for r in range(world))


def _chunk_counts(synthesized) -> tuple[int, ...]:
    """The builders' default (8) and, so that chunking alone is no advantage, the
    synthesized strategy's own chunk count."""
    return tuple(sorted({8, synthesized.subs[0].n_chunks}))


def fixed_name(shape: str, chunks: int) -> str:
    return f"{shape}, {chunks} chunks"


def _fixed(net, nbytes: int, chunk_counts) -> dict:
    """The executor's hand-built shapes by rank index, rooted at rank 0, one tree."""
    builders = (strategies.ring, strategies.binary_tree, strategies.star)
    return {fixed_name(shape, k): build(net, "allreduce", 0, nbytes, n_chunks=k, m=1)
            for k in chunk_counts for shape, build in zip(FIXED, builders)}


def _candidates(world: int, nbytes: int, synthesized: dict) -> dict:
    """Name -> strategy (None: gloo's own all_reduce)."""
    counts = _chunk_counts(synthesized[SYNTH])
    return {GLOO: None, **synthesized,
            **_fixed(strategies.make_uniform_network(world), nbytes, counts)}


def _modelled_ms(net, nbytes: int, own: dict) -> dict:
    """Modelled time on net of the fixed shapes (rebuilt there) and of `own` (built on net)."""
    built = {**own, **_fixed(net, nbytes, _chunk_counts(own[SYNTH]))}
    return {name: 1e3 * evaluate(net, strategy).time for name, strategy in built.items()}


def _grouped(servers) -> bool:
    """True when some server holds several ranks (a shared NIC to model)."""
    return len(set(servers)) < len(servers)


def _synthesize(synth, world: int, nbytes: int, profile_kwargs,
                servers=None, pairwise: bool = False) -> tuple[dict, dict]:
    """Collective: profile on every rank, synthesize at rank 0, broadcast its pick."""
    started = time.perf_counter()
    net = profile_links(**profile_kwargs)
    info = {"profile_s": time.perf_counter() - started}
    payload = [None]
    if dist.get_rank() == 0:
        off = [(i, j) for i in range(world) for j in range(world) if i != j]
        info["profiled_mbit"] = {f"{i}->{j}": 8 / float(net.beta[i, j]) / 1e6 for i, j in off}
        info["profiled_alpha_us"] = {f"{i}->{j}": float(net.alpha[i, j]) * 1e6 for i, j in off}
        info["model"] = "pairwise profile"
        if not pairwise:
            # every host's link is its NIC: shared by all of its flows (and its ranks')
            net = shared_nic_network(net, servers or list(range(world)))
            info["model"] = "shared NIC per server"
        started = time.perf_counter()
        synth.update_profile(net)
        info["synthesis_s"] = time.perf_counter() - started
        info["method"] = synth.current.method
        info["modelled_ms"] = _modelled_ms(net, nbytes, {SYNTH: synth.current.strategy})
        picks = {SYNTH: on_gpus(synth.current.strategy, net)}
        info["strategy"] = _describe(picks[SYNTH])
        payload = [(picks, info)]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _describe(strategy) -> list[dict]:
    return [{"root": s.root, "chunks": s.n_chunks, "size_bytes": s.size,
             "parent": {src: p[1] for src, p in sorted(s.routes.items()) if len(p) > 1}}
            for s in strategy.subs]


def _time_phase(executors: dict, picks: dict, world: int, numel: int, reps: int) -> dict:
    """Per candidate: this rank's seconds per rep, and whether every result was exact."""
    rank = dist.get_rank()
    _install(executors, picks)               # re-synthesis: same executors, no restart
    cands = _candidates(world, numel * 4, picks)
    runners = {name: executors.get(name) or (TreeExecutor(s) if s is not None else None)
               for name, s in cands.items()}
    expected, local = _expected(world, numel), _local(rank, numel)
    times = {name: [] for name in cands}
    exact = {name: True for name in cands}
    for _ in range(reps):                    # interleaved: drift in load hits every candidate
        for name, runner in runners.items():
            dist.barrier()
            started = time.perf_counter()
            if runner is None:
                got = local.clone()
                dist.all_reduce(got)
            else:
                got = runner.run(local)
            times[name].append(time.perf_counter() - started)
            exact[name] = exact[name] and bool(torch.equal(got.double(), expected))
    return {"times_s": times, "exact": exact}


def executor_hook(executor: TreeExecutor, bucket):
    """DDP comm hook: the bucket's mean through the executor's strategy (the executor runs
    the collective to the end, so the Future is complete when it is returned)."""
    mean = executor.run(bucket.buffer()) / executor.world
    fut = torch.futures.Future()
    fut.set_result(mean)
    return fut


def _optimizer(model):
    """The optimizer of every training here, and of the state a restart carries."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(executor, steps: int, hidden: int, seed: int = 0):
    """`steps` training steps of the main job's model from fixed weights: each step's
    seconds on this rank, and the final parameters (flat). executor=None: DDP's allreduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = DDP(make_model(hidden))
    if executor is not None:
        model.register_comm_hook(executor, executor_hook)
    opt = _optimizer(model)
    (xtr, ytr), _ = load_digits_split(seed)
    xs, ys = torch.from_numpy(xtr[rank::world]), torch.from_numpy(ytr[rank::world])
    order = np.random.default_rng(seed + rank).permutation(len(xs))
    seconds = []
    for step in range(steps):
        idx = torch.from_numpy(order[(step * 32) % (len(xs) - 32):][:32])
        dist.barrier()
        started = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xs[idx]), ys[idx]).backward()
        opt.step()
        seconds.append(time.perf_counter() - started)
    return seconds, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_phase(executor: TreeExecutor, steps: int, hidden: int) -> dict:
    """The main job's model trained with gloo's allreduce and with the synthesized strategy."""
    gloo_s, gloo_params = _train(None, steps, hidden)
    synth_s, synth_params = _train(executor, steps, hidden)
    return {"step_s": {GLOO: gloo_s, SYNTH: synth_s},
            "max_param_diff": float((gloo_params - synth_params).abs().max())}


def _wait_for_parent(sync: Path, phase: int) -> None:
    """Rank 0 tells the parent this phase is done and waits until the links are re-shaped."""
    (sync / f"done{phase}").touch()
    while not (sync / f"go{phase}").exists():
        time.sleep(0.05)


def worker(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    numel = int(args.mb * (1 << 20)) // 4
    profile_kwargs = _profile_kwargs(args)
    synth = _synthesizer(args, numel * 4)
    executors = {}
    phases = []
    for phase in range(2):
        if phase and args.rank == 0:
            _wait_for_parent(Path(args.sync), phase)
        dist.barrier()
        started = time.perf_counter()
        picks, info = _synthesize(synth, args.world, numel * 4, profile_kwargs,
                                  args.servers, args.pairwise_model)
        _install(executors, picks)
        dist.barrier()
        # AdapCC's reconstruction, in place: profile, solve, set up the new strategy's
        # contexts, every rank ready (Fig. 19c's "profile + solve + context setup")
        info["reconstruction_s"] = time.perf_counter() - started
        phases.append(dict(info, **_time_phase(executors, picks, args.world, numel,
                                               args.reps)))
        if args.train_steps:
            phases[-1]["train"] = _train_phase(executors[SYNTH], args.train_steps,
                                               args.hidden)
    gathered = [None] * args.world if args.rank == 0 else None
    dist.gather_object(phases, gathered, dst=0)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    if args.restart:
        _checkpoint_for_restart(args)
    dist.destroy_process_group()


def _profile_kwargs(args) -> dict:
    return dict(sizes=tuple(int(1024 * kb) for kb in args.profile_kb), counts=(1, 4),
                repeats=args.profile_repeats)


def _synthesizer(args, nbytes: int) -> Synthesizer:
    # every phase re-synthesizes; a profile within 5 % is noise, so modelled times within 5 %
    # are a tie, which the fewest flows into one node breaks (Synthesizer's docstring)
    grouped = _grouped(args.servers) and not args.pairwise_model
    servers = [[r for r in range(args.world) if args.servers[r] == s]
               for s in sorted(set(args.servers))] if grouped else None
    return Synthesizer("allreduce", nbytes, m=args.m, time_limit=args.milp_seconds,
                       change_tolerance=0.0, tie_tolerance=0.05, servers=servers)


def _install(executors: dict, picks: dict) -> None:
    """The picks' executors: re-synthesis switches the strategy of the same executor."""
    for name, pick in picks.items():
        if name in executors:
            executors[name].set_strategy(pick)
        else:
            executors[name] = TreeExecutor(pick)


# --------------------------------------------------------------------------- the restart baseline

def _training_state(hidden: int):
    """The main job's model and its optimizer after one step (so that the optimizer has its
    momentum buffers): what a restart must carry across."""
    torch.manual_seed(0)
    model = make_model(hidden)
    opt = _optimizer(model)
    (xtr, ytr), _ = load_digits_split(0)
    F.cross_entropy(model(torch.from_numpy(xtr[:32])), torch.from_numpy(ytr[:32])).backward()
    opt.step()
    return model, opt


def _checkpoint_for_restart(args) -> None:
    """What the paper's baseline does instead of reconstructing: the job decides to restart,
    rank 0 writes a checkpoint, every rank leaves; the parent relaunches (resumed_worker)."""
    model, opt = _training_state(args.hidden)
    dist.barrier()
    if args.rank == 0:
        decided = time.time()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   Path(args.sync) / "checkpoint.pt")
        (Path(args.sync) / "restart.json").write_text(json.dumps({
            "decided": decided, "checkpoint_s": time.time() - decided,
            "param_sum": float(sum(p.double().sum() for p in model.parameters()))}))
    dist.barrier()


def resumed_worker(args) -> None:
    """A relaunched rank: joins a new process group on the same links, loads the checkpoint,
    then (as a job that plans its collectives afresh must) profiles and synthesizes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    joined = time.time()
    state = torch.load(Path(args.sync) / "checkpoint.pt", weights_only=True)
    model = make_model(args.hidden)
    model.load_state_dict(state["model"])
    opt = _optimizer(model)
    opt.load_state_dict(state["optimizer"])
    DDP(model)                               # DDP's own set-up: it broadcasts rank 0's weights
    dist.barrier()
    ready = time.time()
    numel = int(args.mb * (1 << 20)) // 4
    profile_kwargs = _profile_kwargs(args)
    _install({}, _synthesize(_synthesizer(args, numel * 4), args.world, numel * 4,
                             profile_kwargs, args.servers, args.pairwise_model)[0])
    dist.barrier()
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({
            "joined": joined, "ready": ready, "planned": time.time(),
            "param_sum": float(sum(p.double().sum() for p in model.parameters())),
            "momentum_buffers": len(opt.state_dict()["state"])}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent

def _summarise(per_rank: list[list[dict]], phase: int) -> dict:
    """The slowest rank per rep, median over reps; exact only if exact on every rank."""
    first = per_rank[0][phase]
    rows = {}
    for name in first["times_s"]:
        slowest = np.max([r[phase]["times_s"][name] for r in per_rank], axis=0)
        rows[name] = {"ms": 1e3 * float(np.median(slowest)),
                      "reps_ms": [1e3 * float(t) for t in slowest],
                      "exact": all(r[phase]["exact"][name] for r in per_rank),
                      "modelled_ms": first["modelled_ms"].get(name)}
    gloo = rows[GLOO]["ms"]
    for row in rows.values():
        row["x_gloo"] = gloo / row["ms"]
    fixed = [name for name in rows if name not in (GLOO, SYNTH)]
    best = min(fixed, key=lambda name: rows[name]["ms"])
    info = {k: v for k, v in first.items()
            if k not in ("times_s", "exact", "modelled_ms", "train")}
    summary = dict(info, rows=rows, best_fixed=best,
                   synthesized_over_best_fixed=rows[SYNTH]["ms"] / rows[best]["ms"])
    if "train" in first:
        summary["train"] = _summarise_training([r[phase]["train"] for r in per_rank])
    return summary


def _summarise_training(per_rank: list[dict]) -> dict:
    """Median over steps (the first, which sets up, left out) of the slowest rank's step."""
    ms = {}
    for name in per_rank[0]["step_s"]:
        slowest = np.max([r["step_s"][name][1:] for r in per_rank], axis=0)
        ms[name] = 1e3 * float(np.median(slowest))
    return {"step_ms": ms, "steps_per_s": {k: 1e3 / v for k, v in ms.items()},
            "synthesized_speedup": ms[GLOO] / ms[SYNTH],
            "max_param_diff": max(r["max_param_diff"] for r in per_rank)}


def _spawn(tb, args, sync: Path, out: Path, resume: bool = False) -> list[subprocess.Popen]:
    """The ranks, one process each in its server's namespace: the study's workers, or
    (resume) the relaunched ranks of the restart baseline, on a port of their own."""
    from host.netlab.aggregators import python_env
    env = python_env(GLOO_SOCKET_IFNAME="eth0")
    procs = []
    role = ["--resume"] if resume else ["--worker"] + (["--restart"] if args.restart else [])
    port = GLOO_PORT + 1 if resume else GLOO_PORT
    for rank in range(args.world):
        argv = [sys.executable, "-m", "host.experiments.adapcc.links_study", *role,
                "--rank", str(rank), "--world", str(args.world),
                "--servers", ",".join(map(str, args.servers)),
                *(["--pairwise-model"] if args.pairwise_model else []),
                "--master", f"{tb.host_ip(0)}:{port}", "--sync", str(sync),
                "--out", str(out), "--mb", str(args.mb), "--reps", str(args.reps),
                "--m", str(args.m), "--milp-seconds", str(args.milp_seconds),
                "--profile-repeats", str(args.profile_repeats), "--timeout", str(args.timeout),
                "--train-steps", str(args.train_steps), "--hidden", str(args.hidden),
                "--profile-kb", ",".join(f"{kb:g}" for kb in args.profile_kb)]
        procs.append(tb.popen(args.servers[rank], argv, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True))
    return procs


BACKGROUND_BYTES = 1400        # background datagrams: about a full frame each


def _drive(tb, procs, sync: Path, change, deadline: float, background=None) -> None:
    """When rank 0 reports phase 0 done: re-shape the changed host's link (change: (host,
    mbit) or None) and start the background load (background: (src, dst, mbit) or None:
    paced UDP from host src to host dst, which loads src's link out and dst's link in);
    then wait for all. The load runs until the workers end."""
    load = None
    try:
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                raise TimeoutError("the workers did not finish in time")
            if (sync / "done1").exists() and not (sync / "go1").exists():
                if change is not None:
                    tb.set_rate(*change)
                if background is not None:
                    src, dst, mbit = background
                    load = mp.get_context("spawn").Process(
                        target=send_paced, daemon=True,
                        args=(tb.hosts[src].ns, tb.host_ip(dst),
                              mbit_to_pps(mbit, BACKGROUND_BYTES), BACKGROUND_BYTES))
                    load.start()
                (sync / "go1").touch()
            time.sleep(0.05)
    finally:
        if load is not None:
            load.kill()
            load.join(5)


def _check_servers(servers, rates, delays, change, background=None) -> list[int]:
    """servers (None: one rank per host) against one rate and delay per server, and the
    hosts that change and background name; refused at set-up with what to change."""
    servers = server_layout(range(len(rates)) if servers is None else servers)
    if servers[-1] + 1 != len(rates) or len(delays) != len(rates):
        raise ValueError(f"{servers[-1] + 1} servers need one rate and one delay each; got "
                         f"{len(rates)} rates and {len(delays)} delays")
    if change is not None and not 0 <= change[0] < len(rates):
        raise ValueError(f"change: server {change[0]} does not exist (0..{len(rates) - 1})")
    if background is not None:
        src, dst, mbit = background
        if not (0 <= src < len(rates) and 0 <= dst < len(rates)) or src == dst or mbit <= 0:
            raise ValueError(f"background {background}: give two different hosts of "
                             f"0..{len(rates) - 1} and a positive rate (SRC:DST:MBIT)")
    return servers


def _finish(procs, what: str, out: Path) -> None:
    """Stop what still runs; the processes failed unless every one exited 0 and `out`,
    their result, was written."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs) or not out.exists():
        raise RuntimeError(f"links_study {what} failed:\n" + "\n".join(
            (log or "")[-2000:] for log in logs))


def _restart_baseline(tb, args, sync: Path, deadline: float) -> dict:
    """Relaunch the ranks from the checkpoint the study's workers left (restart.json says
    when they decided to restart) and time it; the study's workers have exited."""
    decided = json.loads((sync / "restart.json").read_text())
    out = sync / "resumed.json"
    procs = _spawn(tb, args, sync, out, resume=True)
    try:
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                raise TimeoutError("the relaunched ranks did not finish in time")
            time.sleep(0.05)
    finally:
        _finish(procs, "relaunched ranks", out)
    resumed = json.loads(out.read_text())
    return {"checkpoint_s": decided["checkpoint_s"],
            # terminate + checkpoint + relaunch (processes, imports, process group, load)
            "relaunch_s": resumed["ready"] - decided["decided"],
            "process_group_s": resumed["joined"] - decided["decided"],
            "relaunch_and_plan_s": resumed["planned"] - decided["decided"],
            "restored": abs(resumed["param_sum"] - decided["param_sum"]) < 1e-9
            and resumed["momentum_buffers"] > 0}


def run_study(rates=(200, 200, 100, 50), delays=(0, 1, 2, 4), mb: float = 4, reps: int = 3,
              change=(0, 30), m: int = 1, milp_seconds: float = 10.0, profile_repeats: int = 1,
              timeout: float = 600.0, profile_kb=PROFILE_KB, train_steps: int = 0,
              hidden: int = 256, servers=None, pairwise_model: bool = False,
              background=None, restart: bool = False) -> dict:
    """Both phases on one topology; returns {"phases": [summary, summary], ...}. rates,
    delays and change are per server (per rank without servers); pairwise_model: plan on the
    pairwise profile even where servers share a NIC (the model without NIC nodes);
    background: (src, dst, mbit) of paced UDP load from phase 1 on (None: none); change:
    None for no re-shape; restart: after the phases, also time the paper's baseline for a
    changed strategy, checkpoint, terminate and relaunch on the same links ("restart")."""
    from host.netlab.links import netem_available
    from host.netlab.topology import Topology
    servers = _check_servers(servers, rates, delays, change, background)
    netem = netem_available()
    applied = list(delays) if netem else [0.0] * len(rates)   # tbf cannot delay
    args = argparse.Namespace(world=len(servers), servers=servers,
                              pairwise_model=pairwise_model, mb=mb, reps=reps, m=m,
                              milp_seconds=milp_seconds, profile_repeats=profile_repeats,
                              timeout=int(timeout), profile_kb=list(profile_kb),
                              train_steps=train_steps, hidden=hidden, restart=restart)
    load_before = os.getloadavg()
    started = time.time()
    with Topology(len(rates), list(rates), delay_ms=applied) as tb, \
            tempfile.TemporaryDirectory() as tmp:
        sync, out = Path(tmp), Path(tmp) / "out.json"
        procs = _spawn(tb, args, sync, out)
        try:
            _drive(tb, procs, sync, change, started + timeout, background)
        finally:
            _finish(procs, "workers", out)
        per_rank = json.loads(out.read_text())
        relaunch = _restart_baseline(tb, args, sync, started + timeout) if restart else None
        qdisc = tb.qdisc
    rates_after = list(rates)
    if change is not None:
        rates_after[change[0]] = change[1]
    return {"rates_mbit": [list(rates), rates_after], "servers": servers,
            "pairwise_model": pairwise_model, "delays_ms": applied,
            "delays_requested_ms": list(delays), "netem": netem, "qdisc": qdisc,
            "tensor_mb": mb, "reps": reps, "m": m,
            "change": None if change is None else list(change),
            "background": None if background is None else list(background),
            "profile_kb": list(profile_kb), "train_steps": train_steps, "hidden": hidden,
            "load_average_before": list(load_before), "load_average_after":
            list(os.getloadavg()), "cpus": os.cpu_count(), "wall_s": time.time() - started,
            "phases": [_summarise(per_rank, p) for p in range(2)],
            "restart": relaunch}


def print_table(res: dict) -> None:
    for p, phase in enumerate(res["phases"]):
        rates = "/".join(f"{r:g}" for r in res["rates_mbit"][p])
        links = "links" if not _grouped(res["servers"]) else \
            f"servers {','.join(map(str, res['servers']))} (rank -> server), NICs"
        print(f"\nphase {p}: {links} {rates} Mbit/s, delays "
              f"{'/'.join(f'{d:g}' for d in res['delays_ms'])} ms, {res['tensor_mb']:g} MB "
              f"float32, median of {res['reps']}; profile {phase['profile_s']:.1f} s, "
              f"synthesis {phase['synthesis_s']:.1f} s, reconstruction "
              f"{phase['reconstruction_s']:.1f} s")
        if p and res.get("background"):
            src, dst, mbit = res["background"]
            print(f"background load: {mbit:g} Mbit/s of UDP from host {src} to host {dst}")
        print(f"{'strategy':<26}{'ms':>8}{'x gloo':>8}{'model ms':>10}  exact")
        for name, row in phase["rows"].items():
            model = f"{row['modelled_ms']:.0f}" if row["modelled_ms"] is not None else "-"
            print(f"{name:<26}{row['ms']:>8.0f}{row['x_gloo']:>8.2f}{model:>10}  {row['exact']}")
        print(f"synthesized by {phase['method']} on the {phase['model']}: trees "
              f"{phase['strategy']}; its time / the "
              f"best fixed ({phase['best_fixed']}): {phase['synthesized_over_best_fixed']:.2f}")
        if "train" in phase:
            t = phase["train"]
            print(f"training the main job's model (hidden {res['hidden']}, "
                  f"{res['train_steps']} steps): " + ", ".join(
                      f"{name} {ms:.0f} ms/step" for name, ms in t["step_ms"].items())
                  + f"; synthesized {t['synthesized_speedup']:.2f}x gloo; largest parameter "
                  f"difference {t['max_param_diff']:.1e}")
    if res.get("restart"):
        r, rebuilt = res["restart"], res["phases"][1]["reconstruction_s"]
        print(f"\nchanging the strategy, phase 1: reconstruction in place (profile, solve, "
              f"set up) {rebuilt:.2f} s; checkpoint, terminate and relaunch {r['relaunch_s']:.2f} s "
              f"(of which the checkpoint {r['checkpoint_s']:.2f} s; process group up after "
              f"{r['process_group_s']:.2f} s), {r['relaunch_and_plan_s']:.2f} s with its own "
              f"profile and solve; reconstruction saves {100 * (1 - rebuilt / r['relaunch_s']):.0f} %"
              f" of the relaunch; state restored: {r['restored']}")
    print(f"\nload average before {res['load_average_before']}, after "
          f"{res['load_average_after']} ({res['cpus']} CPUs); qdisc {res['qdisc']}"
          + ("" if res["netem"] else " (no netem in this kernel: latencies not shaped)"))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main():
    ap = argparse.ArgumentParser(prog="python -m host.experiments.adapcc.links_study",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rates", type=_floats, default=[200, 200, 100, 50],
                    help="Mbit/s per host link (per server with --servers)")
    ap.add_argument("--servers", type=lambda t: [int(v) for v in t.split(",")], default=None,
                    help="server of each rank, e.g. 0,0,1,1: the ranks of a server share its "
                         "namespace and its one link (default: one rank per host)")
    ap.add_argument("--pairwise-model", action="store_true",
                    help="plan on the pairwise profile, as if no host's link were shared "
                         "by its flows (the model before NIC nodes; for comparison)")
    ap.add_argument("--delays", type=_floats, default=[0, 1, 2, 4],
                    help="ms per host link (needs netem; ignored where the kernel lacks it)")
    ap.add_argument("--mb", type=float, default=4, help="tensor size, MiB of float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--change", default="0:30",
                    help="host:mbit re-shaped between phases ('none': no re-shape)")
    ap.add_argument("--background", default=None,
                    help="src:dst:mbit of paced UDP load from host src to host dst during "
                         "phase 1 (the links' other traffic changes during the run)")
    ap.add_argument("--m", type=int, default=1, help="sub-collectives of the synthesizer")
    ap.add_argument("--milp-seconds", type=float, default=10.0)
    ap.add_argument("--profile-repeats", type=int, default=1)
    ap.add_argument("--profile-kb", type=_floats, default=list(PROFILE_KB),
                    help="profile_links piece sizes, KiB")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--train-steps", type=int, default=20,
                    help="steps of the main job's model per phase and collective (0: none)")
    ap.add_argument("--hidden", type=int, default=256, help="the model's hidden width")
    ap.add_argument("--restart", action="store_true",
                    help="after the phases, also time a checkpoint, terminate and relaunch "
                         "of the ranks on the same links (the paper's baseline for AdapCC's "
                         "in-place reconstruction, Fig. 19c)")
    # worker modes (started by the parent inside a host namespace)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--world"):
        ap.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--master", "--sync", "--out"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.resume:
        return resumed_worker(args)
    if args.worker:
        return worker(args)
    change = None
    if args.change.lower() != "none":
        host, mbit = args.change.split(":")
        change = (int(host), float(mbit))
    background = None
    if args.background:
        src, dst, mbit = args.background.split(":")
        background = (int(src), int(dst), float(mbit))
    if args.servers is not None and args.delays == ap.get_default("delays"):
        args.delays = [0.0] * len(args.rates)
    try:
        res = run_study(args.rates, args.delays, args.mb, args.reps, change,
                        args.m, args.milp_seconds, args.profile_repeats, args.timeout,
                        args.profile_kb, args.train_steps, args.hidden, args.servers,
                        args.pairwise_model, background, args.restart)
    except ValueError as exc:
        ap.error(str(exc))
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
