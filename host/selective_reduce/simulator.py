"""Discrete-event simulator of partial model synchronization (paper Sec. IV-A setup).

n workers behind one non-blocking switch; groups are disjoint, so a group's ring all-reduce takes
Eq. 2 with its slowest member's bandwidth (exact form by default).  Each worker alternates
compute -> ready -> sync.  A policy (all-reduce, partial reduce, selective reduce) decides which
ready workers sync.  Workers stop at ``duration`` seconds; only work finished by then counts.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from .grouping import ring_time
from .workload import TRACES, EmpiricalCdf, draw_bandwidths


@dataclass
class SimConfig:
    n: int = 40
    p: int | None = None            # default round(0.3 n)
    eta: float = 0.3
    theta: float = 1.0
    dt: float = 0.1                 # Delta t: not given by the paper
    model_mb: float = 500.0
    alpha: float = 1e-3
    lam: float = 0.05
    duration: float = 100.0
    trace: str = "transformer"
    compute_scale: float = 1.0      # multiplies every compute time (sensitivity to the trace)
    full_sync_every: int | None = None   # c; None = never (the paper does not give c)
    warm: bool = True
    bw_error: float = 0.0
    bw_error_mode: str = "static"   # 'static': x drawn once per worker; 'dynamic': per query
    exact_ring: bool = True
    literal: bool = False           # printed BPAWR booleans (deadlocks)
    hazard: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.p is None:
            self.p = max(1, round(0.3 * self.n))
        if not 1 <= self.p <= self.n:
            raise ValueError(f"p must be in [1, n={self.n}], got {self.p}")
        if self.trace not in TRACES:
            raise ValueError(f"trace {self.trace!r} unknown; use one of {sorted(TRACES)}")
        if self.bw_error_mode not in ("static", "dynamic"):
            raise ValueError("bw_error_mode must be 'static' or 'dynamic'")
        if self.dt <= 0 or self.duration <= 0 or self.compute_scale <= 0:
            raise ValueError("dt, duration and compute_scale must be > 0")

    @property
    def v_gbit(self) -> float:
        return self.model_mb * 8.0 / 1000.0     # 1 MB = 8 Mb, 500 MB = 4 Gb


@dataclass
class SyncRecord:
    start: float
    end: float
    members: tuple
    with_wait: float       # end minus the mean ready time of the members


@dataclass
class SimResult:
    scheme: str
    syncs: list[SyncRecord] = field(default_factory=list)
    iterations: int = 0
    wasted_wait: float = 0.0       # the paper's definition, summed over workers (policies.py)
    idle_slot_wait: float = 0.0    # waiting groups x slots with no arrival anywhere, summed
    deadlocked: bool = False
    n: int = 0

    @property
    def total_syncs(self) -> int:
        return len(self.syncs)

    @property
    def avg_scale(self) -> float:
        return float(np.mean([len(s.members) for s in self.syncs])) if self.syncs else 0.0

    @property
    def avg_sync_time(self) -> float:
        return float(np.mean([s.end - s.start for s in self.syncs])) if self.syncs else float("nan")

    @property
    def avg_sync_time_with_wait(self) -> float:
        return float(np.mean([s.with_wait for s in self.syncs])) if self.syncs else float("nan")

    def summary(self) -> dict:
        return {"scheme": self.scheme, "avg_sync_time": self.avg_sync_time,
                "avg_sync_time_with_wait": self.avg_sync_time_with_wait,
                "avg_scale": self.avg_scale, "total_syncs": self.total_syncs,
                "total_iterations": self.iterations,
                "wasted_wait_per_worker": float(self.wasted_wait) / max(1, self.n),
                "idle_slot_wait_per_worker": float(self.idle_slot_wait) / max(1, self.n),
                "deadlocked": self.deadlocked}


class Simulation:
    """Event engine plus worker state; policies call ``launch`` and read the state."""

    def __init__(self, cfg: SimConfig, policy, observer=None):
        """``observer`` (optional) gets on_compute_done(w, t), on_sync_start(members, t) and
        on_sync_end(members, t): the convergence harness trains a model along the events."""
        self.cfg, self.policy, self.observer = cfg, policy, observer
        self.rng = np.random.default_rng(cfg.seed)
        self.bandwidth = draw_bandwidths(cfg.n, cfg.lam, self.rng)
        self.error_x = self.rng.uniform(-1, 1, cfg.n)
        base = TRACES[cfg.trace]
        self.compute = replace(base, median=base.median * cfg.compute_scale)
        self.cdf = self.compute.cdf if cfg.warm else EmpiricalCdf()
        self.now = 0.0
        self.queue: list[int] = []            # ready workers, arrival order
        self.ready_at: dict[int, float] = {}
        self.compute_start: dict[int, float] = {}
        self.arrivals = 0                     # ready events so far (for wasted-wait accounting)
        self.running_syncs = 0
        self.events: list = []
        self._seq = itertools.count()
        self.result = SimResult(policy.name, n=cfg.n)
        # separate stream for compute draws so the bandwidths match across policies per seed
        self.compute_rng = np.random.default_rng([cfg.seed, 1])

    def push(self, t: float, kind: str, data=None):
        heapq.heappush(self.events, (t, next(self._seq), kind, data))

    def start_compute(self, w: int):
        self.compute_start[w] = self.now
        self.push(self.now + float(self.compute.sample(self.compute_rng)), "ready", w)

    def estimated_bandwidth(self) -> np.ndarray:
        """What the controller sees: b + b*e*x (x per worker, or per query when dynamic)."""
        e = self.cfg.bw_error
        if e == 0:
            return self.bandwidth
        x = self.error_x if self.cfg.bw_error_mode == "static" else self.rng.uniform(-1, 1, self.cfg.n)
        return np.maximum(self.bandwidth * (1 + e * x), 1e-3)

    def in_training(self, est) -> list[tuple]:
        return [(w, float(est[w]), self.now - t0) for w, t0 in self.compute_start.items()]

    def launch(self, members) -> None:
        members = tuple(members)
        for w in members:
            self.queue.remove(w)
        duration = ring_time([self.bandwidth[w] for w in members], self.cfg.v_gbit,
                             self.cfg.alpha, self.cfg.exact_ring)
        end = self.now + duration
        with_wait = end - float(np.mean([self.ready_at[w] for w in members]))
        self.running_syncs += 1
        if self.observer is not None:
            self.observer.on_sync_start(members, self.now)
        self.push(end, "sync_done", SyncRecord(self.now, end, members, with_wait))

    def add_wasted_wait(self, worker_seconds: float) -> None:
        self.result.wasted_wait += worker_seconds

    def add_idle_slot_wait(self, worker_seconds: float) -> None:
        self.result.idle_slot_wait += worker_seconds

    def run(self) -> SimResult:
        for w in range(self.cfg.n):
            self.start_compute(w)
        if self.policy.uses_timer:
            self.push(self.cfg.dt, "timer")
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if t > self.cfg.duration:
                break
            self.now = t
            if kind == "ready":
                started = self.compute_start.pop(data)
                self.result.iterations += 1
                if not self.cfg.warm:
                    self.cdf.observe(t - started)
                self.queue.append(data)
                self.ready_at[data] = t
                self.arrivals += 1
                if self.observer is not None:
                    self.observer.on_compute_done(data, t)
            elif kind == "sync_done":
                self.running_syncs -= 1
                self.result.syncs.append(data)
                if self.observer is not None:
                    self.observer.on_sync_end(data.members, t)
                for w in data.members:
                    self.start_compute(w)
            elif kind == "timer":
                self.push(t + self.cfg.dt, "timer")
            self.policy.schedule(self)
            if self._deadlocked():
                self.result.deadlocked = True
                break
        return self.result

    def _deadlocked(self) -> bool:
        """Everyone is queued, nothing runs, and the policy launched nothing: no event can help."""
        return len(self.queue) == self.cfg.n and self.running_syncs == 0
