"""Synchronization policies: all-reduce, partial reduce (P-Reduce) and selective reduce (Alg. 3).

Each policy's ``schedule(sim)`` runs after every simulator event and may launch groups.
"""
from __future__ import annotations

from .grouping import bag, bpawr


class AllReduce:
    """Barrier over all n workers, then one ring over all of them."""

    name = "all-reduce"
    uses_timer = False

    def schedule(self, sim) -> None:
        if len(sim.queue) == sim.cfg.n:
            sim.launch(list(sim.queue))


class PartialReduce:
    """FIFO queue; whenever p workers are queued, pop exactly those p and launch."""

    name = "partial-reduce"
    uses_timer = False

    def schedule(self, sim) -> None:
        p = sim.cfg.p
        while len(sim.queue) >= p:
            sim.launch(sim.queue[:p])


class SelectiveReduce:
    """Algorithm 3 under interpretation A, with the k-counter fixes.

    * A pass runs on every arrival, every sync completion and every Delta t (the simulator timer).
    * Full sync: after ``c`` partial syncs, partial syncs pause until all n workers are queued, then
      one full all-reduce runs and the counter restarts (full syncs count, no multiple of c is
      skipped because the check happens per launch).  ``c=None`` never forces one.
    * For each BAG group: BPAWR says launch / wait; on a wait its pushed-out slow members g_delta
      move to the next group (its remaining members stay queued for the next pass).
    * ``literal=True`` uses the printed booleans: launch g minus g_delta exactly when BPAWR's flag
      is True.  That reading never launches a group with no worthwhile replacement (deadlock).
    """

    name = "selective-reduce"
    uses_timer = True

    def __init__(self):
        self.partials_since_full = 0
        # the paper's wasted wait: when each queued worker's group was first told to wait
        self._wait_started: dict[int, float] = {}
        # idle slots (our earlier metric): a slot between two passes in which waiting groups saw
        # no new ready worker anywhere in the cluster
        self._waiting_since: tuple[float, int, int] | None = None   # (time, workers, arrivals)

    def _account_idle_slots(self, sim) -> None:
        if self._waiting_since is not None:
            since, workers, arrivals = self._waiting_since
            if sim.arrivals == arrivals:
                sim.add_idle_slot_wait((sim.now - since) * workers)
        self._waiting_since = None

    def _mark_waiting(self, sim, group) -> None:
        for w, _ in group:
            self._wait_started.setdefault(w, sim.now)

    def _account_wasted_wait(self, sim, members) -> None:
        """Paper Sec. IV-A2: a member's wait is wasted if no worker that became ready after the
        wait began joined the group it finally launches with."""
        newest_ready = max(sim.ready_at[w] for w in members)
        for w in members:
            started = self._wait_started.pop(w, None)
            if started is not None and newest_ready <= started:
                sim.add_wasted_wait(sim.now - started)

    def _full_sync_due(self, sim) -> bool:
        c = sim.cfg.full_sync_every
        return c is not None and self.partials_since_full >= c

    def schedule(self, sim) -> None:
        cfg = sim.cfg
        self._account_idle_slots(sim)
        if self._full_sync_due(sim):
            if len(sim.queue) == cfg.n:
                self._account_wasted_wait(sim, sim.queue)
                sim.launch(list(sim.queue))
                self.partials_since_full = 0
            return
        if len(sim.queue) < cfg.p:
            return
        est = sim.estimated_bandwidth()
        in_training = sim.in_training(est)
        groups = bag([(w, float(est[w])) for w in sim.queue], cfg.p, cfg.eta)
        waiting = 0
        for i in range(len(groups)):
            group = groups[i]
            decision = bpawr(in_training, group, cfg.p, cfg.eta, cfg.dt, cfg.v_gbit, cfg.theta,
                             sim.cdf, literal=cfg.literal, hazard=cfg.hazard)
            in_training = decision.in_training
            pushed = {w[0] for w in decision.pushed_out}
            if pushed and i + 1 < len(groups):
                groups[i + 1] = groups[i + 1] + decision.pushed_out
            if cfg.literal:
                members = [w for w, _ in group if w not in pushed]
                if decision.launch and members:
                    self._launch(sim, members)
                continue
            if decision.launch:
                self._launch(sim, [w for w, _ in group])
            elif len(group) >= cfg.p:
                waiting += len(group)
                self._mark_waiting(sim, group)
            if self._full_sync_due(sim):
                break
        if waiting:
            self._waiting_since = (sim.now, waiting, sim.arrivals)

    def _launch(self, sim, members) -> None:
        self._account_wasted_wait(sim, members)
        sim.launch(members)
        self.partials_since_full += 1


POLICIES = {"all-reduce": AllReduce, "partial-reduce": PartialReduce,
            "selective-reduce": SelectiveReduce}
