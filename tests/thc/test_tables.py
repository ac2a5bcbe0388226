import numpy as np
import pytest

import thc
from thc.tables import expected_nmse, lower_index_table, sq_variance, truncation_error

# Optimal tables computed independently of thc.tables; the first is the one the THC
# paper's artifact ships. An asymmetric optimum and its mirror image cost the same; the
# lexicographically smaller of the two is the one listed (and the one optimal_table picks).
KNOWN_TABLES = {
    (4, 30, 1 / 32, True): [0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30],
    (4, 30, 1 / 32, False): [0, 3, 5, 7, 9, 11, 13, 14, 15, 17, 19, 21, 23, 25, 27, 30],
    (4, 30, 1 / 16, False): list(range(0, 31, 2)),
    (4, 30, 1 / 64, True): [0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30],
    (4, 34, 1 / 32, False): [0, 3, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 31, 34],
    (4, 30, 1 / 128, False): [0, 4, 6, 8, 10, 12, 13, 14, 15, 16, 18, 20, 22, 24, 26, 30],
    (4, 30, 1 / 128, True): [0, 4, 6, 8, 10, 12, 13, 14, 16, 17, 18, 20, 22, 24, 26, 30],
    (4, 30, 1 / 512, False): [0, 4, 7, 9, 11, 12, 13, 14, 15, 16, 17, 19, 21, 23, 26, 30],
    (4, 36, 1 / 32, False): [0, 4, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 32, 36],
    (4, 20, 1 / 512, False): [0, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17, 20],
    (4, 51, 1 / 32, False): [0, 5, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42, 46, 51],
}


@pytest.mark.parametrize("args,expected", list(KNOWN_TABLES.items()))
def test_known_optimal_tables(args, expected):
    bits, g, p, symmetric = args
    table = thc.optimal_table(bits, g, p, symmetric=symmetric)
    assert table.dtype == np.int64
    assert table.tolist() == expected


@pytest.mark.parametrize("args", [a for a in KNOWN_TABLES if not a[3]])
def test_an_asymmetric_optimum_is_the_smaller_of_the_mirror_pair(args):
    """The mirror image g - T[::-1] of an optimal table costs the same (phi is even), so the
    two tie and float rounding would pick either, machine by machine (AVX2 and AVX-512
    builds of scipy did differ); optimal_table takes the lexicographically smaller."""
    bits, g, p, _ = args
    table = thc.optimal_table(bits, g, p, symmetric=False)
    mirror = g - table[::-1]
    assert sq_variance(mirror, p) == pytest.approx(sq_variance(table, p), rel=1e-12)
    assert table.tolist() <= mirror.tolist()


@pytest.mark.parametrize("p", [1 / 2, 1 / 32, 1 / 1024])
def test_identity_when_granularity_is_levels_minus_one(p):
    assert thc.optimal_table(4, 15, p).tolist() == list(range(16))
    assert thc.optimal_table(2, 3, p).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("bits,g,p", [(4, 30, 1 / 32), (3, 21, 1 / 64), (2, 9, 1 / 16),
                                      (4, 51, 1 / 512)])
def test_symmetric_tables_reflect(bits, g, p):
    table = thc.optimal_table(bits, g, p, symmetric=True)
    assert np.all(table + table[::-1] == g)
    assert table[0] == 0 and table[-1] == g and np.all(np.diff(table) > 0)
    # the unconstrained optimum can only be as good or better
    free = thc.optimal_table(bits, g, p)
    assert sq_variance(free, p) <= sq_variance(table, p) + 1e-12


def test_dp_is_optimal_against_brute_force():
    from itertools import combinations
    bits, g, p = 2, 9, 1 / 32
    best = min((sq_variance([0, *inner, g], p), [0, *inner, g])
               for inner in combinations(range(1, g), 2))
    assert thc.optimal_table(bits, g, p).tolist() == best[1]


def test_thresholds_and_error_budget():
    assert thc.truncation_threshold(1 / 32) == pytest.approx(2.153875, abs=1e-6)
    assert thc.truncation_threshold(1 / 512) == pytest.approx(3.097269, abs=1e-6)
    assert thc.truncation_threshold(1 / 1024) == pytest.approx(3.297193, abs=1e-6)
    table = thc.optimal_table(4, 30, 1 / 32)
    assert sq_variance(table, 1 / 32) == pytest.approx(0.013063, abs=2e-6)
    assert truncation_error(1 / 32) == pytest.approx(0.00727, abs=1e-5)
    assert truncation_error(1 / 16) == pytest.approx(0.01716, abs=1e-5)
    assert sq_variance(list(range(16)), 1 / 32) == pytest.approx(0.01332, abs=1e-5)
    assert expected_nmse(table, 1 / 32) == pytest.approx(0.02033, abs=1e-4)


def test_lower_index_table_brackets_every_grid_point():
    table = thc.optimal_table(4, 30, 1 / 32, symmetric=True)
    lower = lower_index_table(table)
    for k in range(31):
        j = lower[k]
        assert table[j] <= k <= table[j + 1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="granularity"):
        thc.optimal_table(4, 10, 1 / 32)
    with pytest.raises(ValueError, match="p must be"):
        thc.truncation_threshold(0.0)


def test_tables_are_cached_and_fresh():
    a = thc.optimal_table(4, 30, 1 / 32)
    a[0] = 99
    assert thc.optimal_table(4, 30, 1 / 32)[0] == 0
