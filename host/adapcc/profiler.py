"""Alpha-beta link profiler over torch.distributed point-to-point (AdapCC Sec. IV-B).

Per ordered pair (src, dst): send a piece of s bytes n times separately (cost n(alpha + beta s))
and one message of n*s bytes (cost alpha + beta n s), for several (n, s); alpha and beta come from
a least-squares fit of time = messages * alpha + bytes * beta.  Each message is acknowledged by
one byte, so alpha is the per-message cost of a completed (acknowledged) transfer.

Schedule: N-1 collision-free rounds; in round i rank r probes r -> (r+i) % N, with a barrier
before each round (one egress and one ingress probe flow per rank per round).  Training is
blocked while profiling runs; results are gathered at rank 0 as a ``Network``.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .costmodel import Network, make_cluster

DEFAULT_SIZES = (16 * 1024, 128 * 1024, 512 * 1024)
DEFAULT_COUNTS = (1, 4)


def round_schedule(n: int) -> list[list[tuple[int, int]]]:
    """N-1 rounds; round i pairs every rank r with (r + i) % n."""
    return [[(r, (r + i) % n) for r in range(n)] for i in range(1, n)]


def fit_alpha_beta(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """Least squares over (messages, total_bytes, seconds); both parameters clipped at >= 0."""
    a = np.array([[m, b] for m, b, _ in samples], dtype=float)
    y = np.array([t for _, _, t in samples], dtype=float)
    if len(samples) < 2 or np.linalg.matrix_rank(a) < 2:
        raise ValueError("need samples with at least two different (messages, bytes) ratios")
    (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if beta <= 0:
        # time did not grow with bytes (noise); fall back to bytes-only fit
        beta = float(max(np.dot(a[:, 1], y) / np.dot(a[:, 1], a[:, 1]), 1e-15))
        alpha = 0.0
    return max(float(alpha), 0.0), float(beta)


def _timed_sends(dst: int, pieces: int, piece_bytes: int, tag: int, group) -> float:
    payload = torch.zeros(max(1, piece_bytes), dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    start = time.perf_counter()
    for _ in range(pieces):
        dist.send(payload, dst=dst, group=group, tag=tag)
        dist.recv(ack, src=dst, group=group, tag=tag + 1)
    return time.perf_counter() - start


def _serve_receives(src: int, pieces: int, piece_bytes: int, tag: int, group) -> None:
    buf = torch.empty(max(1, piece_bytes), dtype=torch.uint8)
    ack = torch.ones(1, dtype=torch.uint8)
    for _ in range(pieces):
        dist.recv(buf, src=src, group=group, tag=tag)
        dist.send(ack, dst=src, group=group, tag=tag + 1)


def _plan(sizes, counts, repeats):
    """(pieces, piece_bytes) per measurement: n sends of s, then one send of n*s."""
    plan = []
    for s in sizes:
        for n in counts:
            for _ in range(repeats):
                plan.append((n, s))
                if n > 1:
                    plan.append((1, n * s))
    return plan


def profile_links(group=None, sizes=DEFAULT_SIZES, counts=DEFAULT_COUNTS, repeats=2,
                  warmup: bool = True) -> Network | None:
    """Collective call on every rank; returns the profiled Network on rank 0, None elsewhere."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    plan = _plan(sizes, counts, repeats)
    results = {}
    for rnd, pairs in enumerate(round_schedule(world)):
        dist.barrier(group)
        dst = pairs[rank][1]
        src = (rank - (rnd + 1)) % world
        tag = 1000 + 10 * rnd
        server = threading.Thread(target=lambda: [
            _serve_receives(src, n, s, tag, group) for n, s in ([(1, 64)] if warmup else []) + plan])
        server.start()
        if warmup:
            _timed_sends(dst, 1, 64, tag, group)
        samples = [(n, n * s, _timed_sends(dst, n, s, tag, group)) for n, s in plan]
        server.join()
        results[dst] = fit_alpha_beta(samples)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0, group=group)
    if rank != 0:
        return None
    alpha = np.full((world, world), np.inf)
    beta = np.full((world, world), np.inf)
    for src, per_dst in enumerate(gathered):
        for dst, (a, b) in per_dst.items():
            alpha[src, dst], beta[src, dst] = a, b
    return Network([f"rank{r}" for r in range(world)], ["gpu"] * world, alpha, beta)


def server_layout(servers: Sequence[int]) -> list[int]:
    """servers[r], the server of rank r, checked for shared_nic_network: numbered 0, 1, ... in
    rank order with the ranks of a server next to each other (make_cluster numbers GPUs
    server by server, so node r stays rank r; rank-ordered chains and trees then cross each
    NIC at most once each way, which the cost model's routes need), and at least two
    servers (else there is no NIC to model)."""
    servers = [int(v) for v in servers]
    if not servers or servers[0] != 0 or any(b - a not in (0, 1)
                                             for a, b in zip(servers, servers[1:])):
        raise ValueError(f"servers {servers}: number the servers 0, 1, ... in rank order, the "
                         "ranks of one server next to each other (e.g. 0,0,1,1)")
    if servers[-1] == 0:
        raise ValueError("servers: every rank is on one server; there is no NIC to model")
    return servers


def shared_nic_network(net: Network, servers: Sequence[int]) -> Network:
    """A pairwise profile (profile_links) read as servers whose GPUs share one NIC each: the
    paper's logical graph (make_cluster(nic_nodes=True)), so that the synthesizer sees that
    flows from two GPUs of one server cross the same NIC, which a pairwise profile cannot
    show (each pair was timed alone).

    servers[r] is the server of rank r (server_layout says how they are numbered); node r of
    the result is rank r. A server's NIC rate is the fastest pair it took part in (a pair
    runs at the slower of its two NICs, so only the fastest server's NIC is underestimated,
    as the second fastest), taken for each direction apart (the NIC's send side from the
    pairs it sends in, its receive side from those it receives in, so load on one direction
    of a link shows on that side only); inside a server, the median of its pairs; the
    wire's latency, the median over pairs between servers."""
    servers = np.asarray(server_layout(servers))
    n = len(servers)
    if net.n != n or net.gpus() != list(range(n)):
        raise ValueError(f"servers: {n} entries for a profile of {net.n} nodes; give one "
                         "server per rank of a GPU-only profile (profile_links)")
    n_servers = int(servers[-1]) + 1
    gbps = 8.0 / (net.beta * 1e9)
    same = np.equal.outer(servers, servers) & ~np.eye(n, dtype=bool)
    cross = ~np.equal.outer(servers, servers)
    send = [float(gbps[servers == s][:, servers != s].max()) for s in range(n_servers)]
    receive = [float(gbps[servers != s][:, servers == s].max()) for s in range(n_servers)]
    if same.any():
        inside, inside_alpha = float(np.median(gbps[same])), float(np.median(net.alpha[same]))
    else:
        # one GPU per server: the GPU-NIC hop is never what limits (PCIe, or the host)
        inside, inside_alpha = 100.0 * max(send + receive), 0.0
    counts = [int((servers == s).sum()) for s in range(n_servers)]
    return make_cluster(counts, send, nvlink_gbps=inside, nvlink_alpha=inside_alpha,
                        net_alpha=float(np.median(net.alpha[cross])), nic_nodes=True,
                        nic_receive_gbps=receive)


class PeriodicProfiler:
    """Profiles every ``period`` iterations (default 500, as in the paper) and feeds rank 0's
    synthesizer; every rank gets the (possibly new) strategy broadcast from rank 0."""

    def __init__(self, period: int = 500, group=None, synthesizer=None, **profile_kwargs):
        if period < 1:
            raise ValueError(f"profiling period must be >= 1 iteration, got {period}")
        self.period, self.group, self.synthesizer = period, group, synthesizer
        self.profile_kwargs = profile_kwargs
        self.last_network: Network | None = None

    def step(self, iteration: int):
        """Call once per iteration; returns the strategy to use from now on (or None)."""
        if iteration % self.period != 0:
            return None
        net = profile_links(self.group, **self.profile_kwargs)
        payload = [None]
        if dist.get_rank(self.group) == 0:
            self.last_network = net
            if self.synthesizer is not None:
                self.synthesizer.update_profile(net)
                payload = [self.synthesizer.current.strategy]
        dist.broadcast_object_list(payload, src=0, group=self.group)
        return payload[0]
