"""The MILP against an exhaustive search of the same decisions on tiny graphs (docs/adapcc.md,
"MILP family"): a tree toward every root, aggregate-or-forward per gpu/agg node, every chunk
count, M = 1 and 2, all scored with the cost model's ``evaluate``."""
import numpy as np
import pytest

from host.adapcc.costmodel import (Network, Strategy, SubCollective, evaluate, make_cluster,
                                   tree_routes)
from host.adapcc.exhaustive import exhaustive, exhaustive_split, reduce_trees, tree_shapes
from host.adapcc.synthesizer import _TreeMilp, optimize

MB = 1e6


def switch_network() -> Network:
    """Four GPUs and a switch: a two-hop chain far -> mid -> switch (100 Gbps), a leaf -> switch
    (60 Gbps), switch -> root (400 Gbps), every other link 10 Gbps.  Aggregating at the switch
    makes the leaf's chunks wait for the chain's (Eq. 6 counts the wait in the bottleneck);
    forwarding lets them pass, and the fast uplink carries the second flow cheaply."""
    names, kinds = ["root", "leaf", "mid", "far", "switch"], ["gpu"] * 4 + ["agg"]
    gbps = np.full((5, 5), 10.0)
    for i, j, rate in ((3, 2, 100), (2, 4, 100), (1, 4, 60), (4, 0, 400)):
        gbps[i, j] = gbps[j, i] = rate
    alpha = np.full((5, 5), 5e-6)
    np.fill_diagonal(alpha, np.inf)
    beta = 8.0 / (gbps * 1e9)
    np.fill_diagonal(beta, np.inf)
    return Network(names, kinds, alpha, beta)


TINY = {
    "3 servers 100/50/25": lambda: make_cluster([1, 1, 1], [100, 50, 25]),
    "2+1 GPUs 100/25": lambda: make_cluster([2, 1], [100, 25]),
    "3 servers + aggregator": lambda: make_cluster([1, 1, 1], [100, 50, 25], aggregator_gbps=40),
    "4 servers 100/50/100/25": lambda: make_cluster([1, 1, 1, 1], [100, 50, 100, 25]),
    "2+1 GPUs, NIC relays": lambda: make_cluster([2, 1], [100, 25], nic_nodes=True),
    "switch": switch_network,
}

# (network, primitive, M, root); M = 2 with a free root only where the enumeration stays small
CASES = [(net, prim, m, None) for net in ("3 servers 100/50/25", "2+1 GPUs 100/25")
         for prim in ("reduce", "allreduce", "broadcast") for m in (1, 2)]
CASES += [("3 servers + aggregator", prim, 1, None) for prim in ("reduce", "allreduce")]
CASES += [("3 servers + aggregator", prim, 2, 0) for prim in ("reduce", "allreduce")]
CASES += [("4 servers 100/50/100/25", prim, 1, None) for prim in ("reduce", "allreduce")]
CASES += [("4 servers 100/50/100/25", "allreduce", 2, 0)]
CASES += [("2+1 GPUs, NIC relays", prim, 1, None) for prim in ("reduce", "allreduce", "broadcast")]
CASES += [("switch", prim, 1, 0) for prim in ("reduce", "allreduce")]


@pytest.mark.parametrize("net_name,prim,m,root", CASES)
def test_milp_optimum_equals_exhaustive_optimum(net_name, prim, m, root):
    net = TINY[net_name]()
    size = 8 * MB
    milp = optimize(net, prim, size, m=m, root=root, time_limit=60)
    best = exhaustive(net, prim, size, m=m, root=root)
    assert milp.optimal
    assert milp.objective == pytest.approx(best.time, rel=1e-6)
    assert evaluate(net, milp.strategy).time == pytest.approx(best.time, rel=1e-6)


def test_forwarding_at_the_switch_beats_forced_aggregation():
    net = switch_network()
    for prim, gain in (("reduce", 1.21), ("allreduce", 1.24)):
        free = exhaustive(net, prim, 4 * MB, root=0)
        forced = exhaustive(net, prim, 4 * MB, root=0, forwarding=False)
        assert forced.time > gain * free.time, prim
        switch = net.names.index("switch")
        assert switch not in free.strategy.subs[0].aggregate          # it forwards
        assert any(switch in p for p in free.strategy.subs[0].routes.values())
        milp = optimize(net, prim, 4 * MB, root=0)
        assert milp.objective == pytest.approx(free.time, rel=1e-6)
        assert switch not in milp.strategy.subs[0].aggregate
        old = optimize(net, prim, 4 * MB, root=0, forwarding=False)  # the older family
        assert old.objective == pytest.approx(forced.time, rel=1e-6)


def mixed_latency_network() -> Network:
    """Three GPUs with mixed rates (5-50 Gbps) and latencies (1-50 us): found by a random search
    as a case where the two sub-collectives want different chunk counts."""
    gbps = np.array([[1, 25, 50], [25, 1, 10], [50, 10, 1]], dtype=float)
    alpha = np.array([[np.inf, 50e-6, 5e-6], [50e-6, np.inf, 1e-6], [5e-6, 1e-6, np.inf]])
    beta = 8.0 / (gbps * 1e9)
    np.fill_diagonal(beta, np.inf)
    return Network(["g0", "g1", "g2"], ["gpu"] * 3, alpha, beta)


@pytest.mark.parametrize("prim,gain", [("reduce", 1.2), ("allreduce", 1.3)])
def test_one_chunk_count_per_sub_collective(prim, gain):
    """The paper's C_m: the MILP over every count tuple matches the exhaustive search, and here
    beats one count shared by both sub-collectives."""
    net = mixed_latency_network()
    milp = optimize(net, prim, MB, m=2, root=0, chunk_per_sub=True)
    best = exhaustive(net, prim, MB, m=2, root=0, chunk_per_sub=True)
    assert milp.objective == pytest.approx(best.time, rel=1e-6)
    assert len(set(milp.n_chunks)) == 2
    shared = exhaustive(net, prim, MB, m=2, root=0)
    assert optimize(net, prim, MB, m=2, root=0).objective == pytest.approx(shared.time, rel=1e-6)
    assert shared.time > gain * best.time


def uneven_split_network() -> Network:
    """Three GPUs, 1 us everywhere, g0-g1 at 50 Gbps, g0-g2 at 25, g1-g2 at 10 (from the
    study's random search, ``split_experiment``): two trees toward g0 want unequal shares."""
    gbps = np.array([[1, 50, 25], [50, 1, 10], [25, 10, 1]], dtype=float)
    alpha = np.full((3, 3), 1e-6)
    np.fill_diagonal(alpha, np.inf)
    beta = 8.0 / (gbps * 1e9)
    np.fill_diagonal(beta, np.inf)
    return Network(["g0", "g1", "g2"], ["gpu"] * 3, alpha, beta)


@pytest.mark.parametrize("prim,gain", [("reduce", 1.3), ("allreduce", 1.25)])
def test_deciding_the_split_matches_exhaustive_and_beats_the_even_split(prim, gain):
    """The paper's S_m as a decision (M = 2, a grid of eighths): the MILP over the grid equals
    the exhaustive search of the same space, and here the even split, the default
    restriction, is more than `gain` times slower."""
    net = uneven_split_network()
    free = exhaustive_split(net, prim, MB, root=0, steps=8)
    milp = optimize(net, prim, MB, m=2, root=0, chunk_per_sub=True, split_steps=8)
    assert milp.objective == pytest.approx(free.time, rel=1e-6)
    assert evaluate(net, milp.strategy).time == pytest.approx(free.time, rel=1e-6)
    assert min(milp.shares) < 0.5 and sum(milp.shares) == pytest.approx(1.0)
    even = exhaustive(net, prim, MB, m=2, root=0, chunk_per_sub=True)
    assert even.time > gain * free.time
    with pytest.raises(ValueError, match="M = 2"):
        optimize(net, prim, MB, m=4, split_steps=8)


def _milp_value(net, prim, size, m, n_chunks, picks):
    """The MILP's objective with every sub-collective's tree and flags pinned."""
    model = _TreeMilp(net, prim, size, m, n_chunks, root=None)
    for k, (root, parent, aggregate) in enumerate(picks):
        model.pin(k, root, parent, aggregate)
    res = model.build().md.solve(model.total, 30)
    assert res.status == 0
    return res.fun / model.scale


@pytest.mark.parametrize("net_name,prim", [("3 servers + aggregator", "reduce"),
                                           ("3 servers + aggregator", "allreduce"),
                                           ("2+1 GPUs, NIC relays", "reduce"),
                                           ("2+1 GPUs, NIC relays", "allreduce"),
                                           ("switch", "reduce")])
def test_milp_times_every_tree_and_flag_set_like_evaluate(net_name, prim):
    """Not just at the optimum: pinned to any tree and any aggregate/forward choice (GPUs that
    forward included), the MILP's value is evaluate's."""
    net = TINY[net_name]()
    size, n_chunks = 8 * MB, 4
    checked = 0
    for root in net.gpus():
        for parent in reduce_trees(net, root):
            for _, routes, aggregate in tree_shapes(net, prim, root, parent):
                sub = SubCollective(root, size, size / n_chunks, routes, aggregate)
                want = evaluate(net, Strategy(prim, [sub])).time
                got = _milp_value(net, prim, size, 1, n_chunks, [(root, parent, aggregate)])
                assert got == pytest.approx(want, rel=1e-6), (parent, sorted(aggregate))
                checked += 1
        if checked > 60:
            break
    assert checked > 10


def test_two_sub_collectives_pinned_share_links_like_evaluate():
    """Two sub-collectives with different chunk counts on shared links: one through a forwarding
    switch, one a chain whose middle GPU forwards."""
    net = make_cluster([1, 1, 1], [100, 50, 25], aggregator_gbps=40)
    size, n_chunks = 8 * MB, (2, 8)
    trees = reduce_trees(net, 0)
    agg = net.names.index("agg")
    through_switch = next(p for p in trees if agg in p)
    chain = next(p for p in trees if agg not in p and len(set(p.values())) == 2)
    picks = [(0, through_switch, frozenset({0})), (0, chain, frozenset({0}))]
    subs = []
    for (root, parent, aggregate), count in zip(picks, n_chunks):
        routes = {g: p for g, p in tree_routes(parent, root).items() if g in net.gpus()}
        subs.append(SubCollective(root, size / 2, size / 2 / count, routes, aggregate))
    for prim in ("reduce", "allreduce"):
        want = evaluate(net, Strategy(prim, subs)).time
        assert _milp_value(net, prim, size, 2, n_chunks, picks) == pytest.approx(want, rel=1e-6)


def test_enumerator_counts_every_tree_once():
    # Cayley: n^(n-2) spanning arborescences of K_n toward a fixed root
    assert len(reduce_trees(make_cluster([1, 1, 1], [100] * 3), 0)) == 3
    assert len(reduce_trees(make_cluster([1] * 4, [100] * 4), 0)) == 16
    trees = reduce_trees(make_cluster([1, 1, 1], [100] * 3, aggregator_gbps=100), 0)
    assert len({tuple(sorted(p.items())) for p in trees}) == len(trees)
