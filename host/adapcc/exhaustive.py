"""Exhaustive search over the synthesis decisions on tiny graphs: the reference for the MILP.

The decision space is the paper's program restricted the way the MILP is (docs/adapcc.md, "MILP
family"): per sub-collective one tree toward a root over every GPU, through any ``agg`` / ``nic``
nodes as Steiner nodes, S split evenly over the M sub-collectives.  Enumerated:

* every such tree toward every root (or the given root);
* every aggregate-or-forward assignment of its gpu/agg nodes that have children: the root always
  aggregates (it has no successor to forward to), relays always forward, a node without children
  has nothing to aggregate (a = 0; its flag changes no cost);
* every chunk count, shared by the sub-collectives, or (``chunk_per_sub``) one per sub-collective;
* every multiset of M such sub-collectives (they move equal shares, so their order is moot).

Each candidate is scored with ``costmodel.evaluate``, so the optimum found is the cost model's own.
The count grows fast: keep to 3-4 GPUs, one aggregator, M <= 2 (NIC relays only with M = 1).

``exhaustive_split`` lifts one restriction on top, for M = 2: S_m is a decision, the first
sub-collective's share on a grid of k / steps, each sub-collective with its own chunk count
(the paper's S_m and C_m), so the even split's optimum can be compared with the program that
decides it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .costmodel import Network, Strategy, SubCollective, evaluate, tree_routes
from .synthesizer import CHUNK_COUNTS, split_grid


@dataclass
class ExhaustiveResult:
    strategy: Strategy
    time: float                       # seconds, evaluate's value
    n_chunks: tuple[int, ...]         # per sub-collective
    evaluated: int                    # candidates scored
    shares: tuple[float, ...] = ()    # S_m / S per sub-collective (exhaustive_split)


def _paths_into(net: Network, start: int, tree: set[int]) -> list[list[int]]:
    """Simple paths from ``start`` that end at the first node of ``tree`` they reach."""
    found, path = [], [start]

    def extend():
        for nxt in range(net.n):
            if not net.has_edge(path[-1], nxt) or nxt in path:
                continue
            path.append(nxt)
            if nxt in tree:
                found.append(list(path))
            else:
                extend()
            path.pop()

    extend()
    return found


def reduce_trees(net: Network, root: int) -> list[dict[int, int]]:
    """Every tree toward ``root`` spanning the GPUs (parent maps), each exactly once.

    The lowest GPU not yet attached joins by a path to the tree built so far; in a given tree that
    path is unique, so no tree is produced twice.  Steiner nodes only appear inside such paths,
    so each has a child."""
    gpus, trees = net.gpus(), []

    def grow(parent: dict[int, int], tree: set[int]):
        pending = [g for g in gpus if g not in tree]
        if not pending:
            trees.append(dict(parent))
            return
        for path in _paths_into(net, pending[0], tree):
            hops = dict(zip(path, path[1:]))
            grow({**parent, **hops}, tree | set(path))

    grow({}, {root})
    return trees


def aggregation_choices(net: Network, parent: dict[int, int], root: int) -> list[frozenset]:
    """Every a assignment that can change a cost: subsets of the non-root gpu/agg nodes with
    children, the root always included."""
    with_children = {p for p in parent.values() if p != root and net.kinds[p] != "nic"}
    free = sorted(with_children)
    return [frozenset({root, *chosen}) for r in range(len(free) + 1)
            for chosen in itertools.combinations(free, r)]


def tree_shapes(net: Network, primitive: str, root: int, parent: dict[int, int],
                forwarding: bool = True) -> list[tuple[int, dict, frozenset]]:
    """(root, routes, aggregating set) of one tree, for each aggregation choice."""
    routes = {g: p for g, p in tree_routes(parent, root).items() if g in net.gpus()}
    if primitive == "broadcast":                # no aggregation in a Broadcast (the paper's a = 0)
        return [(root, {g: net.reverse_route(p) for g, p in routes.items()}, frozenset())]
    choices = (aggregation_choices(net, parent, root) if forwarding else
               [frozenset(i for i in range(net.n) if net.kinds[i] != "nic")])
    return [(root, routes, aggregate) for aggregate in choices]


def sub_collective_shapes(net: Network, primitive: str, root: int | None = None,
                          forwarding: bool = True) -> list[tuple[int, dict, frozenset]]:
    """(root, routes, aggregating set) for every tree and aggregation choice."""
    return [shape for tree_root in ([root] if root is not None else net.gpus())
            for parent in reduce_trees(net, tree_root)
            for shape in tree_shapes(net, primitive, tree_root, parent, forwarding)]


def exhaustive(net: Network, primitive: str, total_bytes: float, m: int = 1,
               root: int | None = None, chunk_counts=CHUNK_COUNTS,
               forwarding: bool = True, chunk_per_sub: bool = False) -> ExhaustiveResult:
    """The cheapest strategy (by ``evaluate``) over the whole enumerated space (module doc)."""
    size = total_bytes / m
    shapes = sub_collective_shapes(net, primitive, root, forwarding)
    if chunk_per_sub:
        options = [(shape, count) for shape in shapes for count in chunk_counts]
        candidates = (list(pick) for pick in itertools.combinations_with_replacement(options, m))
    else:
        candidates = ([(shape, count) for shape in pick]
                      for count in chunk_counts
                      for pick in itertools.combinations_with_replacement(shapes, m))
    best, evaluated = None, 0
    for pick in candidates:
        subs = [SubCollective(r, size, size / count, routes, aggregate)
                for (r, routes, aggregate), count in pick]
        strategy = Strategy(primitive, subs)
        t = evaluate(net, strategy).time
        evaluated += 1
        if best is None or t < best.time:
            best = ExhaustiveResult(strategy, t, tuple(c for _, c in pick), 0)
    best.evaluated = evaluated
    return best


def exhaustive_split(net: Network, primitive: str, total_bytes: float, root: int | None = None,
                     steps: int = 8, chunk_counts=CHUNK_COUNTS,
                     forwarding: bool = True) -> ExhaustiveResult:
    """The cheapest M = 2 strategy when the split is decided too: sub-collective 0 moves
    k / steps of S (k = 1 .. steps / 2; the rest is the mirror image), sub-collective 1 the
    rest, each with any tree, aggregation set and chunk count."""
    shapes = sub_collective_shapes(net, primitive, root, forwarding)
    options = [(shape, count) for shape in shapes for count in chunk_counts]
    best, evaluated = None, 0
    for shares in split_grid(steps):
        sizes = tuple(total_bytes * share for share in shares)
        pairs = (itertools.combinations_with_replacement(options, 2) if shares[0] == shares[1]
                 else itertools.product(options, repeat=2))
        for pick in pairs:
            subs = [SubCollective(r, size, size / count, routes, aggregate)
                    for ((r, routes, aggregate), count), size in zip(pick, sizes)]
            t = evaluate(net, Strategy(primitive, subs)).time
            evaluated += 1
            if best is None or t < best.time:
                best = ExhaustiveResult(Strategy(primitive, subs), t,
                                        tuple(c for _, c in pick), 0, shares)
    best.evaluated = evaluated
    return best
