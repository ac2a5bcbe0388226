"""Rank-0 coordinator: wait for everyone, or start phase 1 with the ready set (ski rental).

Cost model (S/B estimates, the paper's rule made concrete with the artifact's shape but profiled
numbers instead of its hard-coded constants):

* B = the sum of the workers' profiled link bandwidths (bytes/s), s = per-worker tensor bytes;
* full AllReduce over N: C_full = 2(N-1) s / B;
* buying with k ready: C_buy(k) = C_full * ((k-1)/k) / ((N-1)/N) + N s / B
  (phase 1: a k-worker all-reduce; phase 2: the late data broadcast to all N).

What buying really costs also holds a wait: phase 2 carries the late workers' data, so it cannot
start before the last of them is ready.  Proceeding at rent r (time since the first ready worker)
with the last worker ready at L costs max(r + phase 1, L) + phase 2
(``SkiRentalCostModel.partial``).
The online rule cannot know L, so it decides on C_buy(k) as the paper does; the replay and the
offline optimum score every partial decision with the wait included.

Online rule (break-even, one decision per ``cycle`` = 5 ms since the first worker became ready):
wait while the accumulated waiting ("rent") is below the extra cost of buying, C_buy(k) - C_full;
proceed with the ready set as soon as rent >= C_buy(k) - C_full and k >= 2; run the full collective
the moment everyone is ready.  Options: ``k_of_n`` (THC's rule: proceed once k workers are ready)
and ``max_wait`` (the artifact's 0.1 s cap).  Faults (the paper's rule): a worker not ready within
5 x (phase-1 end - first ready) after phase 1 ends is declared faulty; ``min_fault_timeout`` is an
optional floor on that timeout, off by default.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SkiRentalCostModel:
    n: int
    tensor_bytes: float
    link_bandwidths: tuple          # bytes/s per worker

    def __post_init__(self):
        if self.n < 2 or len(self.link_bandwidths) != self.n:
            raise ValueError("need n >= 2 workers and one bandwidth per worker")
        if min(self.link_bandwidths) <= 0:
            raise ValueError("link bandwidths must be > 0")

    @property
    def s_over_b(self) -> float:
        return self.tensor_bytes / sum(self.link_bandwidths)

    def full(self) -> float:
        return 2 * (self.n - 1) * self.s_over_b

    def phase1(self, k: int) -> float:
        """A k-worker all-reduce among the ready set (the relays forward, adding nothing)."""
        share = ((k - 1) / k) / ((self.n - 1) / self.n)
        return self.full() * share

    def phase2(self) -> float:
        """The late workers' data broadcast to all N."""
        return self.n * self.s_over_b

    def buy(self, k: int) -> float:
        """Collective time of proceeding with k ready, not counting any wait (the rule's price)."""
        if k >= self.n:
            return self.full()
        return self.phase1(k) + self.phase2()

    def partial(self, k: int, rent: float, last_ready: float) -> float:
        """Wait + collective time of proceeding with k ready at ``rent``, both times counted from
        the first ready worker: phase 2 starts once phase 1 is over and the last worker
        (ready at ``last_ready``) has its data."""
        return max(rent + self.phase1(k), last_ready) + self.phase2()

    def extra(self, k: int) -> float:
        return self.buy(k) - self.full()


@dataclass
class Decision:
    action: str                  # 'full' or 'partial'
    time: float                  # absolute decision time
    ready: frozenset
    relays: frozenset
    # waited time (since first ready) + modelled collective time, with the wait for the late
    # workers' data before phase 2; None for a partial decision whose late workers' ready
    # times are not known yet (the live coordinator)
    cost: float | None


class Coordinator:
    def __init__(self, cost: SkiRentalCostModel, cycle: float = 0.005, k_of_n: int | None = None,
                 max_wait: float | None = None, policy: str = "break-even"):
        if policy not in ("break-even", "always-wait", "never-wait"):
            raise ValueError(f"policy {policy!r}: use break-even, always-wait or never-wait")
        if k_of_n is not None and not 2 <= k_of_n <= cost.n:
            raise ValueError(f"k_of_n must be in [2, {cost.n}]")
        self.cost, self.cycle, self.k_of_n = cost, cycle, k_of_n
        self.max_wait, self.policy = max_wait, policy
        self.ready: dict[int, float] = {}
        self.first_ready: float | None = None

    def register_ready(self, worker: int, t: float) -> None:
        if not 0 <= worker < self.cost.n:
            raise ValueError(f"worker {worker} outside 0..{self.cost.n - 1}")
        self.ready.setdefault(worker, t)
        if self.first_ready is None or t < self.first_ready:
            self.first_ready = t

    def decide(self, now: float) -> Decision | None:
        """Called on each cycle boundary; None means keep waiting."""
        if self.first_ready is None:
            return None
        rent = now - self.first_ready
        ready = frozenset(w for w, t in self.ready.items() if t <= now + 1e-12)
        k = len(ready)
        everyone = frozenset(range(self.cost.n))
        if k == self.cost.n:
            return Decision("full", now, ready, frozenset(), rent + self.cost.full())
        if k < 2 or self.policy == "always-wait":
            return None
        go = (self.policy == "never-wait"
              or (self.k_of_n is not None and k >= self.k_of_n)
              or (self.k_of_n is None and rent + 1e-12 >= self.cost.extra(k))
              or (self.max_wait is not None and rent >= self.max_wait))
        if go:
            return Decision("partial", now, ready, everyone - ready, self._partial_cost(k, rent))
        return None

    def _partial_cost(self, k: int, rent: float) -> float | None:
        if len(self.ready) < self.cost.n:
            return None
        return self.cost.partial(k, rent, max(self.ready.values()) - self.first_ready)

    def run_trace(self, ready_times: Sequence[float]) -> Decision:
        """Replay a trace of ready times, deciding on every cycle boundary."""
        for w, t in enumerate(ready_times):
            self.register_ready(w, t)
        start = min(ready_times)
        last = max(ready_times)
        j = 0
        while True:
            now = start + j * self.cycle
            decision = self.decide(now)
            if decision is not None:
                return decision
            if now > last + self.cycle:
                raise RuntimeError("no decision after everyone was ready")
            j += 1


class LiveCoordinator:
    """The rule in real time: workers call ``register_ready``; a thread decides every cycle.

    Decisions are made on the grid first_ready + j * cycle (a tick that runs late under load
    still decides for its grid time, with the workers that had registered by then).
    """

    def __init__(self, cost: SkiRentalCostModel, cycle: float = 0.005, clock=time.monotonic,
                 **rule_kwargs):
        self._rule = Coordinator(cost, cycle, **rule_kwargs)
        self._clock, self._cycle = clock, cycle
        self._lock = threading.Lock()
        self._decided = threading.Event()
        self._decision: Decision | None = None
        self._thread: threading.Thread | None = None

    def register_ready(self, *workers: int) -> None:
        """Mark workers ready now (several at once share one timestamp)."""
        with self._lock:
            now = self._clock()
            for worker in workers:
                self._rule.register_ready(worker, now)
            if self._thread is None:
                self._thread = threading.Thread(target=self._tick, daemon=True)
                self._thread.start()

    def _tick(self) -> None:
        first = self._rule.first_ready
        j = 0
        while True:
            target = first + j * self._cycle
            delay = target - self._clock()
            if delay > 0:
                time.sleep(delay)
            with self._lock:
                decision = self._rule.decide(target)
            if decision is not None:
                self._decision = decision
                self._decided.set()
                return
            j += 1

    def wait_decision(self, timeout: float | None = None) -> Decision:
        if not self._decided.wait(timeout):
            raise TimeoutError(f"no coordinator decision within {timeout}s "
                               "(did at least two workers register?)")
        return self._decision


def offline_optimum(cost: SkiRentalCostModel, ready_times: Sequence[float],
                    cycle: float = 0.005) -> float:
    """Best of {wait for all, proceed at any cycle with >= 2 ready}, same cycles and cost model
    (a partial choice includes the wait for the late data before phase 2)."""
    start, last = min(ready_times), max(ready_times)
    n_cycles = math.ceil((last - start) / cycle - 1e-12)
    best = n_cycles * cycle + cost.full()
    for j in range(n_cycles + 1):
        now = start + j * cycle
        k = sum(t <= now + 1e-12 for t in ready_times)
        if 2 <= k < cost.n:
            best = min(best, cost.partial(k, j * cycle, last - start))
    return best


def fault_timeout(first_ready: float, phase1_end: float, factor: float = 5.0,
                  min_fault_timeout: float = 0.0) -> float:
    """How long after phase 1 a missing worker has before it is faulty: the paper's
    ``factor`` x (phase1_end - first_ready), raised to ``min_fault_timeout`` when that floor is
    set (a host whose scheduling noise exceeds a short span would otherwise evict live workers)."""
    return max(factor * (phase1_end - first_ready), min_fault_timeout)


def faulty_workers(ready_times: dict[int, float], n: int, first_ready: float, phase1_end: float,
                   now: float, factor: float = 5.0, min_fault_timeout: float = 0.0) -> set[int]:
    """Workers still not ready once ``fault_timeout`` has passed after phase 1 (by default the
    paper's rule, ``factor`` x (phase1_end - first_ready), with no floor).

    Returns an empty set while the deadline has not passed yet.
    """
    deadline = phase1_end + fault_timeout(first_ready, phase1_end, factor, min_fault_timeout)
    if now < deadline:
        return set()
    return {w for w in range(n) if ready_times.get(w, math.inf) > deadline}


def redistribute_batch(global_batch: int, survivors: Sequence[int]) -> dict[int, int]:
    """Split the global batch over the surviving workers, keeping its total constant."""
    if not survivors:
        raise ValueError("no surviving workers to redistribute the batch to")
    base, extra = divmod(global_batch, len(survivors))
    return {w: base + (1 if i < extra else 0) for i, w in enumerate(sorted(survivors))}
