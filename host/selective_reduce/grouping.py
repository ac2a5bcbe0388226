"""BAG (Algorithm 1) and BPAWR (Algorithm 2) of selective reduce, with fixes to the printed pseudocode.

Workers are passed as ``(worker_id, bandwidth)`` pairs; bandwidth in Gbps, model size ``v`` in Gb,
so 2v/b is seconds.  Deviations from the printed pseudocode (each selectable by a flag):

* BAG uses ``len(g) < p`` (the printed ``<=`` admits p+1 workers and breaks Fig. 3(e));
  ``literal_le=True`` restores the printed test.  b* is reset for every new group (matters for p=1).
* BPAWR returns ``launch`` (interpretation A): False when ``len(g) < p`` or a replacement is worth
  waiting for, True otherwise.  ``literal=True`` returns the printed booleans instead (True = the
  "wait and replace" flag), which the controller then uses literally; that reading deadlocks.
* PREDICTWORKERS keeps ``b_i > b_hat`` (``ge_filter=True`` gives the prose's ``>=``) and uses
  ``p_i = F(t_i + dt)`` as printed (``hazard=True`` gives the true conditional probability).
* CALCEXPECTEDBW guards sum(p_i) = 0 (k = 0 then and the expected bandwidth is unused).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

Worker = tuple  # (worker_id, bandwidth)


def bag(ready: Sequence[Worker], p: int, eta: float, literal_le: bool = False) -> list[list[Worker]]:
    """Bandwidth-Aware Grouping: contiguous runs of the bandwidth-sorted list, each >= p (but last)."""
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if not 0.0 <= eta < 1.0:
        raise ValueError(f"eta must be in [0, 1), got {eta}")
    ordered = sorted(ready, key=lambda w: -w[1])          # stable: ties keep arrival order
    groups, group, threshold = [], [], math.inf
    for worker in ordered:
        under_quota = len(group) <= p if literal_le else len(group) < p
        if under_quota:
            group.append(worker)
            threshold = worker[1] * (1.0 - eta)
        elif worker[1] >= threshold:
            group.append(worker)
        else:
            groups.append(group)
            group, threshold = [worker], worker[1] * (1.0 - eta)   # fresh b* for the new group
    if group:
        groups.append(group)
    return groups


def ring_time(group_bandwidths: Sequence[float], v: float, alpha: float, exact: bool = True) -> float:
    """Eq. 2: ring all-reduce time of a group (exact or the approximate form)."""
    m = len(group_bandwidths)
    if m <= 1:
        return 0.0
    b_min = min(group_bandwidths)
    if exact:
        return 2 * (m - 1) * alpha + 2 * (m - 1) / m * v / b_min
    return 2 * m * alpha + 2 * v / b_min


@dataclass
class Candidate:
    worker_id: object
    bandwidth: float
    probability: float


def predict_workers(in_training: Sequence[tuple], dt: float, b_hat: float,
                    cdf: Callable[[float], float], ge_filter: bool = False,
                    hazard: bool = False) -> list[Candidate]:
    """PREDICTWORKERS: in-training workers faster than the bottleneck and their arrival odds."""
    out = []
    for worker_id, bandwidth, elapsed in in_training:
        faster = bandwidth >= b_hat if ge_filter else bandwidth > b_hat
        if not faster:
            continue
        if hazard:
            done = cdf(elapsed)
            prob = 0.0 if done >= 1.0 else (cdf(elapsed + dt) - done) / (1.0 - done)
        else:
            prob = cdf(elapsed + dt)
        out.append(Candidate(worker_id, bandwidth, prob))
    return out


def expected_new_workers(cands: Sequence[Candidate]) -> int:
    return int(math.floor(sum(c.probability for c in cands) + 1e-12))


def expected_bandwidth(cands: Sequence[Candidate]) -> float:
    total = sum(c.probability for c in cands)
    if total <= 0:
        return 0.0
    return sum(c.probability * c.bandwidth for c in cands) / total


@dataclass
class BpawrDecision:
    launch: bool          # interpretation A: launch the group now
    pushed_out: list      # g_delta: real workers of g that the augmented group drops
    in_training: list     # S with the predicted workers removed
    saving: float         # t_X, seconds


def bpawr(in_training: Sequence[tuple], group: Sequence[Worker], p: int, eta: float, dt: float,
          v: float, theta: float, cdf: Callable[[float], float], literal: bool = False,
          ge_filter: bool = False, hazard: bool = False) -> BpawrDecision:
    """Bandwidth- and Progress-Aware Waiting and Replacement for one group."""
    if len(group) < p:
        return BpawrDecision(False, [], list(in_training), 0.0)
    b_hat = min(w[1] for w in group)
    cands = predict_workers(in_training, dt, b_hat, cdf, ge_filter, hazard)
    claimed = {c.worker_id for c in cands}
    remaining = [w for w in in_training if w[0] not in claimed]
    k = expected_new_workers(cands)
    b_virtual = expected_bandwidth(cands)
    augmented = list(group) + [(("virtual", i), b_virtual) for i in range(k)]
    best = bag(augmented, p, eta)[0]
    best_ids = {w[0] for w in best}
    pushed = [w for w in group if w[0] not in best_ids]
    saving = 2 * v / b_hat - 2 * v / min(w[1] for w in best)
    worth_waiting = saving > theta * dt
    if literal:
        # printed booleans: True means "wait and replace"; the controller launches on True
        return BpawrDecision(worth_waiting, pushed if worth_waiting else [], remaining, saving)
    return BpawrDecision(not worth_waiting, pushed if worth_waiting else [], remaining, saving)
