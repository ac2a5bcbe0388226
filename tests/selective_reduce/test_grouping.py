"""BAG / BPAWR unit vectors T1-T9 (Selective Reduce paper, Algorithms 1 and 2)."""
import random

import pytest

from host.selective_reduce.grouping import (bag, bpawr, expected_bandwidth, predict_workers,
                                            ring_time)
from host.selective_reduce.workload import TRACES

FIG3 = [("w1", 1.0), ("w2", 5.0), ("w3", 1.0), ("w4", 5.0)]


def ids(groups):
    return [[w for w, _ in g] for g in groups]


def step_cdf(at):
    return lambda t: 1.0 if t >= at else 0.0


def test_t1_fig3e_bag_groups_and_times():
    groups = bag(FIG3, p=2, eta=0.3)
    assert ids(groups) == [["w2", "w4"], ["w1", "w3"]]
    times = [ring_time([b for _, b in g], v=5, alpha=0, exact=False) for g in groups]
    assert times == [2.0, 10.0] and sum(times) / 2 == 6.0
    preduce = [[FIG3[0], FIG3[1]], [FIG3[2], FIG3[3]]]      # arrival order {w1,w2},{w3,w4}
    assert sum(ring_time([b for _, b in g], 5, 0, exact=False) for g in preduce) / 2 == 10.0


def test_t1_literal_le_gives_one_group():
    assert ids(bag(FIG3, p=2, eta=0.3, literal_le=True)) == [["w2", "w4", "w1", "w3"]]


T2 = [("a", 20), ("b", 16), ("c", 12), ("d", 9), ("e", 6), ("f", 3), ("g", 1.5)]


@pytest.mark.parametrize("eta,expected", [
    (0.0, [["a", "b"], ["c", "d"], ["e", "f"], ["g"]]),
    (0.2, [["a", "b"], ["c", "d"], ["e", "f"], ["g"]]),
    (0.3, [["a", "b", "c"], ["d", "e"], ["f", "g"]]),
    (0.5, [["a", "b", "c", "d"], ["e", "f", "g"]]),
    (0.8, [["a", "b", "c", "d", "e"], ["f", "g"]]),
    (0.99, [["a", "b", "c", "d", "e", "f", "g"]]),
])
def test_t2_bag_eta_sweep(eta, expected):
    shuffled = T2[::-1]
    assert ids(bag(shuffled, p=2, eta=eta)) == expected


def test_t3_bag_invariants_random():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 30)
        workers = [(i, round(rng.uniform(1, 20), 3)) for i in range(n)]
        p = rng.randint(1, max(1, n))
        eta = rng.choice([0.0, 0.1, 0.3, 0.6, 0.9])
        groups = bag(workers, p, eta)
        flat = [w for g in groups for w in g]
        assert sorted(flat) == sorted(workers)                       # partition
        assert [b for _, b in flat] == sorted((b for _, b in workers), reverse=True)  # contiguous
        for g in groups[:-1]:
            assert len(g) >= p
        for g in groups:
            if len(g) >= p:
                b_p = sorted((b for _, b in g), reverse=True)[p - 1]
                assert all(b >= (1 - eta) * b_p - 1e-12 for _, b in g)
        distinct = len({b for _, b in workers}) == n
        if eta == 0.0 and distinct:
            assert all(len(g) == p for g in groups[:-1])
        sizes = [len(bag(workers, p, e)[0]) for e in (0.0, 0.2, 0.4, 0.6, 0.8)]
        assert sizes == sorted(sizes)


def test_bag_refuses_bad_parameters():
    with pytest.raises(ValueError, match="p must be"):
        bag(FIG3, 0, 0.3)
    with pytest.raises(ValueError, match="eta"):
        bag(FIG3, 2, 1.0)


G = [("w1", 10.0), ("w2", 2.0)]


def test_t4_replace_and_wait():
    s = [("w3", 10.0, 0.9), ("w4", 3.0, 0.9)]
    d = bpawr(s, G, p=2, eta=0.3, dt=1.0, v=5, theta=1.0, cdf=step_cdf(1.5))
    assert d.launch is False
    assert [w for w, _ in d.pushed_out] == ["w2"]
    assert d.in_training == []
    assert d.saving == pytest.approx(10 / 2 - 10 / 6.5)


def test_t5_zero_probability_worker_still_claimed():
    s = [("w3", 10.0, 0.2), ("w4", 3.0, 0.9)]
    cands = predict_workers(s, 1.0, 2.0, step_cdf(1.5))
    assert [c.probability for c in cands] == [0.0, 1.0]
    assert expected_bandwidth(cands) == 3.0
    d = bpawr(s, G, 2, 0.3, 1.0, 5, 1.0, step_cdf(1.5))
    assert d.launch is False and d.in_training == []
    assert d.saving == pytest.approx(5 - 10 / 3)


def test_t6_no_prediction_launches_under_a_but_not_literally():
    d = bpawr([], G, 2, 0.3, 1.0, 5, 1.0, step_cdf(1.5))
    assert d.launch is True and d.saving == 0 and d.pushed_out == []
    literal = bpawr([], G, 2, 0.3, 1.0, 5, 1.0, step_cdf(1.5), literal=True)
    assert literal.launch is False          # literal flag: never launched -> deadlock (see sim test)


def test_t7_short_group_never_launches():
    d = bpawr([], G[:1], 2, 0.3, 1.0, 5, 1.0, step_cdf(1.5))
    assert d.launch is False


def test_t8_theta_monotone():
    rng = random.Random(3)
    for _ in range(200):
        g = [(f"g{i}", rng.uniform(1, 20)) for i in range(rng.randint(2, 6))]
        s = [(f"s{i}", rng.uniform(1, 20), rng.uniform(0, 2)) for i in range(rng.randint(0, 6))]
        cdf = TRACES["transformer"].cdf
        launches = [bpawr(s, g, 2, 0.3, 0.2, 4.0, th, cdf).launch for th in (0.5, 1, 2, 5, 20)]
        # once a theta launches, every larger theta launches too
        assert launches == sorted(launches)


def test_t9_printed_estimator_dominates_hazard():
    cdf = TRACES["transformer"].cdf
    for t in [0.0, 0.05, 0.3, 0.5, 1.0, 2.0, 4.0]:
        printed = predict_workers([("w", 5.0, t)], 0.1, 1.0, cdf)[0].probability
        hazard = predict_workers([("w", 5.0, t)], 0.1, 1.0, cdf, hazard=True)[0].probability
        assert printed >= hazard - 1e-12
        if cdf(t) == 0.0:
            assert printed == pytest.approx(hazard)
    # filter: strictly faster by default, >= with the prose flag
    assert predict_workers([("w", 2.0, 0.0)], 0.1, 2.0, cdf) == []
    assert len(predict_workers([("w", 2.0, 0.0)], 0.1, 2.0, cdf, ge_filter=True)) == 1
