"""Hand-built strategies (ring/chain, binary tree, star/PS) and the par-trees heuristic.

Every builder returns a ``Strategy`` whose M sub-collectives each move S/M bytes.  Reduce routes are
trees given as parent maps over GPUs (and aggregators); Broadcast uses the same trees with the edges
reversed.  A parent hop with no direct edge (two servers' GPUs when the network has ``nic`` nodes)
is routed through the NICs (``Network.expand_route``), so the NIC links are shared and charged.
"""
from __future__ import annotations

import numpy as np

from .costmodel import Network, Strategy, SubCollective, tree_routes


def _sub_from_routes(net, routes, root, size, chunk, primitive) -> SubCollective:
    """Routes are Reduce paths at GPU/aggregator level: add the NIC relays, reverse for Broadcast."""
    routes = {src: net.expand_route(p) for src, p in routes.items()}
    aggregate = frozenset(i for i in range(net.n) if net.kinds[i] != "nic")
    if primitive == "broadcast":
        routes = {src: net.reverse_route(p) for src, p in routes.items()}
    return SubCollective(root, size, chunk, routes, aggregate)


def _sub_from_parent(net, parent, root, size, chunk, primitive) -> SubCollective:
    return _sub_from_routes(net, tree_routes(parent, root), root, size, chunk, primitive)


def from_parents(net: Network, primitive: str, parents: list[dict[int, int]], roots: list[int],
                 total_bytes: float, n_chunks: int) -> Strategy:
    """A strategy with one tree per sub-collective and S split evenly across them."""
    size = total_bytes / len(parents)
    chunk = size / n_chunks
    return Strategy(primitive, [_sub_from_parent(net, p, r, size, chunk, primitive)
                                for p, r in zip(parents, roots)])


def chain_parents(order: list[int]) -> dict[int, int]:
    """order[0] is the root; every node sends to its predecessor (ring-style pipelined Reduce)."""
    return {order[k]: order[k - 1] for k in range(1, len(order))}


def binary_tree_parents(order: list[int]) -> dict[int, int]:
    """Complete binary tree over ``order`` (children of position i are 2i+1 and 2i+2)."""
    return {order[k]: order[(k - 1) // 2] for k in range(1, len(order))}


def star_parents(root: int, leaves: list[int]) -> dict[int, int]:
    return {leaf: root for leaf in leaves if leaf != root}


def _rotate(gpus: list[int], root: int) -> list[int]:
    k = gpus.index(root)
    return gpus[k:] + gpus[:k]


def ring(net, primitive, root, total_bytes, n_chunks=8, m=1) -> Strategy:
    order = _rotate(net.gpus(), root)
    return from_parents(net, primitive, [chain_parents(order)] * m, [root] * m, total_bytes, n_chunks)


def binary_tree(net, primitive, root, total_bytes, n_chunks=8, m=1) -> Strategy:
    order = _rotate(net.gpus(), root)
    return from_parents(net, primitive, [binary_tree_parents(order)] * m, [root] * m, total_bytes,
                        n_chunks)


def star(net, primitive, root, total_bytes, n_chunks=8, m=1) -> Strategy:
    """Parameter-server style: every GPU talks to the root directly."""
    return from_parents(net, primitive, [star_parents(root, net.gpus())] * m, [root] * m,
                        total_bytes, n_chunks)


def aggregator_star(net, primitive, root, total_bytes, n_chunks=8, m=1) -> Strategy:
    """In-network aggregation: every other GPU sends to the aggregator, which forwards to the root."""
    aggs = [i for i, k in enumerate(net.kinds) if k == "agg"]
    if not aggs:
        raise ValueError("the network has no 'agg' node; build it with make_cluster(aggregator_gbps=...)")
    size = total_bytes / m
    routes = {g: [g, aggs[0], root] for g in net.gpus() if g != root}
    return Strategy(primitive, [_sub_from_routes(net, routes, root, size, size / n_chunks, primitive)
                                for _ in range(m)])


def par_trees(net: Network, primitive: str, total_bytes: float, m: int = 4, n_chunks: int = 8,
              servers: list[list[int]] | None = None, root: int | None = None) -> Strategy:
    """The artifact's default heuristic: parallel binary trees over servers ordered by BDP.

    Each server is represented by its first GPU; servers are sorted by bandwidth-delay product of
    the link to the next server; tree t uses the order rotated by t (so trees get different roots);
    inside a server the GPUs form a chain to the representative.  With ``root`` given (a rooted
    Reduce) every tree is re-rooted there by swapping it into the first position.
    """
    if servers is None:
        servers = [[g] for g in net.gpus()]
    # a server's head is the GPU that talks to other servers; the Reduce root heads its server
    chains = [([root] + [g for g in s if g != root]) if root in s else list(s) for s in servers]
    reps = [c[0] for c in chains]
    bdp = []
    for k, rep in enumerate(reps):
        nxt = reps[(k + 1) % len(reps)]
        a, b = (0.0, 1.0) if nxt == rep else net.hop_alpha_beta(rep, nxt)
        bdp.append(a / b)
    order = [reps[k] for k in np.argsort(-np.asarray(bdp), kind="stable")]
    n_trees = max(1, min(len(reps), m))
    parents, roots = [], []
    for t in range(m):
        rotated = order[t % n_trees:] + order[:t % n_trees]
        if root is not None:
            rotated.remove(root)
            rotated.insert(0, root)
        parent = binary_tree_parents(rotated)
        for chain in chains:
            parent.update(chain_parents(chain))
        parents.append(parent)
        roots.append(rotated[0])
    return from_parents(net, primitive, parents, roots, total_bytes, n_chunks)


def make_uniform_network(n: int, gbps: float = 10.0, alpha: float = 20e-6) -> Network:
    """n GPUs, all pairs linked at the same rate (for building strategies by rank index)."""
    a = np.full((n, n), alpha)
    b = np.full((n, n), 8.0 / (gbps * 1e9))
    np.fill_diagonal(a, np.inf)
    np.fill_diagonal(b, np.inf)
    return Network([f"rank{r}" for r in range(n)], ["gpu"] * n, a, b)
