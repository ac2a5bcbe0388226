"""Compute-time distributions and cluster bandwidths for the selective-reduce simulator.

The paper's traces (eager-SGD Fig. 1) are not published as numbers, so the simulator uses clearly
labelled heavy-tailed surrogates with closed-form CDFs (needed for the warm-start estimator):

* ``transformer``: lognormal, sigma 0.6 (variable sentence lengths: a long right tail);
* ``cnn``: a 92/8 mixture of lognormal(sigma 0.15) and a 3x-slower copy (cloud performance
  variability: a tight body plus rare slow rounds), median 0.8x the transformer's.

Their shapes are guesses; their **scale** is calibrated, because it decides every iteration and
sync count.  The paper's text gives no compute time, but its setup fixes the sync cost (v = 500 MB,
b in [1, 20] Gbps: 0.4-8 s per ring) and its Sec. IV-B1 summary bounds the ratio of the two: a
1.89-2.55x faster sync buys only 1.1-1.17x more iterations, so by Eq. 1 a worker's round is
dominated by compute, not by sync.  ``CALIBRATED_MEDIAN_S`` is the one fitted number: the
transformer median at which SR's iteration gain over PR at n = 200 is the top of the paper's range
(1.17x, docs/selective_reduce.md "Calibration"); everything else in the docs' claims table is a
check, not a fit.  A 0.5 s median (eager-SGD-like single-GPU steps) gives 2.4x iterations instead.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np


def _lognormal_cdf(t: float, median: float, sigma: float) -> float:
    if t <= 0:
        return 0.0
    return 0.5 * (1.0 + math.erf(math.log(t / median) / (sigma * math.sqrt(2.0))))


@dataclass(frozen=True)
class ComputeDistribution:
    name: str
    median: float
    sigma: float
    slow_fraction: float = 0.0
    slow_factor: float = 1.0

    def sample(self, rng: np.random.Generator, size=None):
        t = self.median * np.exp(self.sigma * rng.standard_normal(size))
        if self.slow_fraction > 0:
            slow = rng.random(size) < self.slow_fraction
            t = np.where(slow, t * self.slow_factor, t)
        return t

    def cdf(self, t: float) -> float:
        fast = _lognormal_cdf(t, self.median, self.sigma)
        if self.slow_fraction <= 0:
            return fast
        slow = _lognormal_cdf(t, self.median * self.slow_factor, self.sigma)
        return (1 - self.slow_fraction) * fast + self.slow_fraction * slow


CALIBRATED_MEDIAN_S = 4.0     # transformer median; see the module docstring

TRACES = {
    "transformer": ComputeDistribution("transformer", CALIBRATED_MEDIAN_S, 0.6),
    "cnn": ComputeDistribution("cnn", 0.8 * CALIBRATED_MEDIAN_S, 0.15, slow_fraction=0.08,
                               slow_factor=3.0),
}


class EmpiricalCdf:
    """Cold-start estimator: pooled empirical CDF of compute times seen so far (0 before any)."""

    def __init__(self):
        self._sorted: list[float] = []

    def observe(self, t: float) -> None:
        bisect.insort(self._sorted, t)

    def __call__(self, t: float) -> float:
        if not self._sorted:
            return 0.0
        return bisect.bisect_right(self._sorted, t) / len(self._sorted)


def draw_bandwidths(n: int, lam: float, rng: np.random.Generator) -> np.ndarray:
    """b_i = round(20 * U[lam, 1], 3) Gbps, as in the paper."""
    if not 0 < lam <= 1:
        raise ValueError(f"lambda must be in (0, 1], got {lam}")
    return np.round(20.0 * rng.uniform(lam, 1.0, n), 3)
