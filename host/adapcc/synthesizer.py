"""Strategy synthesizer: a MILP (scipy.optimize.milp / HiGHS) for small instances, par-trees after.

MILP family (documented restriction): every sub-collective is a tree toward its root (arborescence
over the GPUs, optionally through ``agg`` nodes as Steiner nodes) with aggregation at every node,
S split evenly over M sub-collectives, and a chunk count from a candidate list (one MILP per count,
the best kept).  On this family the MILP objective equals ``costmodel.evaluate`` exactly:

* load L_ij = sum_m y^m_ij (+ sum_m y^m_ji for AllReduce's broadcast stage), so
  t^m_ij = alpha_ij + beta_ij * C * L_ij is linear in the binaries (Eq. 3);
* h_j = max over tree children (h_i + t_ij) is pinned from both sides with a selector z (Eq. 2),
  which also makes the trees acyclic when alpha > 0;
* the bottleneck B_m >= h_j - h_i on used edges (Eq. 6) and T >= h_root + K * B_m (Eqs. 4-5).

``nic`` relay nodes (a = 0 forced) are optional Steiner nodes too, but they forward every flow
unmerged, so the load on an edge leaving a relay is an integer, not a binary: L = y out of a GPU or
aggregator, and at a relay the loads out equal the loads in (integer flow conservation), each
L_e <= n_gpus * y_e.  Per flow, h only grows by t across a relay, so:

* h at a relay is still the max over its children (a downstream merge takes the max anyway);
* a hop into a relay has bottleneck t_e itself; a hop out of a relay into a merging node j has
  bottleneck h_j - hmin_relay, hmin = the earliest flow's arrival there, bounded above by every
  child's hmin + t (the objective pushes it up to that min, so no selector is needed);
* AllReduce's broadcast stage uses the twin edges (a NIC's send side becomes its receive side)
  and carries the same integer loads: a relay passes on one copy per GPU behind it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from . import strategies
from .costmodel import Network, Strategy, SubCollective, evaluate, tree_routes

US = 1e6   # the MILP works in microseconds so HiGHS' absolute tolerances are meaningful


@dataclass
class MilpResult:
    strategy: Strategy
    objective: float          # seconds, the MILP's own value
    n_chunks: int
    solve_seconds: float
    optimal: bool


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
    """Variables and constraint rows of the tree MILP for one chunk count (see module doc)."""

    def __init__(self, net: Network, primitive: str, total_bytes: float, m: int, n_chunks: int,
                 root: int | None):
        self.net, self.primitive, self.m, self.n_chunks, self.root = net, primitive, m, n_chunks, root
        self.gpus, self.nodes, self.edges = net.gpus(), range(net.n), net.edges()
        self.relays = {i for i in self.nodes if net.kinds[i] == "nic"}
        self.size = total_bytes / m
        self.chunk = self.size / n_chunks
        self.alpha, self.beta = net.alpha * US, net.beta * US
        per_tree = len(self.gpus) if self.relays else 1     # a relay may carry every GPU's flow
        lmax = m * per_tree * (2 if primitive == "allreduce" else 1)
        tmax = max(self.alpha[e] + self.beta[e] * self.chunk * lmax for e in self.edges)
        self.big_h = (net.n + 1) * tmax                    # bound on any chunk ready time
        self.big_t = (n_chunks + 3) * self.big_h + tmax    # bound on any completion time
        md = self.md = _Model()
        ks, big_h = range(m), self.big_h
        self.total = md.var()
        self.y = {(k, e): md.var(0, 1, True) for k in ks for e in self.edges}   # tree edge
        self.z = {(k, e): md.var(0, 1, True) for k in ks for e in self.edges}   # slowest child
        self.r = {(k, g): md.var(0, 1, True) for k in ks for g in self.gpus}    # root
        self.used = {(k, i): md.var(0, 1, True) for k in ks for i in self.nodes
                     if i not in self.gpus}                                        # Steiner node
        self.load = {(k, e): (self.y[(k, e)] if e[0] not in self.relays
                              else md.var(0, per_tree, True)) for k in ks for e in self.edges}
        self.h = {(k, i): md.var(0, big_h) for k in ks for i in self.nodes}     # reduce ready
        self.hmin = {(k, i): md.var(0, big_h) for k in ks for i in self.relays}  # earliest flow
        self.hb = {(k, i): md.var(0, big_h) for k in ks for i in self.nodes}    # bcast arrival
        self.b_red = {k: md.var(0, big_h) for k in ks}
        self.b_bc = {k: md.var(0, big_h) for k in ks}
        self.depth = {k: md.var(0, big_h) for k in ks}
        self.stream = {k: md.var(0, big_h) for k in ks}

    def edge_time(self, i, j, sign=1.0) -> dict:
        """Variable terms of t_ij = alpha_ij + beta_ij * C * load_ij (the constant is separate).

        The load counts Reduce trees on i->j and Broadcast (reversed) trees on i->j, whose Reduce
        edge is the twin one (twin j -> twin i)."""
        terms = {}
        per_unit = self.beta[i, j] * self.chunk * sign
        mirrored = (self.net.twin(j), self.net.twin(i))
        for kk in range(self.m):
            if (kk, (i, j)) in self.load and self.primitive != "broadcast":
                _add(terms, self.load[(kk, (i, j))], per_unit)
            if (kk, mirrored) in self.load and self.primitive != "reduce":
                _add(terms, self.load[(kk, mirrored)], per_unit)
        return terms

    def relay_load_rows(self, k):
        """Integer loads behind relays: what enters a relay leaves it, only on used edges."""
        md, load = self.md, self.load
        for i in self.relays:
            terms = {load[(k, e)]: 1.0 for e in self.edges if e[0] == i}
            for e in self.edges:
                if e[1] == i:
                    _add(terms, load[(k, e)], -1.0)
            md.row(terms, 0, 0)
        for e in self.edges:
            if e[0] in self.relays:
                yv, lv = self.y[(k, e)], load[(k, e)]
                md.row({lv: 1.0, yv: -float(len(self.gpus))}, -np.inf, 0)
                md.row({lv: 1.0, yv: -1.0}, 0, np.inf)

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
            t = self.edge_time(i, j, -1.0)
            lower = {h[(k, j)]: 1.0, h[(k, i)]: -1.0, yv: -big_h}
            upper = {h[(k, j)]: 1.0, h[(k, i)]: -1.0, zv: big_h}
            for v, c in t.items():
                _add(lower, v, c)
                _add(upper, v, c)
            md.row(lower, self.alpha[e] - big_h, np.inf)
            md.row(upper, -np.inf, self.alpha[e] + big_h)
            self.bottleneck_row(k, e, t)

    def earliest(self, k, i) -> int:
        """The earliest flow's ready time at node i: h itself where flows merge."""
        return self.hmin[(k, i)] if i in self.relays else self.h[(k, i)]

    def bottleneck_row(self, k, e, neg_t):
        """Eq. 6 per flow: B covers h_j - h_i on every used hop (see module doc for relays)."""
        md, big_h, (i, j) = self.md, self.big_h, e
        yv, b = self.y[(k, e)], self.b_red[k]
        if j in self.relays:
            # a flow reaches a relay t_ij after it left i: the hop lasts exactly t_ij
            md.row({b: 1.0, **neg_t, yv: -big_h}, self.alpha[e] - big_h, np.inf)
            # ... and the earliest flow there is no later than any child's earliest + t_ij
            terms = {self.hmin[(k, j)]: 1.0, yv: big_h}
            _add(terms, self.earliest(k, i), -1.0)
            for v, c in neg_t.items():
                _add(terms, v, c)
            md.row(terms, -np.inf, self.alpha[e] + big_h)
            return
        terms = {b: 1.0, self.h[(k, j)]: -1.0, yv: -big_h}
        _add(terms, self.earliest(k, i), 1.0)
        md.row(terms, -big_h, np.inf)

    def broadcast_rows(self, k):
        """The reversed tree: arrival grows by t per hop; bottleneck = slowest used hop."""
        md, hb, big_h = self.md, self.hb, self.big_h
        for e in self.edges:
            yv = self.y[(k, e)]
            i, j = self.net.twin(e[0]), self.net.twin(e[1])     # broadcast runs j -> i
            t = self.edge_time(j, i, -1.0)
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
        md, big_t, n_chunks = self.md, self.big_t, self.n_chunks
        md.row({self.stream[k]: 1.0, self.b_red[k]: -1.0}, 0, np.inf)
        md.row({self.stream[k]: 1.0, self.b_bc[k]: -1.0}, 0, np.inf)
        for g in self.gpus:
            r = self.r[(k, g)]
            if self.primitive == "reduce":
                terms = {self.h[(k, g)]: -1.0, self.b_red[k]: -n_chunks}
            elif self.primitive == "broadcast":
                terms = {self.depth[k]: -1.0, self.b_bc[k]: -n_chunks}
            else:
                terms = {self.h[(k, g)]: -1.0, self.depth[k]: -1.0, self.stream[k]: -n_chunks}
            md.row({self.total: 1.0, r: -big_t, **terms}, -big_t, np.inf)

    def symmetry_rows(self):
        """Free roots: order the interchangeable sub-collectives by root index."""
        if self.root is not None:
            return
        for k in range(1, self.m):
            md_terms = {self.r[(k, g)]: float(idx) for idx, g in enumerate(self.gpus)}
            for idx, g in enumerate(self.gpus):
                _add(md_terms, self.r[(k - 1, g)], -float(idx))
            self.md.row(md_terms, 0, np.inf)

    def build(self):
        for k in range(self.m):
            self.tree_rows(k)
            self.relay_load_rows(k)
            self.reduce_rows(k)
            self.broadcast_rows(k)
            self.objective_rows(k)
        self.symmetry_rows()
        return self

    def strategy(self, x) -> Strategy:
        subs = []
        for k in range(self.m):
            tree_root = next(g for g in self.gpus if x[self.r[(k, g)]] > 0.5)
            parent = {e[0]: e[1] for e in self.edges if x[self.y[(k, e)]] > 0.5}
            routes = {g: p for g, p in tree_routes(parent, tree_root).items() if g in self.gpus}
            if self.primitive == "broadcast":
                routes = {g: self.net.reverse_route(p) for g, p in routes.items()}
            subs.append(SubCollective(tree_root, self.size, self.chunk, routes,
                                      frozenset(i for i in self.nodes
                                                if self.net.kinds[i] != "nic")))
        return Strategy(self.primitive, subs)


def solve_milp(net: Network, primitive: str, total_bytes: float, m: int = 1, n_chunks: int = 4,
               root: int | None = None, time_limit: float = 20.0) -> MilpResult | None:
    """Optimal trees for one chunk count; ``root=None`` lets the solver choose each root."""
    if primitive not in ("reduce", "broadcast", "allreduce"):
        raise ValueError(f"MILP primitive {primitive!r} unsupported")
    if root is not None and root not in net.gpus():
        raise ValueError(f"root {root} is not a GPU node")
    model = _TreeMilp(net, primitive, total_bytes, m, n_chunks, root).build()
    started = time.perf_counter()
    res = model.md.solve(model.total, time_limit)
    elapsed = time.perf_counter() - started
    if res.x is None:
        return None
    return MilpResult(model.strategy(res.x), res.fun / US, n_chunks, elapsed, res.status == 0)


CHUNK_COUNTS = (1, 2, 4, 8, 16, 32)


def optimize(net: Network, primitive: str, total_bytes: float, m: int = 1, root: int | None = None,
             chunk_counts=CHUNK_COUNTS, time_limit: float = 20.0) -> MilpResult:
    """Best MILP strategy over the candidate chunk counts."""
    best = None
    for count in chunk_counts:
        result = solve_milp(net, primitive, total_bytes, m, count, root, time_limit)
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
    """

    def __init__(self, primitive: str, total_bytes: float, m: int = 4, root: int | None = None,
                 milp_max_nodes: int = 6, change_tolerance: float = 0.05, servers=None,
                 time_limit: float = 20.0):
        self.primitive, self.total_bytes, self.m, self.root = primitive, total_bytes, m, root
        self.milp_max_nodes, self.change_tolerance = milp_max_nodes, change_tolerance
        self.servers, self.time_limit = servers, time_limit
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
        best = None
        for name, cand in self._heuristic_candidates(net):
            t = evaluate(net, cand).time
            if best is None or t < best.modeled_time:
                best = Synthesis(cand, t, name)
        if net.n <= self.milp_max_nodes:
            res = optimize(net, self.primitive, self.total_bytes, self.m, self.root,
                           time_limit=self.time_limit)
            t = evaluate(net, res.strategy).time
            if t <= best.modeled_time:
                best = Synthesis(res.strategy, t, "milp")
        return best

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


def _signature(strategy: Strategy):
    return tuple((s.root, s.chunk, tuple(sorted((k, tuple(v)) for k, v in s.routes.items())))
                 for s in strategy.subs)
