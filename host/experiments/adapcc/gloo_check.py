"""End-to-end check of profiler + synthesizer + executor on real gloo processes (loopback).

``python -m host.experiments.adapcc.gloo_check [--world 4] [--json FILE]`` spawns the ranks, profiles the links,
synthesizes a strategy at rank 0, runs Reduce / Broadcast / AllReduce / two-phase AllReduce and a
mid-run strategy switch, and prints what each rank saw.  The tests call ``run_all``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataplane.ports import free_port
from host.adapcc import strategies
from host.adapcc.executor import TreeExecutor, allreduce_two_phase
from host.adapcc.profiler import PeriodicProfiler, profile_links
from host.adapcc.synthesizer import Synthesizer

NUMEL = 1001          # deliberately not divisible by chunk counts or M


def _local(rank: int, dtype) -> torch.Tensor:
    return (torch.arange(NUMEL, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


def _expected(ranks, dtype) -> torch.Tensor:
    return sum(_local(r, dtype) for r in ranks)


def _scenarios(rank: int, world: int) -> dict:
    out = {}
    started = time.perf_counter()
    net = profile_links(sizes=(8 * 1024, 64 * 1024), counts=(1, 4), repeats=1)
    out["profile_seconds"] = time.perf_counter() - started
    if rank == 0:
        off = [(i, j) for i in range(world) for j in range(world) if i != j]
        out["alpha_us"] = [float(net.alpha[e]) * 1e6 for e in off]
        out["gbps"] = [8 / float(net.beta[e]) / 1e9 for e in off]
        synth = Synthesizer("allreduce", NUMEL * 8, m=2, milp_max_nodes=0)   # par-trees: fast
        synth.update_profile(net)
        payload = [synth.current.strategy]
    else:
        payload = [None]
    dist.broadcast_object_list(payload, src=0)
    ex = TreeExecutor(payload[0])
    everyone = range(world)
    got = ex.run(_local(rank, torch.int64))
    out["allreduce_int_exact"] = bool(torch.equal(got, _expected(everyone, torch.int64)))
    got = ex.run(_local(rank, torch.float32))
    out["allreduce_float_close"] = bool(torch.allclose(got, _expected(everyone, torch.float32),
                                                       rtol=1e-5))
    # rooted reduce with 3 parallel trees on uneven partitions
    proto = strategies.make_uniform_network(world)
    red = strategies.par_trees(proto, "reduce", NUMEL * 8, m=3, n_chunks=5, root=2)
    got = TreeExecutor(red).run(_local(rank, torch.int64))
    if rank == 2:
        out["reduce_root_exact"] = bool(torch.equal(got, _expected(everyone, torch.int64)))
    bc = strategies.ring(proto, "broadcast", 1, NUMEL * 8, n_chunks=3, m=2)
    got = TreeExecutor(bc).run(_local(rank, torch.int64))
    out["broadcast_exact"] = bool(torch.equal(got, _local(1, torch.int64)))
    # phase 1 among the ready set (rank 2 is a relay), then phase 2 adds the late data
    ready = {r for r in everyone if r != 2}
    phase1 = ex.run(_local(rank, torch.int64), active=ready)
    out["phase1_ready_sum_exact"] = bool(torch.equal(phase1, _expected(ready, torch.int64)))
    full = allreduce_two_phase(ex, _local(rank, torch.int64), ready)
    out["two_phase_full_sum_exact"] = bool(torch.equal(full, _expected(everyone, torch.int64)))
    ones = ex.run(torch.ones(NUMEL, dtype=torch.int64), active=ready)   # Fig. 6: 4 workers of 1
    full_ones = allreduce_two_phase(ex, torch.ones(NUMEL, dtype=torch.int64), ready)
    out["fig6_phase1_3_full_4"] = bool(torch.all(ones == world - 1) and torch.all(full_ones == world))
    # a late relay joins phase 1 at a chunk offset; phase 2 runs only what it missed
    chain = TreeExecutor(strategies.ring(strategies.make_uniform_network(world), "allreduce", 0,
                                         NUMEL * 8, n_chunks=6, m=1))     # 3 -> 2 -> 1 -> 0
    late_inner = {r for r in everyone if r != 2}       # rank 2 forwards rank 3's data
    full = allreduce_two_phase(chain, _local(rank, torch.int64), late_inner,
                               join=(lambda c: c >= 2) if rank == 2 else None)
    out["late_relay_joins_exact"] = bool(torch.equal(full, _expected(everyone, torch.int64)))
    out["late_relay_phase2_steps"] = list(chain.phase2_steps)
    late_leaf = {r for r in everyone if r != world - 1}   # the chain's leaf carries nothing
    full = allreduce_two_phase(chain, _local(rank, torch.int64), late_leaf,
                               join=(lambda c: True) if rank == world - 1 else None)
    out["late_leaf_exact"] = bool(torch.equal(full, _expected(everyone, torch.int64)))
    out["late_leaf_phase2_steps"] = list(chain.phase2_steps)
    # switch strategy mid-run without restarting the process group
    ex.set_strategy(strategies.binary_tree(proto, "allreduce", 0, NUMEL * 8, n_chunks=7, m=4))
    got = ex.run(_local(rank, torch.float64))
    out["switched_strategy_close"] = bool(torch.allclose(got, _expected(everyone, torch.float64)))
    # periodic profiler: profiles at iteration 0, not at 1
    prof = PeriodicProfiler(period=2, synthesizer=Synthesizer("allreduce", NUMEL * 8, m=2,
                                                               milp_max_nodes=0),
                            sizes=(4096, 32768), counts=(1, 2), repeats=1)
    first, second = prof.step(0), prof.step(1)
    out["periodic_profile"] = first is not None and second is None
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        queue.put((rank, _scenarios(rank, world)))
    except Exception as exc:          # report instead of hanging the parent
        queue.put((rank, {"error": repr(exc)}))
        raise
    finally:
        dist.destroy_process_group()


def run_all(world: int = 4, timeout: float = 120.0) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + timeout
    try:
        while len(results) < world:
            rank, res = queue.get(timeout=max(1.0, deadline - time.time()))
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def main():
    ap = argparse.ArgumentParser(prog="python -m host.experiments.adapcc.gloo_check",
                                 description=__doc__)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--json", help="write the per-rank results here")
    args = ap.parse_args()
    results = run_all(args.world)
    for rank in sorted(results):
        print(rank, results[rank])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
