"""AdapCC cost model (Eqs. 1-6 of the paper) and the strategy representation.

A *network* is a directed graph of nodes with an alpha-beta cost per edge.  Node kinds:

* ``gpu``  - a worker: holds a tensor, may aggregate (a=1) and may be a root;
* ``agg``  - an in-network aggregator (switch): holds no data, may aggregate;
* ``nic``  - a pure relay: holds no data, never aggregates (a=0 forced) and never replicates, so
  every flow crossing it keeps its own share of the links behind it.

``make_cluster(nic_nodes=True)`` models each server's NIC as ``nic`` nodes: a send side ``tx`` and a
receive side ``rx`` (the NIC is full duplex), each behind its port (``out`` / ``in``).  GPU -> tx
over the intra-server link, tx -> out at the NIC rate (every byte the server sends crosses it),
out -> other servers' in ports (the paper's NIC-NIC link: the network latency, and a non-blocking
core far faster than any NIC, so the ports are what limits), in -> rx at the NIC rate (every byte
the server receives), rx -> GPU.  Splitting the NIC
keeps every route a simple path when a chain enters a server at one GPU and leaves it from another;
the port links make a server's traffic to *different* servers share its NIC, which per-pair NIC-NIC
links alone would not.  ``Network.twins`` pairs tx/rx and out/in so a route can be reversed
(AllReduce's broadcast stage).

A *strategy* is M sub-collectives.  Sub-collective m moves a partition of S_m bytes in chunks of
C_m bytes from its flows' sources to their destinations along explicit routes (node paths), with an
aggregation flag per node.  ``evaluate`` returns the modelled completion time (Eq. 4).

Interpretations (the paper leaves these open; see docs/adapcc.md):
* Eq. 2's max runs over *all* flows entering the aggregating node (the prose reading); a node's own
  chunk merges there too, so flows that originate at an aggregating node leave at the merged time.
* Eq. 5 is reproduced as written (the first chunk is counted in h_Dst and in the product).
* AllReduce = Reduce, then the same routes reversed as a Broadcast, pipelined: the broadcast of a
  chunk starts when it is reduced at the root, and the chunk stream moves at the slower stage's
  bottleneck.  Both stages' loads share the directed links they use.
* Broadcast load on an edge is 1 when the edge ends at a node that holds the data (a GPU or an
  aggregator replicates it onward); behind a ``nic`` relay it is the number of copies the relay
  must pass on, the mirror of the Reduce load.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

NODE_KINDS = ("gpu", "agg", "nic")
NIC_SIDES = ("tx", "rx", "out", "in")     # the four relays of one NIC (make_cluster(nic_nodes=True))
PRIMITIVES = ("reduce", "broadcast", "allreduce")


@dataclass
class Network:
    """Nodes plus per-edge alpha (s) and beta (s/byte); an edge exists where beta is finite."""

    names: list[str]
    kinds: list[str]
    alpha: np.ndarray
    beta: np.ndarray
    twins: dict[int, int] = field(default_factory=dict)   # NIC send side <-> receive side

    def __post_init__(self):
        n = len(self.names)
        self.alpha = np.asarray(self.alpha, dtype=float)
        self.beta = np.asarray(self.beta, dtype=float)
        if len(self.kinds) != n or self.alpha.shape != (n, n) or self.beta.shape != (n, n):
            raise ValueError(f"network needs {n} kinds and {n}x{n} alpha/beta matrices")
        bad = [k for k in self.kinds if k not in NODE_KINDS]
        if bad:
            raise ValueError(f"unknown node kinds {bad}; use one of {NODE_KINDS}")
        finite = np.isfinite(self.beta)
        if np.any(self.beta[finite] <= 0) or np.any(self.alpha[finite] < 0):
            raise ValueError("beta must be > 0 and alpha >= 0 on every edge")
        if any(self.twins.get(b) != a or self.kinds[a] != "nic" for a, b in self.twins.items()):
            raise ValueError("twins must pair 'nic' nodes both ways")
        self._relay_paths: dict[tuple[int, int], list[int]] = {}

    @property
    def n(self) -> int:
        return len(self.names)

    def has_edge(self, i: int, j: int) -> bool:
        return i != j and bool(np.isfinite(self.beta[i, j]))

    def edges(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(self.n) for j in range(self.n) if self.has_edge(i, j)]

    def gpus(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "gpu"]

    def twin(self, v: int) -> int:
        return self.twins.get(v, v)

    def reverse_route(self, path: list[int]) -> list[int]:
        """The same hops run backwards: a NIC's send side becomes its receive side and back."""
        return [self.twin(v) for v in reversed(path)]

    def relay_path(self, i: int, j: int) -> list[int]:
        """Shortest node path i -> j whose inner nodes are all ``nic`` relays (just [i, j] when the
        edge exists): how a hop between two GPUs of different servers crosses their NICs."""
        key = (i, j)
        if key not in self._relay_paths:
            self._relay_paths[key] = self._search_relay_path(i, j)
        return self._relay_paths[key]

    def _search_relay_path(self, i, j):
        previous, queue = {i: None}, deque([i])
        while queue:
            v = queue.popleft()
            for w in range(self.n):
                if w in previous or not self.has_edge(v, w):
                    continue
                previous[w] = v
                if w == j:
                    path = [j]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if self.kinds[w] == "nic":
                    queue.append(w)
        raise ValueError(f"no path from {self.names[i]} to {self.names[j]} through relays")

    def expand_route(self, path: list[int]) -> list[int]:
        """Insert the NIC relays a GPU-level path needs (hops without a direct edge)."""
        out = [path[0]]
        for i, j in zip(path, path[1:]):
            out.extend(self.relay_path(i, j)[1:])
        return out

    def hop_alpha_beta(self, i: int, j: int) -> tuple[float, float]:
        """Latency (summed) and inverse bandwidth (slowest link) of the relay path i -> j."""
        path = self.relay_path(i, j)
        hops = list(zip(path, path[1:]))
        return (sum(self.alpha[e] for e in hops), max(self.beta[e] for e in hops))


def make_cluster(gpus_per_server, nic_gbps, nvlink_gbps=300.0, nvlink_alpha=5e-6,
                 net_alpha=20e-6, aggregator_gbps=None, aggregator_alpha=5e-6,
                 nic_nodes=False, core_gbps=10_000.0, nic_receive_gbps=None) -> Network:
    """A cluster of servers: NVLink inside a server, NIC bandwidth between servers.

    ``nic_nodes=False`` (the older, optimistic model): every cross-server GPU pair gets its own link
    at the smaller NIC's rate, so flows from several GPUs of one server do not share its NIC.
    ``nic_nodes=True``: each server's NIC is four ``nic`` relays (see module doc); GPU <-> NIC runs
    over the intra-server link (the paper does not profile PCIe, it overlaps with the network), and
    all of a server's cross-server traffic shares its NIC's two port links.  With
    ``aggregator_gbps`` an in-network aggregator ``agg`` is added at min(NIC, aggregator) rate,
    linked to every GPU, or to every NIC port with ``nic_nodes``.  ``nic_receive_gbps`` (with
    ``nic_nodes``): each NIC's receive side at its own rate (default: ``nic_gbps``, which is
    then the send side's), for links loaded or shaped differently in the two directions.
    """
    if len(gpus_per_server) != len(nic_gbps):
        raise ValueError("give one NIC bandwidth per server")
    if nic_receive_gbps is None:
        nic_receive_gbps = nic_gbps
    elif len(nic_receive_gbps) != len(nic_gbps) or not nic_nodes:
        raise ValueError("nic_receive_gbps: one receive bandwidth per server, with nic_nodes")
    names, kinds, server_of = [], [], []
    for s, count in enumerate(gpus_per_server):
        for g in range(count):
            names.append(f"s{s}g{g}")
            kinds.append("gpu")
            server_of.append(s)
    n_gpu, n_servers = len(server_of), len(gpus_per_server)
    if nic_nodes:
        for s in range(n_servers):
            names += [f"s{s}nic.{side}" for side in NIC_SIDES]
            kinds += ["nic"] * len(NIC_SIDES)
    if aggregator_gbps is not None:
        names.append("agg")
        kinds.append("agg")
    n = len(names)
    alpha, beta = np.full((n, n), np.inf), np.full((n, n), np.inf)

    def link(i, j, gbps, lat):
        alpha[i, j], beta[i, j] = lat, 8.0 / (gbps * 1e9)

    tx, rx, out, inp = ({s: n_gpu + len(NIC_SIDES) * s + k for s in range(n_servers)}
                        for k in range(len(NIC_SIDES)))
    for i in range(n_gpu):
        for j in range(n_gpu):
            if i != j and server_of[i] == server_of[j]:
                link(i, j, nvlink_gbps, nvlink_alpha)
            elif i != j and not nic_nodes:
                link(i, j, min(nic_gbps[server_of[i]], nic_gbps[server_of[j]]), net_alpha)
    twins = {}
    if nic_nodes:
        for i in range(n_gpu):
            link(i, tx[server_of[i]], nvlink_gbps, nvlink_alpha)
            link(rx[server_of[i]], i, nvlink_gbps, nvlink_alpha)
        for a in range(n_servers):
            twins.update({tx[a]: rx[a], rx[a]: tx[a], out[a]: inp[a], inp[a]: out[a]})
            link(tx[a], out[a], nic_gbps[a], 0.0)       # latency is charged on the wire below
            link(inp[a], rx[a], nic_receive_gbps[a], 0.0)
            for b in range(n_servers):
                if a != b:
                    link(out[a], inp[b], core_gbps, net_alpha)
    if aggregator_gbps is not None:
        agg = n - 1
        if nic_nodes:
            for s in range(n_servers):
                gbps = min(nic_gbps[s], aggregator_gbps)
                link(out[s], agg, gbps, aggregator_alpha)
                link(agg, inp[s], gbps, aggregator_alpha)
        else:
            for i in range(n_gpu):
                gbps = min(nic_gbps[server_of[i]], aggregator_gbps)
                link(i, agg, gbps, aggregator_alpha)
                link(agg, i, gbps, aggregator_alpha)
    return Network(names, kinds, alpha, beta, twins)


@dataclass
class SubCollective:
    """One of the M parallel sub-collectives: its routes, chunking and aggregation flags.

    ``routes`` maps a flow's source node to its node path.  Reduce: path src -> ... -> root for every
    non-root GPU.  Broadcast: path root -> ... -> dst, keyed by dst.
    """

    root: int
    size: float
    chunk: float
    routes: dict[int, list[int]]
    aggregate: frozenset = field(default_factory=frozenset)

    @property
    def n_chunks(self) -> int:
        return max(1, math.ceil(self.size / self.chunk - 1e-9))


@dataclass
class Strategy:
    primitive: str
    subs: list[SubCollective]

    def __post_init__(self):
        if self.primitive not in PRIMITIVES:
            raise ValueError(f"primitive {self.primitive!r} unknown; use one of {PRIMITIVES}")
        if not self.subs:
            raise ValueError("a strategy needs at least one sub-collective")


def on_gpus(strategy: Strategy, net: Network) -> Strategy:
    """The strategy as the executor runs it, over ranks only: each route without its NIC
    relays (a hop GPU -> NIC -> ... -> NIC -> GPU is one send between the two GPUs; the NICs
    are the hardware it crosses). The GPUs must be nodes 0..G-1 (make_cluster's order)."""
    gpus = net.gpus()
    if gpus != list(range(len(gpus))):
        raise ValueError("on_gpus: the network's GPUs must be its first nodes (make_cluster)")
    subs = [replace(sub, routes={src: [v for v in path if net.kinds[v] != "nic"]
                                 for src, path in sub.routes.items()})
            for sub in strategy.subs]
    return Strategy(strategy.primitive, subs)


@dataclass
class Evaluation:
    time: float
    sub_times: list[float]
    loads: dict[tuple[int, int], int]


def tree_routes(parent: dict[int, int], root: int) -> dict[int, list[int]]:
    """Reduce routes from a parent map (child -> parent): each source walks up to the root."""
    routes = {}
    for src in parent:
        path, node = [src], src
        while node != root:
            node = parent[node]
            if node in path:
                raise ValueError(f"parent map has a cycle through node {node}")
            path.append(node)
        routes[src] = path
    return routes


def check_flow_conservation(net: Network, sub: SubCollective, primitive: str) -> None:
    """Eq. 1: every route is a simple path over existing edges from Src_f to Dst_f."""
    expected_sources = set(net.gpus()) - {sub.root}
    if set(sub.routes) != expected_sources:
        raise ValueError(f"sub-collective rooted at {sub.root} must route every other GPU exactly "
                         f"once; missing {sorted(expected_sources - set(sub.routes))}")
    for key, path in sub.routes.items():
        src, dst = (key, sub.root) if primitive != "broadcast" else (sub.root, key)
        if path[0] != src or path[-1] != dst:
            raise ValueError(f"route {path} must run from {src} to {dst}")
        if len(set(path)) != len(path):
            raise ValueError(f"route {path} revisits a node")
        for i, j in zip(path, path[1:]):
            if not net.has_edge(i, j):
                raise ValueError(f"route {path} uses missing edge {i}->{j}")


def _topological(nodes: set[int], edges: set[tuple[int, int]]) -> list[int]:
    indeg = {v: 0 for v in nodes}
    for _, j in edges:
        indeg[j] += 1
    order, ready = [], sorted(v for v, d in indeg.items() if d == 0)
    while ready:
        v = ready.pop()
        order.append(v)
        for i, j in edges:
            if i == v:
                indeg[j] -= 1
                if indeg[j] == 0:
                    ready.append(j)
    if len(order) != len(nodes):
        raise ValueError("the union of a sub-collective's routes must be acyclic")
    return order


def _reduce_loads(net, sub) -> dict[tuple[int, int], int]:
    """N^m_{ij} for Reduce: 1 out of an aggregating node, own + upstream load otherwise."""
    edges = {(i, j) for p in sub.routes.values() for i, j in zip(p, p[1:])}
    nodes = {v for e in edges for v in e}
    load: dict[tuple[int, int], int] = {}
    for i in _topological(nodes, edges):
        outs = [e for e in edges if e[0] == i]
        if not outs:
            continue
        if i in sub.aggregate and net.kinds[i] != "nic":
            value = 1
        else:
            own = 1 if i in sub.routes else 0
            value = own + sum(v for (k, j), v in load.items() if j == i)
        for e in outs:
            load[e] = value
    return load


def _broadcast_loads(net, paths) -> dict[tuple[int, int], int]:
    """Copies per edge of a Broadcast along ``paths`` (root first): one copy into a node that
    holds the data (it replicates onward), the sum of what follows it into a ``nic`` relay."""
    edges = {(i, j) for p in paths for i, j in zip(p, p[1:])}
    nodes = {v for e in edges for v in e}
    load: dict[tuple[int, int], int] = {}
    for j in reversed(_topological(nodes, edges)):
        downstream = sum(v for (i, _), v in load.items() if i == j)
        for e in edges:
            if e[1] == j:
                load[e] = downstream if net.kinds[j] == "nic" else 1
    return load


def stage_loads(net: Network, strategy: Strategy) -> dict[tuple[int, int], int]:
    """Total load per directed edge over all sub-collectives and stages (Eq. 3's denominator).

    Loads add up over every flow, stage and sub-collective that crosses an edge, so flows that
    share a NIC link each get their share of its bandwidth."""
    total: dict[tuple[int, int], int] = {}
    for sub in strategy.subs:
        if strategy.primitive == "broadcast":
            parts = [_broadcast_loads(net, sub.routes.values())]
        else:
            parts = [_reduce_loads(net, sub)]
            if strategy.primitive == "allreduce":
                parts.append(_broadcast_loads(net, [net.reverse_route(p)
                                                    for p in sub.routes.values()]))
        for part in parts:
            for e, v in part.items():
                total[e] = total.get(e, 0) + v
    return total


def _edge_time(net, loads, sub, i, j) -> float:
    return net.alpha[i, j] + net.beta[i, j] * loads[(i, j)] * sub.chunk


def _reduce_stage(net, loads, sub):
    """Chunk ready times (Eq. 2) and per-flow bottlenecks (Eq. 6) of a Reduce stage."""
    h = {src: {src: 0.0} for src in sub.routes}       # h[flow][node]
    edges = {(i, j) for p in sub.routes.values() for i, j in zip(p, p[1:])}
    nodes = {v for e in edges for v in e}
    for j in _topological(nodes, edges):
        entering = [(f, p[p.index(j) - 1]) for f, p in sub.routes.items()
                    if j in p and p.index(j) > 0]
        arrivals = {f: h[f][i] + _edge_time(net, loads, sub, i, j) for f, i in entering}
        if j in sub.aggregate and net.kinds[j] != "nic" and (arrivals or j in sub.routes):
            merged = max(list(arrivals.values()) + ([0.0] if j in sub.routes else []))
            for f in arrivals:
                h[f][j] = merged
            if j in sub.routes:
                h[j][j] = merged
        else:
            for f, t in arrivals.items():
                h[f][j] = t
    bottleneck = {f: max(h[f][j] - h[f][i] for i, j in zip(p, p[1:]))
                  for f, p in sub.routes.items()}
    return h, bottleneck


def _broadcast_stage(net, loads, sub, paths):
    """Broadcast along ``paths`` (root first): no aggregation, so h grows by t per hop."""
    arrival, bottleneck = {}, {}
    for dst, p in paths.items():
        t = [_edge_time(net, loads, sub, i, j) for i, j in zip(p, p[1:])]
        arrival[dst], bottleneck[dst] = sum(t), max(t)
    return arrival, bottleneck


def evaluate(net: Network, strategy: Strategy) -> Evaluation:
    """Modelled completion time of ``strategy`` on ``net`` (Eqs. 1-6)."""
    for sub in strategy.subs:
        check_flow_conservation(net, sub, strategy.primitive)
    loads = stage_loads(net, strategy)
    times = []
    for sub in strategy.subs:
        if not sub.routes:          # a single GPU: nothing to move
            times.append(0.0)
            continue
        k = sub.n_chunks
        if strategy.primitive == "broadcast":
            arrival, bott = _broadcast_stage(net, loads, sub, sub.routes)
            times.append(max(arrival[d] + k * bott[d] for d in arrival))
            continue
        h, bott = _reduce_stage(net, loads, sub)
        if strategy.primitive == "reduce":
            times.append(max(h[f][sub.root] + k * bott[f] for f in sub.routes))
            continue
        reversed_paths = {src: net.reverse_route(p) for src, p in sub.routes.items()}
        arrival, bbott = _broadcast_stage(net, loads, sub, reversed_paths)
        root_ready = max(h[f][sub.root] for f in sub.routes)
        stream = max(max(bott.values()), max(bbott.values()))
        times.append(root_ready + max(arrival.values()) + k * stream)
    return Evaluation(max(times), times, loads)


def sequential_allreduce_time(net: Network, strategy: Strategy) -> float:
    """Reduce then Broadcast run one after the other (the non-pipelined reference for T10)."""
    reduce = Strategy("reduce", strategy.subs)
    bsubs = [SubCollective(s.root, s.size, s.chunk,
                           {src: net.reverse_route(p) for src, p in s.routes.items()}, s.aggregate)
             for s in strategy.subs]
    return evaluate(net, reduce).time + evaluate(net, Strategy("broadcast", bsubs)).time
