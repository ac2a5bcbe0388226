"""The paper's trends that hold at the calibrated settings (docs/selective_reduce.md, claims table).

n = 200 as in the study's sweeps, 100 s runs, 4 fixed seeds, medians over seeds; the margins sit
well inside what the 20-seed study shows, so each assertion is about a direction, not a digit.
Trends that do not hold (SR's sync time falling with n, a U-shaped time in eta) are explained in
the docs, not asserted here.
"""
from functools import lru_cache

import numpy as np

from host.selective_reduce.policies import POLICIES
from host.selective_reduce.simulator import SimConfig, Simulation

SEEDS = range(4)


@lru_cache(maxsize=None)
def _runs(scheme: str, overrides: tuple) -> tuple:
    """Cached per (scheme, settings): several tests share the default point."""
    kw = {"n": 200, **dict(overrides)}
    return tuple(Simulation(SimConfig(seed=s, **kw), POLICIES[scheme]()).run().summary()
                 for s in SEEDS)


def median(scheme: str, metric: str, **overrides) -> float:
    runs = _runs(scheme, tuple(sorted(overrides.items())))
    return float(np.median([r[metric] for r in runs]))


def sr(metric, **kw):
    return median("selective-reduce", metric, **kw)


def pr(metric, **kw):
    return median("partial-reduce", metric, **kw)


def test_faster_larger_fewer_syncs_and_somewhat_more_iterations_than_pr():
    assert pr("avg_sync_time") / sr("avg_sync_time") > 1.8          # paper: 1.89-2.55x
    assert 1.1 < sr("avg_scale") / pr("avg_scale") < 1.4             # paper: 1.19-1.25x
    assert 1.0 < sr("total_iterations") / pr("total_iterations") < 1.3   # paper: 1.1-1.17x
    assert sr("total_syncs") < pr("total_syncs")                     # paper: fewer


def test_partial_and_all_reduce_sync_time_rise_with_n():
    for scheme in ("partial-reduce", "all-reduce"):
        assert median(scheme, "avg_sync_time", n=40) < median(scheme, "avg_sync_time")


def test_eta_raises_scale_and_iterations_until_it_is_large():
    assert sr("avg_scale", eta=0.0) < sr("avg_scale", eta=0.4)
    assert sr("total_iterations", eta=0.4) > 1.05 * sr("total_iterations", eta=0.0)
    assert sr("total_iterations", eta=0.8) < sr("total_iterations", eta=0.4)


def test_theta_makes_selective_reduce_conservative():
    assert sr("avg_scale", theta=20) < sr("avg_scale", theta=1)
    assert sr("total_syncs", theta=20) > sr("total_syncs", theta=1)
    assert sr("total_iterations", theta=20) > sr("total_iterations", theta=1)


def test_wasted_wait_is_milliseconds_under_the_papers_definition():
    # paper: "a few milliseconds for each worker" (< 0.01 % of 100 s); ours: tens of ms at most
    assert sr("wasted_wait_per_worker") < 0.1
    # the idle-slot count (every slot with a waiting group and no arrival) is seconds: another
    # quantity, reported under its own name
    assert sr("idle_slot_wait_per_worker") > 1.0
