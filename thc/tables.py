"""Optimal THC lookup tables (THC paper, §5.2) by exact shortest path over the grid.

Given a table T (strictly increasing integers, T[0]=0, T[-1]=g) on the grid
x_i = -t_p + 2 t_p i / g, unbiased stochastic rounding between bracketing values has
expected squared error sum over intervals [l, r] of  integral_l^r (a-l)(r-a) phi(a) da
for a standard normal clamped to [-t_p, t_p]. The cost is additive over intervals, so
the best table is a shortest path with exactly 2^b - 1 edges from grid point 0 to g.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from scipy.stats import norm


def truncation_threshold(p: float) -> float:
    """t_p = Phi^-1(1 - p/2): a fraction p of N(0,1) mass lies outside [-t_p, t_p]."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    return float(norm.ppf(1.0 - p / 2.0))


def interval_cost(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """integral_lo^hi (a-lo)(hi-a) phi(a) da, in closed form (vectorized)."""
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    cdf_lo, cdf_hi = norm.cdf(lo), norm.cdf(hi)
    pdf_lo, pdf_hi = norm.pdf(lo), norm.pdf(hi)
    # integral of a^2 phi is Phi - a phi; of a phi is -phi; of phi is Phi.
    second = (cdf_hi - hi * pdf_hi) - (cdf_lo - lo * pdf_lo)
    first = pdf_lo - pdf_hi
    zeroth = cdf_hi - cdf_lo
    return -second + (lo + hi) * first - lo * hi * zeroth


def _grid_costs(granularity: int, p: float) -> np.ndarray:
    """cost[i, j] of the interval between grid points i < j (inf elsewhere)."""
    t = truncation_threshold(p)
    grid = -t + 2.0 * t * np.arange(granularity + 1) / granularity
    i, j = np.meshgrid(np.arange(granularity + 1), np.arange(granularity + 1), indexing="ij")
    cost = np.full((granularity + 1, granularity + 1), np.inf)
    upper = j > i
    cost[upper] = interval_cost(grid[i[upper]], grid[j[upper]])
    return cost


def _shortest_paths(cost: np.ndarray, edges: int) -> tuple[np.ndarray, np.ndarray]:
    """best[k, j]: least cost of k edges from point 0 to point j; parent for backtracking."""
    points = cost.shape[0]
    best = np.full((edges + 1, points), np.inf)
    parent = np.zeros((edges + 1, points), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, edges + 1):
        total = best[k - 1][:, None] + cost          # total[i, j] = via i
        parent[k] = np.argmin(total, axis=0)         # ties: the smallest i, deterministic
        best[k] = total[parent[k], np.arange(points)]
    return best, parent


def _backtrack(parent: np.ndarray, edges: int, end: int) -> list[int]:
    path = [end]
    for k in range(edges, 0, -1):
        path.append(int(parent[k, path[-1]]))
    return path[::-1]


@functools.lru_cache(maxsize=None)
def _optimal_table(bits: int, granularity: int, p: float, symmetric: bool) -> tuple[int, ...]:
    levels = 1 << bits
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    if granularity < levels - 1:
        raise ValueError(f"granularity {granularity} < 2^bits - 1 = {levels - 1}: "
                         f"the {levels} table values must be distinct grid points")
    cost = _grid_costs(granularity, p)
    if not symmetric:
        _, parent = _shortest_paths(cost, levels - 1)
        path = _backtrack(parent, levels - 1, granularity)
        # phi is even, so the mirrored table costs exactly the same: the two tie, and which
        # one the float comparison picks depends on the machine's rounding in norm.cdf.
        # The lexicographically smaller one, so that every machine derives the same table.
        return tuple(min(path, [granularity - v for v in reversed(path)]))
    # Reflection symmetry T[z] + T[L-1-z] = g: a half path 0 -> c with L/2 - 1 edges,
    # mirrored, joined by the middle interval [c, g - c]. phi is even, so the mirrored
    # half costs the same as the half.
    half_edges = levels // 2 - 1
    best, parent = _shortest_paths(cost, half_edges)
    centres = np.arange((granularity + 1) // 2)     # c < g - c
    centres = centres[2 * centres < granularity]
    totals = 2.0 * best[half_edges, centres] + cost[centres, granularity - centres]
    if not np.isfinite(totals).any():
        raise ValueError(f"no symmetric table with {levels} values on granularity {granularity}")
    c = int(centres[np.argmin(totals)])
    half = _backtrack(parent, half_edges, c)
    return tuple(half + [granularity - v for v in reversed(half)])


def optimal_table(bits: int, granularity: int, p: float, symmetric: bool = False) -> np.ndarray:
    """The 2^bits integer grid points in 0..g minimizing SQ error of a clamped N(0,1).

    symmetric=True adds T[z] + T[2^bits - 1 - z] = g (the THC artifact's tables).
    Results are cached per (bits, granularity, p, symmetric); a fresh array is returned.
    """
    return np.array(_optimal_table(int(bits), int(granularity), float(p), bool(symmetric)),
                    dtype=np.int64)


def sq_variance(table, p: float) -> float:
    """Per-coordinate SQ variance (normalized units) of `table` on the clamped N(0,1)."""
    table = np.asarray(table, dtype=np.int64)
    g = int(table[-1])
    t = truncation_threshold(p)
    points = -t + 2.0 * t * table / g
    return float(interval_cost(points[:-1], points[1:]).sum())


def truncation_error(p: float) -> float:
    """2 * integral_t^inf (a - t)^2 phi(a) da: the squared bias clamping adds per coordinate."""
    t = truncation_threshold(p)
    tail = 1.0 - norm.cdf(t)
    return float(2.0 * ((1.0 + t * t) * tail - t * norm.pdf(t)))


def expected_nmse(table, p: float, copies: int = 1) -> float:
    """Analytic NMSE of THC on Gaussian input sent by `copies` identical workers."""
    return sq_variance(table, p) / copies + truncation_error(p)


def lower_index_table(table) -> np.ndarray:
    """For each integer k in 0..g: the index z of the interval [T[z], T[z+1]] holding k
    (capped at 2^b - 2 so that k = g falls in the last interval)."""
    table = np.asarray(table, dtype=np.int64)
    g = int(table[-1])
    z = np.searchsorted(table, np.arange(g + 1), side="right") - 1
    return np.minimum(z, len(table) - 2).astype(np.uint8)


def check_table(table) -> np.ndarray:
    """Validate a user table: 2^b strictly increasing ints starting at 0."""
    t = np.asarray(table)
    if t.ndim != 1 or len(t) < 2 or len(t) & (len(t) - 1):
        raise ValueError(f"a table needs 2^b >= 2 entries, got shape {t.shape}")
    if t[0] != 0 or np.any(np.diff(t) <= 0):
        raise ValueError(f"a table must start at 0 and strictly increase, got {t.tolist()}")
    if math.log2(len(t)) > 8 or t[-1] > 255:
        raise ValueError("table values must fit in 8 bits")
    return t.astype(np.int64)
