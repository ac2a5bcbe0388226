"""Cost model (AdapCC paper, Eqs. 1-6) and synthesizer: test vectors T6-T10."""
import numpy as np
import pytest

from host.adapcc import strategies as S
from host.adapcc.costmodel import (Network, Strategy, SubCollective, evaluate, make_cluster,
                                   sequential_allreduce_time, stage_loads)
from host.adapcc.synthesizer import Synthesizer, optimize, solve_milp
from host.experiments.adapcc.study import servers_of

MB = 1e6
HAND_BUILT = {"ring": S.ring, "binary_tree": S.binary_tree, "star": S.star}


def hetero():
    """Two GPUs per server; the middle server has the slow (25 Gbps) NIC."""
    return make_cluster([2, 1, 1], [100, 25, 100], net_alpha=20e-6)


def best_hand_built(net, prim, root, size, m=1):
    out = {}
    for name, build in HAND_BUILT.items():
        out[name] = min(evaluate(net, build(net, prim, root, size, n_chunks=k, m=m)).time
                        for k in (1, 2, 4, 8, 16, 32))
    return out


@pytest.mark.parametrize("prim", ["reduce", "allreduce", "broadcast"])
def test_t8_milp_beats_every_hand_built(prim):
    net = hetero()
    res = optimize(net, prim, 32 * MB, m=1, root=0)
    modeled = evaluate(net, res.strategy).time
    assert modeled == pytest.approx(res.objective, rel=1e-6)   # MILP objective == evaluator
    for name, t in best_hand_built(net, prim, 0, 32 * MB).items():
        assert modeled <= t * (1 + 1e-9), name


def test_t8_strictly_beats_tree_with_slow_nic_inside():
    net = make_cluster([1, 1, 1, 1], [100, 25, 100, 100], net_alpha=20e-6)
    # binary tree over order 0,1,2,3: the slow node 1 is interior (parent of 3)
    tree = min(evaluate(net, S.binary_tree(net, "reduce", 0, 32 * MB, n_chunks=k)).time
               for k in (1, 2, 4, 8, 16, 32))
    milp = optimize(net, "reduce", 32 * MB, root=0)
    assert milp.objective < tree * 0.99


def test_milp_with_aggregator_node_and_two_subcollectives():
    net = make_cluster([1, 1, 1], [100, 100, 50], aggregator_gbps=100)
    res = solve_milp(net, "reduce", 16 * MB, m=2, n_chunks=8, root=0)
    assert evaluate(net, res.strategy).time == pytest.approx(res.objective, rel=1e-6)
    ps = evaluate(net, S.aggregator_star(net, "reduce", 0, 16 * MB, n_chunks=8, m=2)).time
    assert res.objective <= ps * (1 + 1e-9)


def test_t6_flow_conservation_is_checked():
    net = hetero()
    good = S.ring(net, "reduce", 0, MB)
    bad = SubCollective(0, MB, MB, {**good.subs[0].routes, 1: [1, 2]}, good.subs[0].aggregate)
    with pytest.raises(ValueError, match="must run from"):
        evaluate(net, Strategy("reduce", [bad]))
    missing = SubCollective(0, MB, MB, {1: [1, 0]}, good.subs[0].aggregate)
    with pytest.raises(ValueError, match="missing"):
        evaluate(net, Strategy("reduce", [missing]))


def test_t7_bandwidth_sharing_loads():
    net = make_cluster([1, 1, 1], [100, 100, 100], net_alpha=0.0)
    routes = {1: [1, 2, 0], 2: [2, 0]}
    agg = SubCollective(0, MB, MB, routes, frozenset({0, 1, 2}))
    fwd = SubCollective(0, MB, MB, routes, frozenset({0, 1}))      # node 2 only forwards
    assert stage_loads(net, Strategy("reduce", [agg]))[(2, 0)] == 1
    assert stage_loads(net, Strategy("reduce", [fwd]))[(2, 0)] == 2
    two = stage_loads(net, Strategy("reduce", [agg, agg]))
    assert two[(2, 0)] == 2                                         # two sub-collectives share
    one_t = evaluate(net, Strategy("reduce", [agg])).time
    both_t = evaluate(net, Strategy("reduce", [agg, agg])).time
    assert both_t == pytest.approx(2 * one_t)                      # each gets half the link
    bc = SubCollective(0, MB, MB, {1: [0, 2, 1], 2: [0, 2]}, frozenset())
    assert stage_loads(net, Strategy("broadcast", [bc]))[(0, 2)] == 1   # replicas merge


def test_eq2_aggregation_waits_for_slowest_input():
    net = make_cluster([1, 1, 1], [100, 100, 10], net_alpha=0.0)
    sub = SubCollective(0, MB, MB, {1: [1, 0], 2: [2, 1, 0]}, frozenset({0, 1, 2}))
    t = evaluate(net, Strategy("reduce", [sub])).time
    slow = 8 / 10e9 * MB             # 2 -> 1 at 10 Gbps
    fast = 8 / 100e9 * MB            # 1 -> 0 at 100 Gbps
    # h_1 = slow (waits for 2), h_0 = slow + fast; bottleneck of flow 2 = slow; K = 1
    assert t == pytest.approx(slow + fast + slow)


def test_t9_more_bandwidth_never_hurts():
    net = hetero()
    strat = S.binary_tree(net, "reduce", 0, 32 * MB, n_chunks=8)
    base = evaluate(net, strat).time
    faster = Network(net.names, net.kinds, net.alpha, net.beta * 0.5)
    assert evaluate(faster, strat).time <= base


def test_t9_interior_chunk_optimum_with_latency():
    net = make_cluster([1, 1, 1, 1], [10, 10, 10, 10], net_alpha=2e-3)
    times = [evaluate(net, S.ring(net, "reduce", 0, 8 * MB, n_chunks=k)).time
             for k in (1, 2, 4, 8, 16, 64, 256)]
    best = int(np.argmin(times))
    assert 0 < best < len(times) - 1


def test_t10_pipelined_allreduce_beats_sequential():
    net = hetero()
    strat = S.binary_tree(net, "allreduce", 0, 32 * MB, n_chunks=8)
    assert evaluate(net, strat).time < sequential_allreduce_time(net, strat)


def test_par_trees_routes_valid_and_distinct_roots():
    net = make_cluster([4, 4, 4], [100, 50, 100])
    servers = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    strat = S.par_trees(net, "allreduce", 64 * MB, m=3, servers=servers)
    assert len({s.root for s in strat.subs}) == 3
    assert evaluate(net, strat).time > 0
    rooted = S.par_trees(net, "reduce", 64 * MB, m=4, servers=servers, root=5)
    assert all(s.root == 5 for s in rooted.subs)
    evaluate(net, rooted)


def test_resynthesis_on_profile_change_without_restart():
    net = make_cluster([1, 1, 1, 1], [100, 100, 100, 100])
    synth = Synthesizer("reduce", 16 * MB, m=1, root=0, milp_max_nodes=4)
    assert synth.update_profile(net) is True
    first = synth.current
    assert synth.update_profile(net) is False                 # unchanged profile: keep strategy
    slow = net.beta.copy()
    slow[1, :] *= 8
    slow[:, 1] *= 8                                            # GPU 1's links drop to 1/8
    degraded = Network(net.names, net.kinds, net.alpha, slow)
    synth.update_profile(degraded)
    assert synth.current is not first
    assert synth.current.modeled_time == pytest.approx(evaluate(degraded, synth.current.strategy).time)
    stale = evaluate(degraded, first.strategy).time
    assert synth.current.modeled_time <= stale


def test_large_graph_uses_heuristic():
    net = make_cluster([4, 4], [100, 50])
    synth = Synthesizer("allreduce", 64 * MB, m=2, milp_max_nodes=6)
    result = synth.synthesize(net)
    assert result.method in ("par-trees", "ring", "binary-tree", "star")
    assert result.modeled_time == pytest.approx(evaluate(net, result.strategy).time)
    partrees = min(evaluate(net, S.par_trees(net, "allreduce", 64 * MB, 2, k)).time
                   for k in (1, 2, 4, 8, 16, 32))
    assert result.modeled_time <= partrees


def test_bad_network_refused():
    with pytest.raises(ValueError, match="kinds"):
        Network(["a"], ["tpu"], np.zeros((1, 1)), np.full((1, 1), np.inf))
    with pytest.raises(ValueError, match="beta must be"):
        Network(["a", "b"], ["gpu", "gpu"], np.zeros((2, 2)), np.array([[np.inf, -1], [1, np.inf]]))


def test_milp_free_roots_and_time_limit():
    net = make_cluster([1, 1, 1, 1], [100, 50, 100, 25])
    res = solve_milp(net, "allreduce", 16 * MB, m=2, n_chunks=4, root=None)
    assert res.optimal
    assert evaluate(net, res.strategy).time == pytest.approx(res.objective, rel=1e-6)
    roots = [s.root for s in res.strategy.subs]
    assert roots == sorted(roots)                      # symmetry breaking holds
    single = solve_milp(net, "allreduce", 16 * MB, m=1, n_chunks=4, root=None)
    # M=2 can always copy the M=1 trees, and here splits the load over two trees
    assert res.objective <= evaluate(net, S.from_parents(
        net, "allreduce", [{g: p[1] for g, p in single.strategy.subs[0].routes.items()}] * 2,
        [single.strategy.subs[0].root] * 2, 16 * MB, 4)).time + 1e-12
    limited = solve_milp(net, "allreduce", 16 * MB, m=2, n_chunks=4, root=None, time_limit=0.05)
    if limited is not None:                            # a feasible incumbent is still valid
        evaluate(net, limited.strategy)


# --- NIC nodes: a server's cross-server traffic shares its NIC ------------------------------

TESTBED = dict(gpus_per_server=[4] * 6, nic_gbps=[100, 100, 100, 100, 50, 50])


def test_nic_nodes_make_a_servers_flows_share_its_nic():
    shared = make_cluster([2, 1], [100, 100], net_alpha=0.0, nic_nodes=True)
    private = make_cluster([2, 1], [100, 100], net_alpha=0.0)
    root = 2                                             # the GPU of server 1
    star_shared = S.star(shared, "reduce", root, MB, n_chunks=1)
    star_private = S.star(private, "reduce", root, MB, n_chunks=1)
    tx_out = (shared.names.index("s0nic.tx"), shared.names.index("s0nic.out"))
    assert stage_loads(shared, star_shared)[tx_out] == 2        # both GPUs' flows, unmerged
    assert evaluate(shared, star_shared).loads[tx_out] == 2
    # the same star costs more once the two flows share server 0's NIC
    assert evaluate(shared, star_shared).time > 1.5 * evaluate(private, star_private).time


@pytest.mark.parametrize("prim", ["reduce", "allreduce", "broadcast"])
def test_hand_built_strategies_route_over_nic_nodes(prim):
    net = make_cluster([2, 2, 1], [100, 50, 100], nic_nodes=True, aggregator_gbps=100)
    nics = {i for i, k in enumerate(net.kinds) if k == "nic"}
    for build in (*HAND_BUILT.values(), S.aggregator_star):
        strat = build(net, prim, 0, 8 * MB, n_chunks=4, m=2)
        assert evaluate(net, strat).time > 0                   # routes are valid paths
        crossing = [p for s in strat.subs for p in s.routes.values() if set(p) & nics]
        assert crossing, build.__name__                        # cross-server hops use the NICs
    partrees = S.par_trees(net, prim, 8 * MB, 2, 4, servers_of([2, 2, 1]),
                           0 if prim != "allreduce" else None)
    evaluate(net, partrees)


def test_broadcast_through_a_nic_relay_carries_one_copy_per_gpu_behind_it():
    net = make_cluster([1, 2], [100, 100], nic_nodes=True)
    strat = S.star(net, "broadcast", 0, MB, n_chunks=1)      # GPU 0 sends to both GPUs of s1
    loads = stage_loads(net, strat)
    assert loads[(net.names.index("s1nic.in"), net.names.index("s1nic.rx"))] == 2


@pytest.mark.parametrize("prim", ["reduce", "allreduce"])
def test_synthesizer_never_slower_than_hand_built_on_testbed_with_nics(prim):
    net = make_cluster(**TESTBED, nic_nodes=True)
    root = 0 if prim == "reduce" else None
    synth = Synthesizer(prim, 256 * MB, m=4, root=root, milp_max_nodes=0,
                        servers=servers_of(TESTBED["gpus_per_server"])).synthesize(net)
    assert synth.modeled_time == pytest.approx(evaluate(net, synth.strategy).time)
    for name, t in best_hand_built(net, prim, 0, 256 * MB, m=4).items():
        assert synth.modeled_time <= t * (1 + 1e-9), name
    # the no-NIC model's pick (a star) is far slower once the NIC is shared
    star = best_hand_built(net, prim, 0, 256 * MB, m=4)["star"]
    assert star > 2 * synth.modeled_time


OBJECTIVE_NETS = {
    "gpus only": lambda: make_cluster([2, 1, 1], [100, 25, 100]),
    "aggregator": lambda: make_cluster([1, 1, 1], [100, 100, 50], aggregator_gbps=100),
    "nic relays": lambda: make_cluster([2, 1, 1], [100, 25, 100], nic_nodes=True),
    "nic relays + aggregator": lambda: make_cluster([1, 1, 1], [100, 100, 50],
                                                    aggregator_gbps=100, nic_nodes=True),
}


@pytest.mark.parametrize("net_name", list(OBJECTIVE_NETS))
@pytest.mark.parametrize("prim,m", [(p, m) for p in ("reduce", "broadcast", "allreduce")
                                    for m in (1, 2)])
def test_milp_objective_equals_evaluate(net_name, prim, m):
    """Aggregate-or-forward decided: the objective is evaluate's on the returned strategy, whose
    aggregating sets hold the root and no relay (none at all for a Broadcast)."""
    net = OBJECTIVE_NETS[net_name]()
    root = None if prim == "allreduce" else 0
    res = solve_milp(net, prim, 32 * MB, m=m, n_chunks=4, root=root, time_limit=60)
    assert res.optimal
    assert evaluate(net, res.strategy).time == pytest.approx(res.objective, rel=1e-6)
    for sub in res.strategy.subs:
        if prim == "broadcast":
            assert sub.aggregate == frozenset()
        else:
            assert sub.root in sub.aggregate
            assert all(net.kinds[i] != "nic" for i in sub.aggregate)
    for name, build in HAND_BUILT.items():                     # same chunk count, same M
        t = evaluate(net, build(net, prim, 0, 32 * MB, n_chunks=4, m=m)).time
        assert res.objective <= t * (1 + 1e-9), name
    forced = solve_milp(net, prim, 32 * MB, m=m, n_chunks=4, root=root, time_limit=60,
                        forwarding=False)                      # the older family: never better
    assert evaluate(net, forced.strategy).time == pytest.approx(forced.objective, rel=1e-6)
    assert res.objective <= forced.objective * (1 + 1e-6)


def test_milp_with_nic_relays_and_aggregator():
    net = make_cluster([1, 1, 1], [100, 100, 50], aggregator_gbps=100, nic_nodes=True)
    res = solve_milp(net, "reduce", 16 * MB, m=2, n_chunks=8, root=0)
    assert evaluate(net, res.strategy).time == pytest.approx(res.objective, rel=1e-6)
    ps = evaluate(net, S.aggregator_star(net, "reduce", 0, 16 * MB, n_chunks=8, m=2)).time
    assert res.objective <= ps * (1 + 1e-9)


def test_a_tie_within_the_tolerance_goes_to_the_fewest_flows_into_one_node():
    """The measured-links case (one slow host): star and tree are bound by the same slow link
    in the pairwise model; with tie_tolerance the pick is the candidate within the band with
    the fewest senders into one node, never slower than the band allows."""
    from host.adapcc.synthesizer import max_fan_in
    net = make_cluster([1, 1, 1, 1], [160, 160, 160, 40], nic_nodes=False)
    star = S.star(net, "allreduce", 0, 0.5 * MB, 4, 1)
    assert max_fan_in(star) == 3
    assert max_fan_in(S.ring(net, "allreduce", 0, 0.5 * MB, 4, 1)) == 1
    plain = Synthesizer("allreduce", 0.5 * MB, m=1, milp_max_nodes=4).synthesize(net)
    tied = Synthesizer("allreduce", 0.5 * MB, m=1, milp_max_nodes=4,
                       tie_tolerance=0.05).synthesize(net)
    band = plain.modeled_time * 1.05
    assert tied.modeled_time <= band
    heuristics = Synthesizer("allreduce", 0.5 * MB, m=1, milp_max_nodes=0)
    in_band = [c for _, c in heuristics._heuristic_candidates(net) if evaluate(net, c).time <= band]
    assert in_band and max_fan_in(tied.strategy) <= min(max_fan_in(c) for c in in_band)
    with pytest.raises(ValueError, match="tie_tolerance"):
        Synthesizer("allreduce", MB, tie_tolerance=-1)
