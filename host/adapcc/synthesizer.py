"""Strategy synthesizer: a MILP (scipy.optimize.milp / HiGHS) for small instances, par-trees after.

What the MILP decides (the paper's program, Sec. IV-D, less the restrictions listed below): per
sub-collective a tree toward its root (the root too when ``root=None``) over the GPUs, through
``agg`` and ``nic`` nodes as optional Steiner nodes; per sub-collective and gpu/agg node the
aggregation flag a (1: merge every flow there, Eq. 2's max; 0: forward every flow unmerged); and
the chunk count, from a candidate list, one MILP per choice (shared by the sub-collectives, or
with ``chunk_per_sub`` one per sub-collective, the paper's C_m).  Its objective equals
``costmodel.evaluate`` on the strategy it returns (the tests check this, and check the optimum
against an exhaustive search on tiny graphs, ``exhaustive.py``).

Restrictions kept (docs/adapcc.md, "MILP family"): one tree per sub-collective (the paper routes
each flow with its own x^f), S split evenly over the M sub-collectives (for M = 2, ``split_steps``
decides the split on a grid instead, one MILP per split), chunk counts from a list, Eq. 5 as
written.  The root always aggregates (it has no successor to forward to), ``nic`` relays
never do (a = 0 forced), a node without children has nothing to aggregate (a = 0), and a
Broadcast aggregates nowhere (the paper's a = 0 for primitives without aggregation).

Linearisation (times in units of the slowest possible hop / 1000, see SLOWEST_HOP):

* Reduce-stage load L_e: integer, nonzero only on used edges (L_e <= n_gpus * y_e); out of a node
  with a = 1 it is 1; out of a forwarding node (a relay, or a = 0) it is the node's own flow (1 at
  a non-root GPU) plus every load entering (big-M on a).  Broadcast-stage copies: 1 into a node
  that holds the data, the copies behind it into a relay.  So t^k_ij = alpha_ij + beta_ij * C_k *
  (sum of loads and copies over the sub-collectives) is linear (Eq. 3);
* h_j = max over tree children (h_i + t_ij) is pinned from both sides with a selector z (Eq. 2;
  for a forwarding node it is the latest flow's arrival), which also makes the trees acyclic
  when alpha > 0;
* hmin_i, the earliest flow's ready time at i: h_i where i merges, 0 at a forwarding GPU (its own
  chunk is ready at once), the earliest child's hmin + t at a forwarding aggregator or relay.
  Only upper bounds: the objective raises hmin to the smallest of them;
* Eq. 6 per hop: a flow not merged at j takes exactly t_ij (B >= t_ij); into a merging j the
  slowest flow waits h_j - hmin_i (B >= h_j - hmin_i);
* T >= h_root + K * B (Eqs. 4-5, the root merges); AllReduce adds the broadcast depth and takes
  the slower stage's bottleneck; its broadcast stage runs the twin edges (a NIC's send side
  becomes its receive side).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from . import strategies
from .costmodel import Network, Strategy, SubCollective, evaluate, tree_routes

# The MILP measures time in units where the slowest possible hop takes SLOWEST_HOP units.  HiGHS'
# tolerances are absolute: in fixed microseconds a 256 MB instance has big-M terms of 1e7 and
# HiGHS' presolve then returned wrong optima or crashed; in seconds an 8 MB one would sit at the
# tolerance.  Scaling per model keeps every instance in the same numeric range.
SLOWEST_HOP = 1e3


@dataclass
class MilpResult:
    strategy: Strategy
    objective: float          # seconds, the MILP's own value
    n_chunks: int | tuple[int, ...]   # shared by the sub-collectives, or one each
    solve_seconds: float
    optimal: bool
    shares: tuple[float, ...] = ()    # S_m / S per sub-collective


class _Model:
    """Small helper that collects variables and sparse constraint rows."""

    def __init__(self):
        self.lb, self.ub, self.integral = [], [], []
        self.rows, self.cols, self.vals, self.rlo, self.rhi = [], [], [], [], []

    def var(self, lb=0.0, ub=np.inf, integer=False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integral.append(1 if integer else 0)
        return len(self.lb) - 1

    def row(self, terms: dict[int, float], lo=-np.inf, hi=np.inf):
        r = len(self.rlo)
        for c, v in terms.items():
            if v != 0:
                self.rows.append(r)
                self.cols.append(c)
                self.vals.append(v)
        self.rlo.append(lo)
        self.rhi.append(hi)

    def solve(self, objective_var: int, time_limit: float):
        n = len(self.lb)
        c = np.zeros(n)
        c[objective_var] = 1.0
        a = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.rlo), n)).tocsr()
        args = dict(constraints=LinearConstraint(a, self.rlo, self.rhi),
                    integrality=np.asarray(self.integral), bounds=Bounds(self.lb, self.ub))
        options = {"time_limit": time_limit, "disp": False}
        res = milp(c, **args, options=options)
        if res.status == 4:
            # HiGHS' presolve sometimes fails on the big-M rows of relay (nic) models with
            # "Solve error"; the same model solves without it
            res = milp(c, **args, options={**options, "presolve": False})
        return res


def _add(terms: dict, var: int, coef: float):
    terms[var] = terms.get(var, 0.0) + coef


class _TreeMilp:
    """Variables and constraint rows of the tree MILP for fixed chunk counts (module doc)."""

    def __init__(self, net: Network, primitive: str, total_bytes: float, m: int,
                 n_chunks: int | tuple[int, ...], root: int | None, forwarding: bool = True,
                 shares: tuple[float, ...] | None = None):
        self.net, self.primitive, self.m, self.root = net, primitive, m, root
        self.counts = tuple(n_chunks) if isinstance(n_chunks, (tuple, list)) else (n_chunks,) * m
        if len(self.counts) != m:
            raise ValueError(f"give one chunk count per sub-collective ({m})")
        self.gpus, self.nodes, self.edges = net.gpus(), range(net.n), net.edges()
        self.relays = {i for i in self.nodes if net.kinds[i] == "nic"}
        self.mergers = [i for i in self.nodes if i not in self.relays]      # gpu / agg nodes
        # a Broadcast has nothing to aggregate (the paper's a = 0), so a is decided only when the
        # primitive has a Reduce stage
        self.decides = forwarding and primitive != "broadcast"
        self.shares = tuple(shares) if shares is not None else (1.0 / m,) * m
        if len(self.shares) != m or abs(sum(self.shares) - 1) > 1e-9 or min(self.shares) <= 0:
            raise ValueError(f"shares: give {m} positive shares of S that sum to 1, got {shares}")
        self.sizes = [total_bytes * share for share in self.shares]
        self.chunks = [size / count for size, count in zip(self.sizes, self.counts)]
        # an edge may carry every GPU's flow behind a relay or a forwarding node
        self.per_tree = len(self.gpus) if (self.relays or self.decides) else 1
        lmax = m * self.per_tree * (2 if primitive == "allreduce" else 1)
        longest = sorted((net.alpha[e] + net.beta[e] * max(self.chunks) * lmax
                          for e in self.edges), reverse=True)
        self.scale = SLOWEST_HOP / longest[0]                    # model time units per second
        self.alpha, self.beta = net.alpha * self.scale, net.beta * self.scale
        # a chunk's path has at most n - 1 distinct edges, and a big-M row adds one hop to it: the
        # smallest safe big-M keeps the integrality tolerance's leak into the objective small
        self.big_h = (sum(longest[:net.n - 1]) + longest[0]) * self.scale
        self.md = _Model()
        self.total = self.md.var()
        self.tree_variables()
        self.load_variables()
        self.time_variables()

    def tree_variables(self):
        md, ks = self.md, range(self.m)
        self.y = {(k, e): md.var(0, 1, True) for k in ks for e in self.edges}   # tree edge
        self.z = {(k, e): md.var(0, 1, True) for k in ks for e in self.edges}   # slowest child
        self.r = {(k, g): md.var(0, 1, True) for k in ks for g in self.gpus}    # root
        self.used = {(k, i): md.var(0, 1, True) for k in ks for i in self.nodes
                     if i not in self.gpus}                                        # Steiner node
        self.a = ({(k, i): md.var(0, 1, True) for k in ks for i in self.mergers}  # aggregates
                  if self.decides else {})

    def load_variables(self):
        md, ks = self.md, range(self.m)
        # copies per edge of the broadcast stage (Reduce edge e, run reversed): one into a node
        # that holds the data, the copies behind it into a relay
        needs_copies = self.primitive != "reduce" or not self.decides
        self.copies = {(k, e): (self.y[(k, e)] if e[0] not in self.relays
                                else md.var(0, self.per_tree, True))
                       for k in ks for e in self.edges} if needs_copies else {}
        # Reduce-stage flows per edge: with every gpu/agg node aggregating they equal the copies
        self.load = ({(k, e): md.var(0, self.per_tree, True) for k in ks for e in self.edges}
                     if self.decides else self.copies)

    def time_variables(self):
        md, ks, big_h = self.md, range(self.m), self.big_h
        self.h = {(k, i): md.var(0, big_h) for k in ks for i in self.nodes}     # reduce ready
        self.hmin = {(k, i): md.var(0, big_h) for k in ks for i in self.nodes
                     if self.unmerged(i)}                                          # earliest flow
        self.hb = {(k, i): md.var(0, big_h) for k in ks for i in self.nodes}    # bcast arrival
        self.b_red = {k: md.var(0, big_h) for k in ks}
        self.b_bc = {k: md.var(0, big_h) for k in ks}
        self.depth = {k: md.var(0, big_h) for k in ks}
        self.stream = {k: md.var(0, big_h) for k in ks}
        self.h_root = {k: md.var(0, big_h) for k in ks}

    def unmerged(self, i) -> bool:
        """Whether flows may leave node i at different times (a relay, or a = 0 possible)."""
        return i in self.relays or self.decides

    def edge_time(self, k, i, j, sign=1.0) -> dict:
        """Variable terms of sub-collective k's t_ij = alpha_ij + beta_ij * C_k * load_ij (the
        constant is separate).

        The load counts every sub-collective's Reduce flows on i->j and Broadcast copies on i->j,
        whose Reduce edge is the twin one (twin j -> twin i)."""
        terms = {}
        per_unit = self.beta[i, j] * self.chunks[k] * sign
        mirrored = (self.net.twin(j), self.net.twin(i))
        for kk in range(self.m):
            if (kk, (i, j)) in self.load and self.primitive != "broadcast":
                _add(terms, self.load[(kk, (i, j))], per_unit)
            if (kk, mirrored) in self.copies and self.primitive != "reduce":
                _add(terms, self.copies[(kk, mirrored)], per_unit)
        return terms

    def nonzero_on_used_edges(self, loads, k, e):
        """1 <= load <= n_gpus on a used edge, 0 on any other."""
        yv, lv = self.y[(k, e)], loads[(k, e)]
        self.md.row({lv: 1.0, yv: -float(self.per_tree)}, -np.inf, 0)
        self.md.row({lv: 1.0, yv: -1.0}, 0, np.inf)

    def out_minus_in(self, loads, k, i) -> dict:
        """Terms of (load leaving node i) - (load entering it)."""
        terms = {loads[(k, e)]: 1.0 for e in self.edges if e[0] == i}
        for e in self.edges:
            if e[1] == i:
                _add(terms, loads[(k, e)], -1.0)
        return terms

    def copies_rows(self, k):
        """Integer copies behind relays: what enters a relay leaves it, only on used edges."""
        for i in self.relays:
            self.md.row(self.out_minus_in(self.copies, k, i), 0, 0)
        for e in self.edges:
            if e[0] in self.relays:
                self.nonzero_on_used_edges(self.copies, k, e)

    def reduce_load_rows(self, k):
        """Reduce loads with a decided: out of an aggregating node one flow; out of a forwarding
        one (a relay, or a = 0) its own flow (a non-root GPU has one) plus every flow entering."""
        md, load, big = self.md, self.load, float(self.per_tree + 1)
        for e in self.edges:
            self.nonzero_on_used_edges(load, k, e)
        for i in self.relays:
            md.row(self.out_minus_in(load, k, i), 0, 0)
        for i in self.mergers:
            a = self.a[(k, i)]
            # a = 1: the single used out edge carries 1 (it already carries >= 1)
            one = {load[(k, e)]: 1.0 for e in self.edges if e[0] == i}
            for e in self.edges:
                if e[0] == i:
                    _add(one, self.y[(k, e)], -1.0)
            md.row({**one, a: big}, -np.inf, big)
            # a = 0: out - in = own flow (1 - r for a GPU, 0 for an aggregator)
            passed = self.out_minus_in(load, k, i)
            own = 0.0
            if i in self.gpus:
                _add(passed, self.r[(k, i)], 1.0)
                own = 1.0
            md.row({**passed, a: -big}, -np.inf, own)
            md.row({**passed, a: big}, own, np.inf)

    def aggregation_rows(self, k):
        """The root aggregates (it has no successor to forward to); a node without children has
        nothing to aggregate (a = 0, the paper's hasKernel rule (1))."""
        md = self.md
        for i in self.mergers:
            a = self.a[(k, i)]
            children = {self.y[(k, e)]: -1.0 for e in self.edges if e[1] == i}
            if i in self.gpus:
                md.row({a: 1.0, self.r[(k, i)]: -1.0}, 0, np.inf)
                md.row({a: 1.0, self.r[(k, i)]: -1.0, **children}, -np.inf, 0)
            else:
                md.row({a: 1.0, **children}, -np.inf, 0)

    def tree_rows(self, k):
        """Each GPU has one parent unless it is the root; used Steiner nodes relay."""
        md, y = self.md, self.y
        md.row({self.r[(k, g)]: 1.0 for g in self.gpus}, 1, 1)
        if self.root is not None:
            md.row({self.r[(k, self.root)]: 1.0}, 1, 1)
        for i in self.nodes:
            out = {y[(k, e)]: 1.0 for e in self.edges if e[0] == i}
            if i in self.gpus:
                _add(out, self.r[(k, i)], 1.0)
                md.row(out, 1, 1)
                continue
            used = self.used[(k, i)]
            _add(out, used, -1.0)
            md.row(out, 0, 0)                                  # one parent when used
            into = {y[(k, e)]: 1.0 for e in self.edges if e[1] == i}
            _add(into, used, -1.0)
            md.row(into, 0, np.inf)                            # ... and at least one child
            for e in self.edges:
                if e[1] == i:
                    md.row({used: 1.0, y[(k, e)]: -1.0}, 0, np.inf)

    def reduce_rows(self, k):
        """Eq. 2 pinned from both sides: h_j = max over children (h_i + t_ij), leaves 0."""
        md, y, z, h, big_h = self.md, self.y, self.z, self.h, self.big_h
        for i in self.nodes:
            zin = {z[(k, e)]: 1.0 for e in self.edges if e[1] == i}
            md.row(zin, -np.inf, 1)
            for e in self.edges:
                if e[1] == i:
                    md.row({**zin, y[(k, e)]: -1.0}, 0, np.inf)       # a child is selected
            md.row({h[(k, i)]: 1.0, **{v: -big_h for v in zin}}, -np.inf, 0)
        for e in self.edges:
            i, j = e
            yv, zv = y[(k, e)], z[(k, e)]
            md.row({zv: 1.0, yv: -1.0}, -np.inf, 0)
            t = self.edge_time(k, i, j, -1.0)
            lower = {h[(k, j)]: 1.0, h[(k, i)]: -1.0, yv: -big_h}
            upper = {h[(k, j)]: 1.0, h[(k, i)]: -1.0, zv: big_h}
            for v, c in t.items():
                _add(lower, v, c)
                _add(upper, v, c)
            md.row(lower, self.alpha[e] - big_h, np.inf)
            md.row(upper, -np.inf, self.alpha[e] + big_h)
            self.bottleneck_row(k, e, t)

    def earliest(self, k, i) -> int:
        """The earliest flow's ready time at node i: h itself where every flow merges."""
        return self.hmin[(k, i)] if (k, i) in self.hmin else self.h[(k, i)]

    def earliest_rows(self, k):
        """hmin of a gpu/agg node: h when it aggregates; when it forwards, 0 at a GPU (its own
        chunk is ready at once) and the earliest child's arrival at an aggregator (per edge in
        bottleneck_row).  Upper bounds only: the objective raises hmin to the smallest."""
        for i in self.mergers:
            hmin = self.hmin[(k, i)]
            self.md.row({hmin: 1.0, self.h[(k, i)]: -1.0}, -np.inf, 0)
            if i in self.gpus:
                self.md.row({hmin: 1.0, self.a[(k, i)]: -self.big_h}, -np.inf, 0)

    def bottleneck_row(self, k, e, neg_t):
        """Eq. 6 per flow: B covers h_j - h_i on every used hop (see module doc for relays)."""
        md, big_h, (i, j) = self.md, self.big_h, e
        yv, b = self.y[(k, e)], self.b_red[k]
        if self.unmerged(j):
            # a flow not merged at j reaches it t_ij after it left i: the hop lasts exactly t_ij
            lasts = {b: 1.0, yv: -big_h}
            for v, c in neg_t.items():
                _add(lasts, v, c)
            md.row(lasts, self.alpha[e] - big_h, np.inf)
            if j not in self.gpus:
                # ... and the earliest flow at j is no later than any child's earliest + t_ij
                terms = {self.hmin[(k, j)]: 1.0}
                _add(terms, yv, big_h)
                _add(terms, self.earliest(k, i), -1.0)
                if j in self.mergers:
                    _add(terms, self.a[(k, j)], -big_h)      # an aggregating j: hmin = h_j
                for v, c in neg_t.items():
                    _add(terms, v, c)
                md.row(terms, -np.inf, self.alpha[e] + big_h)
        if j in self.relays:
            return
        # merged at j (a = 1): every flow entering waits there for the last one
        terms = {b: 1.0, self.h[(k, j)]: -1.0}
        _add(terms, yv, -big_h)
        _add(terms, self.earliest(k, i), 1.0)
        low = -big_h
        if self.decides:
            _add(terms, self.a[(k, j)], -big_h)
            low -= big_h
        md.row(terms, low, np.inf)

    def broadcast_rows(self, k):
        """The reversed tree: arrival grows by t per hop; bottleneck = slowest used hop."""
        md, hb, big_h = self.md, self.hb, self.big_h
        for e in self.edges:
            yv = self.y[(k, e)]
            i, j = self.net.twin(e[0]), self.net.twin(e[1])     # broadcast runs j -> i
            t = self.edge_time(k, j, i, -1.0)
            arrive = {hb[(k, i)]: 1.0, hb[(k, j)]: -1.0, yv: -big_h}
            slowest = {self.b_bc[k]: 1.0, yv: -big_h}
            for v, c in t.items():
                _add(arrive, v, c)
                _add(slowest, v, c)
            md.row(arrive, self.alpha[j, i] - big_h, np.inf)
            md.row(slowest, self.alpha[j, i] - big_h, np.inf)
        for i in self.nodes:
            md.row({self.depth[k]: 1.0, hb[(k, i)]: -1.0}, 0, np.inf)
        for g in self.gpus:
            md.row({hb[(k, g)]: 1.0, self.r[(k, g)]: big_h}, -np.inf, big_h)   # root at 0

    def objective_rows(self, k):
        """Eqs. 4-5 at the root: T >= h_root (+ depth) + K * bottleneck."""
        md, n_chunks, h_root = self.md, self.counts[k], self.h_root[k]
        md.row({self.stream[k]: 1.0, self.b_red[k]: -1.0}, 0, np.inf)
        md.row({self.stream[k]: 1.0, self.b_bc[k]: -1.0}, 0, np.inf)
        for g in self.gpus:        # h_root >= h_g at the root (h_g <= big_h elsewhere)
            md.row({h_root: 1.0, self.h[(k, g)]: -1.0, self.r[(k, g)]: -self.big_h},
                   -self.big_h, np.inf)
        if self.primitive == "reduce":
            terms = {h_root: -1.0, self.b_red[k]: -n_chunks}
        elif self.primitive == "broadcast":
            terms = {self.depth[k]: -1.0, self.b_bc[k]: -n_chunks}
        else:
            terms = {h_root: -1.0, self.depth[k]: -1.0, self.stream[k]: -n_chunks}
        md.row({self.total: 1.0, **terms}, 0, np.inf)

    def symmetry_rows(self):
        """Free roots: order interchangeable sub-collectives (equal chunk counts) by root index."""
        if self.root is not None:
            return
        for k in range(1, self.m):
            if self.counts[k] != self.counts[k - 1]:
                continue
            md_terms = {self.r[(k, g)]: float(idx) for idx, g in enumerate(self.gpus)}
            for idx, g in enumerate(self.gpus):
                _add(md_terms, self.r[(k - 1, g)], -float(idx))
            self.md.row(md_terms, 0, np.inf)

    def build(self):
        for k in range(self.m):
            self.tree_rows(k)
            if self.copies:
                self.copies_rows(k)
            if self.decides:
                self.reduce_load_rows(k)
                self.aggregation_rows(k)
                self.earliest_rows(k)
            self.reduce_rows(k)
            self.broadcast_rows(k)
            self.objective_rows(k)
        self.symmetry_rows()
        return self

    def pin(self, k, root, parent, aggregate):
        """Fix sub-collective k's root, tree (parent map) and aggregating set, so that the MILP
        only times them: how the tests compare its value with ``evaluate`` shape by shape."""
        md = self.md

        def fix(var, value):
            md.lb[var] = md.ub[var] = float(value)

        for e in self.edges:
            fix(self.y[(k, e)], parent.get(e[0]) == e[1])
        for g in self.gpus:
            fix(self.r[(k, g)], g == root)
        for (kk, i), var in self.used.items():
            if kk == k:
                fix(var, i in parent)
        with_children = set(parent.values())
        if self.decides:
            for i in self.mergers:
                fix(self.a[(k, i)], i == root or (i in aggregate and i in with_children))
        return self

    def strategy(self, x) -> Strategy:
        subs = []
        for k in range(self.m):
            tree_root = next(g for g in self.gpus if x[self.r[(k, g)]] > 0.5)
            parent = {e[0]: e[1] for e in self.edges if x[self.y[(k, e)]] > 0.5}
            routes = {g: p for g, p in tree_routes(parent, tree_root).items() if g in self.gpus}
            if self.primitive == "broadcast":
                routes = {g: self.net.reverse_route(p) for g, p in routes.items()}
            subs.append(SubCollective(tree_root, self.sizes[k], self.chunks[k], routes,
                                      self.aggregating(x, k)))
        return Strategy(self.primitive, subs)

    def aggregating(self, x, k) -> frozenset:
        """The a = 1 nodes: as decided, none for a Broadcast, every gpu/agg node when forced."""
        if self.primitive == "broadcast":
            return frozenset()
        if not self.decides:
            return frozenset(self.mergers)
        return frozenset(i for i in self.mergers if x[self.a[(k, i)]] > 0.5)


def solve_milp(net: Network, primitive: str, total_bytes: float, m: int = 1,
               n_chunks: int | tuple[int, ...] = 4, root: int | None = None,
               time_limit: float = 20.0, forwarding: bool = True,
               shares: tuple[float, ...] | None = None) -> MilpResult | None:
    """Optimal trees and aggregation flags for fixed chunk counts (one shared count, or a tuple
    with one per sub-collective) and a fixed split (shares of S, default even); ``root=None``
    lets the solver choose each root; ``forwarding=False`` forces a = 1 at every gpu/agg node
    (the older family)."""
    if primitive not in ("reduce", "broadcast", "allreduce"):
        raise ValueError(f"MILP primitive {primitive!r} unsupported")
    if root is not None and root not in net.gpus():
        raise ValueError(f"root {root} is not a GPU node")
    model = _TreeMilp(net, primitive, total_bytes, m, n_chunks, root, forwarding, shares).build()
    started = time.perf_counter()
    res = model.md.solve(model.total, time_limit)
    elapsed = time.perf_counter() - started
    if res.x is None:
        return None
    return MilpResult(model.strategy(res.x), res.fun / model.scale, n_chunks, elapsed,
                      res.status == 0, model.shares)


CHUNK_COUNTS = (1, 2, 4, 8, 16, 32)


def chunk_choices(m: int, chunk_counts=CHUNK_COUNTS, chunk_per_sub: bool = False) -> list:
    """The chunk counts to solve for: each shared count, or (``chunk_per_sub``, the paper's C_m)
    every nondecreasing tuple; sub-collectives that differ only in order are the same strategy."""
    if not chunk_per_sub:
        return list(chunk_counts)
    return list(itertools.combinations_with_replacement(sorted(chunk_counts), m))


def split_grid(steps: int) -> list[tuple[float, float]]:
    """The splits of S between two sub-collectives on a grid of 1 / steps: k / steps for the
    first, k = 1 .. steps / 2 (the rest mirror these)."""
    return [(k / steps, 1 - k / steps) for k in range(1, steps // 2 + 1)]


def split_choices(m: int, steps: int | None, chunk_counts=CHUNK_COUNTS,
                  chunk_per_sub: bool = False) -> list:
    """(shares, counts) to solve for: the even split with chunk_choices, or (``steps``, M = 2)
    every split k / steps of S, k = 1 .. steps / 2 (the rest mirror these), with the counts
    in both orders where the shares differ."""
    if steps is None:
        return [(None, counts) for counts in chunk_choices(m, chunk_counts, chunk_per_sub)]
    if m != 2 or steps < 2:
        raise ValueError(f"split_steps decides the split of M = 2 on a grid of >= 2 steps; "
                         f"got M = {m}, steps = {steps}")
    out = []
    for shares in split_grid(steps):
        counts = (chunk_choices(m, chunk_counts, chunk_per_sub)
                  if shares[0] == shares[1] or not chunk_per_sub
                  else itertools.product(sorted(chunk_counts), repeat=2))
        out += [(shares, c) for c in counts]
    return out


def optimize(net: Network, primitive: str, total_bytes: float, m: int = 1, root: int | None = None,
             chunk_counts=CHUNK_COUNTS, time_limit: float = 20.0, forwarding: bool = True,
             chunk_per_sub: bool = False, split_steps: int | None = None) -> MilpResult:
    """Best MILP strategy over the candidate chunk counts (one MILP per choice) and, with
    split_steps (M = 2), over the splits of S on that grid."""
    best = None
    for shares, counts in split_choices(m, split_steps, chunk_counts, chunk_per_sub):
        result = solve_milp(net, primitive, total_bytes, m, counts, root, time_limit, forwarding,
                            shares)
        if result is not None and (best is None or result.objective < best.objective):
            best = result
    if best is None:
        raise RuntimeError("the MILP found no feasible strategy (is the graph connected?)")
    return best


@dataclass
class Synthesis:
    strategy: Strategy
    modeled_time: float
    method: str


class Synthesizer:
    """Rank-0 synthesizer: re-solves when the profile changes, without restarting anything.

    ``milp_max_nodes`` picks the MILP for small graphs; larger ones get par-trees (best chunk count).
    ``tie_tolerance``: candidates whose modelled time is within this fraction of the best are
    taken as tied, and the one with the fewest flows into one node wins (then the faster). A
    pairwise profile cannot see that a node's flows share its own link, so a star and a tree
    bound by the same slow link model alike while the star loads its root's link once per
    child; 0 (the default) keeps the fastest, the MILP on an exact tie.
    """

    def __init__(self, primitive: str, total_bytes: float, m: int = 4, root: int | None = None,
                 milp_max_nodes: int = 6, change_tolerance: float = 0.05, servers=None,
                 time_limit: float = 20.0, tie_tolerance: float = 0.0):
        if tie_tolerance < 0:
            raise ValueError(f"tie_tolerance must be >= 0, got {tie_tolerance}")
        self.primitive, self.total_bytes, self.m, self.root = primitive, total_bytes, m, root
        self.milp_max_nodes, self.change_tolerance = milp_max_nodes, change_tolerance
        self.servers, self.time_limit = servers, time_limit
        self.tie_tolerance = tie_tolerance
        self.network: Network | None = None
        self.current: Synthesis | None = None

    def _heuristic_candidates(self, net: Network):
        """par-trees plus the hand-built shapes, every chunk count: the large-graph fallback."""
        root = self.root if self.root is not None else net.gpus()[0]
        for count in CHUNK_COUNTS:
            yield "par-trees", strategies.par_trees(net, self.primitive, self.total_bytes, self.m,
                                                    count, self.servers, self.root)
            for name, build in (("ring", strategies.ring), ("binary-tree", strategies.binary_tree),
                                ("star", strategies.star)):
                yield name, build(net, self.primitive, root, self.total_bytes, count, self.m)

    def synthesize(self, net: Network) -> Synthesis:
        found = [Synthesis(cand, evaluate(net, cand).time, name)
                 for name, cand in self._heuristic_candidates(net)]
        if net.n <= self.milp_max_nodes:
            res = optimize(net, self.primitive, self.total_bytes, self.m, self.root,
                           time_limit=self.time_limit)
            # first in the list: the MILP wins an exact tie with a heuristic
            found.insert(0, Synthesis(res.strategy, evaluate(net, res.strategy).time, "milp"))
        fastest = min(found, key=lambda c: c.modeled_time)
        if not self.tie_tolerance:
            return fastest
        tied = [c for c in found
                if c.modeled_time <= fastest.modeled_time * (1 + self.tie_tolerance)]
        return min(tied, key=lambda c: (max_fan_in(c.strategy), c.modeled_time))

    def _changed(self, net: Network) -> bool:
        old = self.network
        if old is None or old.n != net.n:
            return True
        finite = np.isfinite(old.beta) & np.isfinite(net.beta)
        if not np.array_equal(np.isfinite(old.beta), np.isfinite(net.beta)):
            return True
        rel_b = np.abs(net.beta[finite] - old.beta[finite]) / old.beta[finite]
        rel_a = np.abs(net.alpha[finite] - old.alpha[finite]) / np.maximum(old.alpha[finite], 1e-12)
        return bool(rel_b.max(initial=0) > self.change_tolerance
                    or rel_a.max(initial=0) > self.change_tolerance)

    def update_profile(self, net: Network) -> bool:
        """Feed a new profile; returns True when the strategy was re-synthesized and changed."""
        if not self._changed(net):
            return False
        self.network = net
        new = self.synthesize(net)
        changed = self.current is None or _signature(new.strategy) != _signature(self.current.strategy)
        self.current = new
        return changed


def max_fan_in(strategy: Strategy) -> int:
    """The most distinct senders into one node in any sub-collective (a star's root: all)."""
    worst = 0
    for sub in strategy.subs:
        senders: dict[int, set[int]] = {}
        for path in sub.routes.values():
            for u, v in zip(path, path[1:]):
                senders.setdefault(v, set()).add(u)
        worst = max([worst] + [len(s) for s in senders.values()])
    return worst


def _signature(strategy: Strategy):
    return tuple((s.root, s.chunk, tuple(sorted((k, tuple(v)) for k, v in s.routes.items())),
                  tuple(sorted(s.aggregate))) for s in strategy.subs)
