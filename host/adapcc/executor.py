"""Executor: run a synthesized strategy over torch.distributed point-to-point (gloo on loopback).

Every rank holds the whole strategy.  Sub-collective m owns a contiguous partition of the flat
tensor (sizes proportional to S_m, any remainder handled), split into chunks; chunks are pipelined
through the tree with non-blocking sends.  All ranks walk the steps in the same global order
(chunk, stage, sub-collective) and each step only waits on the same step of its tree neighbours,
so no rank can block on a step another rank has not reached: no deadlock for any strategy.

Relays (phase 1): ``active`` names the ranks that add their tensor.  The behaviour tuple
<isActive, hasRecv, hasKernel, hasSend> (AdapCC Fig. 7) decides per rank and sub-collective who
receives, adds and sends; subtrees with no active rank send nothing and nobody waits for them.
A relay whose own tensor becomes ready during phase 1 (``join``) adds it to the chunks it
still carries from then on, as the paper's late relays join "at the chunk offset".  Phase 2
(``allreduce_two_phase``) then runs only the chunks some late rank's data missed, each late rank
adding only its missed chunks, and adds them in, so the result equals the full sum.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .costmodel import Strategy


@dataclass(frozen=True)
class Behaviour:
    is_active: bool
    has_recv: bool
    has_kernel: bool
    has_send: bool


def tree_links(strategy: Strategy, m: int) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Parent and children maps of sub-collective m, in the Reduce direction (toward the root)."""
    sub = strategy.subs[m]
    parent: dict[int, int] = {}
    for path in sub.routes.values():
        hops = path if strategy.primitive != "broadcast" else list(reversed(path))
        for child, par in zip(hops, hops[1:]):
            if parent.setdefault(child, par) != par:
                raise ValueError(f"sub-collective {m} is not a tree: node {child} has two parents")
    children: dict[int, list[int]] = {}
    for child, par in sorted(parent.items()):
        children.setdefault(par, []).append(child)
    return parent, children


def behaviours(strategy: Strategy, m: int, active: set[int], n_ranks: int) -> dict[int, Behaviour]:
    """Fig. 7 rules for every rank of sub-collective m (Reduce direction)."""
    parent, children = tree_links(strategy, m)
    live: dict[int, bool] = {}

    def subtree_live(node: int) -> bool:       # active data at or below node
        if node not in live:
            live[node] = node in active or any(subtree_live(c) for c in children.get(node, []))
        return live[node]

    aggregate = strategy.subs[m].aggregate
    out = {}
    for rank in range(n_ranks):
        live_preds = [c for c in children.get(rank, []) if subtree_live(c)]
        has_recv = bool(live_preds)
        is_active = rank in active
        kernel = (strategy.primitive != "broadcast" and has_recv and rank in aggregate
                  and not (not is_active and len(live_preds) == 1))
        has_send = (is_active or has_recv) and rank in parent
        out[rank] = Behaviour(is_active, has_recv, kernel, has_send)
    return out


def partitions(strategy: Strategy, numel: int) -> list[tuple[int, int, int]]:
    """(offset, length, chunk_elems) per sub-collective; lengths follow S_m and sum to numel."""
    total = sum(s.size for s in strategy.subs)
    bounds = [0]
    acc = 0.0
    for s in strategy.subs:
        acc += s.size
        bounds.append(round(numel * acc / total))
    out = []
    for m, s in enumerate(strategy.subs):
        length = bounds[m + 1] - bounds[m]
        chunk = max(1, math.ceil(length / s.n_chunks)) if length else 1
        out.append((bounds[m], length, chunk))
    return out


class TreeExecutor:
    """Runs Reduce, Broadcast or AllReduce of one strategy on this rank."""

    def __init__(self, strategy: Strategy, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        for sub in strategy.subs:
            nodes = {v for p in sub.routes.values() for v in p} | {sub.root}
            if max(nodes) >= self.world:
                raise ValueError(f"strategy uses node {max(nodes)} but the group has {self.world} "
                                 "ranks; in-network aggregator nodes run in dataplane/, not here")
        self.set_strategy(strategy)

    def set_strategy(self, strategy: Strategy) -> None:
        """Switch strategies between calls (re-synthesis) with no process restart."""
        self.strategy = strategy
        self.links = [tree_links(strategy, m) for m in range(len(strategy.subs))]

    def _tag(self, stage: int, m: int, c: int) -> int:
        return (stage * 64 + m) * 100000 + c

    def steps(self, numel: int) -> list[tuple[int, int, int, int]]:
        """(chunk c, sub-collective m, lo, hi) of a tensor of numel elements, in the order
        every rank walks them."""
        parts = partitions(self.strategy, numel)
        max_chunks = max(math.ceil(length / chunk) if length else 0 for _, length, chunk in parts)
        out = []
        for c in range(max_chunks):
            for m, (offset, length, chunk) in enumerate(parts):
                lo = offset + c * chunk
                hi = min(offset + length, lo + chunk)
                if lo < hi:
                    out.append((c, m, lo, hi))
        return out

    def run(self, tensor: torch.Tensor, active: set[int] | None = None, *,
            join=None, only=None) -> torch.Tensor:
        """Collective on a flat contiguous tensor; returns the result (input left untouched).

        Reduce: the root of each partition holds that partition's sum over ``active`` ranks.
        Broadcast: every rank gets the root's partitions.  AllReduce: every rank gets the sum.

        join (a relay's own): called with each chunk index before its Reduce steps; from the
        first True on, the relay's tensor is ready and it adds it to every chunk it carries
        (it forwards data up, or is the root).  ``self.carried`` is then the (c, m) steps that
        took this rank's data.  only: run just these (c, m) steps, the same set on every rank
        (phase 2); the result's other elements are unspecified.
        """
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("the executor works on flat contiguous tensors (use .view(-1))")
        active = set(range(self.world)) if active is None else set(active)
        prim = self.strategy.primitive
        result = tensor.clone()
        mine = self.rank in active
        if prim != "broadcast" and not mine:
            result.zero_()                              # relays forward without adding their data
        beh = [behaviours(self.strategy, m, active, self.world)
               for m in range(len(self.strategy.subs))]
        pending, joined, self.carried = [], False, set()
        for c, m, lo, hi in self.steps(tensor.numel()):
            if only is not None and (c, m) not in only:
                continue
            if prim in ("reduce", "allreduce"):
                joined = joined or (join is not None and not mine and join(c))
                if mine:
                    self.carried.add((c, m))
                elif joined and self._carries(beh[m], m):
                    result[lo:hi] = tensor[lo:hi]      # a late relay joins at this chunk
                    self.carried.add((c, m))
                self._reduce_step(result, lo, hi, m, c, beh[m], pending)
            if prim in ("broadcast", "allreduce"):
                self._broadcast_step(result, lo, hi, m, c, pending)
        for work, _ in pending:
            work.wait()
        return result

    def _carries(self, beh: dict[int, Behaviour], m: int) -> bool:
        """This rank's data can ride sub-collective m's Reduce without a new message: it
        sends to its parent anyway, or it is where the sum ends."""
        return beh[self.rank].has_send or self.rank == self.strategy.subs[m].root

    def _reduce_step(self, result, lo, hi, m, c, beh, pending):
        parent, children = self.links[m]
        me = beh[self.rank]
        if me.has_recv:
            live = [ch for ch in children.get(self.rank, []) if beh[ch].has_send]
            bufs = [torch.empty(hi - lo, dtype=result.dtype) for _ in live]
            works = [dist.irecv(b, src=ch, group=self.group, tag=self._tag(0, m, c))
                     for b, ch in zip(bufs, live)]
            for w, b in zip(works, bufs):
                w.wait()
                result[lo:hi] += b
        if me.has_send:
            buf = result[lo:hi].clone()
            pending.append((dist.isend(buf, dst=parent[self.rank], group=self.group,
                                       tag=self._tag(0, m, c)), buf))

    def _broadcast_step(self, result, lo, hi, m, c, pending):
        parent, children = self.links[m]
        if self.rank in parent:
            buf = torch.empty(hi - lo, dtype=result.dtype)
            dist.irecv(buf, src=parent[self.rank], group=self.group, tag=self._tag(1, m, c)).wait()
            result[lo:hi] = buf
        for ch in children.get(self.rank, []):
            buf = result[lo:hi].clone()
            pending.append((dist.isend(buf, dst=ch, group=self.group, tag=self._tag(1, m, c)), buf))


def allreduce_two_phase(executor: TreeExecutor, tensor: torch.Tensor, ready: set[int],
                        join=None) -> torch.Tensor:
    """Phase 1 among ``ready`` (others relay; join: this rank's, see ``TreeExecutor.run``),
    phase 2 adds what phase 1 missed of the late ranks' data: the full sum on every rank.

    The ranks agree on the missed steps with one small all_reduce (a flag per chunk step);
    phase 2 runs only those steps, each late rank adding only the steps its data missed.
    ``executor.phase2_steps`` is (steps run in phase 2, steps of the tensor)."""
    if executor.strategy.primitive != "allreduce":
        raise ValueError("two-phase aggregation needs an allreduce strategy")
    phase1 = executor.run(tensor, active=ready, join=join)
    late = set(range(executor.world)) - set(ready)
    steps = executor.steps(tensor.numel())
    executor.phase2_steps = (0, len(steps))
    if not late:
        return phase1
    missed = torch.tensor([executor.rank in late and (c, m) not in executor.carried
                           for c, m, _, _ in steps], dtype=torch.int32)
    needed = missed.clone()
    dist.all_reduce(needed, group=executor.group)
    only = {(c, m) for (c, m, _, _), n in zip(steps, needed.tolist()) if n}
    executor.phase2_steps = (len(only), len(steps))
    if not only:
        return phase1
    own = torch.zeros_like(tensor)
    for (c, m, lo, hi), mine in zip(steps, missed.tolist()):
        if mine:
            own[lo:hi] = tensor[lo:hi]
    phase2 = executor.run(own, active=late, only=only)
    for c, m, lo, hi in steps:
        if (c, m) in only:
            phase1[lo:hi] += phase2[lo:hi]
    return phase1
