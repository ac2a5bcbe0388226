"""Profiler (T11, T12), behaviour tuples (T4) and the gloo end-to-end run (T1-T3, T5)."""
import numpy as np
import pytest

from host.adapcc import strategies as S
from host.adapcc.costmodel import Strategy, SubCollective
from host.adapcc.executor import behaviours, partitions
from host.experiments.adapcc.gloo_check import run_all
from host.adapcc.profiler import PeriodicProfiler, _plan, fit_alpha_beta, round_schedule


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_t11_round_schedule_collision_free(n):
    rounds = round_schedule(n)
    assert len(rounds) == n - 1
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == sorted((i, j) for i in range(n) for j in range(n) if i != j)
    for r in rounds:
        assert len({s for s, _ in r}) == n and len({d for _, d in r}) == n


def test_t12_fit_recovers_alpha_beta():
    rng = np.random.default_rng(0)
    alpha, beta = 50e-6, 8 / 10e9
    samples = []
    for n, s in _plan((16e3, 128e3, 1e6), (1, 4, 8), 3):
        t = n * alpha + n * s * beta
        samples.append((n, n * s, t * (1 + rng.normal(0, 0.02))))
    a, b = fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=0.15)
    assert b == pytest.approx(beta, rel=0.05)
    with pytest.raises(ValueError, match="two different"):
        fit_alpha_beta([(1, 100, 1.0)])


def test_periodic_profiler_refuses_zero_period():
    with pytest.raises(ValueError, match="period"):
        PeriodicProfiler(period=0)


def chain_strategy():
    # reduce chain 3 -> 2 -> 1 -> 0 plus leaf 4 -> 0 (five ranks)
    routes = {3: [3, 2, 1, 0], 2: [2, 1, 0], 1: [1, 0], 4: [4, 0]}
    return Strategy("reduce", [SubCollective(0, 1.0, 1.0, routes, frozenset(range(5)))])


def test_t4_behaviour_tuples():
    strat = chain_strategy()
    beh = behaviours(strat, 0, active={0, 3}, n_ranks=5)
    # relays 2 and 1 with one live predecessor: forward only
    for r in (1, 2):
        assert (beh[r].has_recv, beh[r].has_kernel, beh[r].has_send) == (True, False, True)
    # leaf relay 4: nothing to do
    assert (beh[4].has_recv, beh[4].has_kernel, beh[4].has_send) == (False, False, False)
    # root never sends
    assert beh[0].has_send is False and beh[0].has_recv is True
    assert beh[3] == type(beh[3])(True, False, False, True)
    bc = S.ring(S.make_uniform_network(4), "broadcast", 0, 1.0)
    assert not any(b.has_kernel for b in behaviours(bc, 0, {0, 1, 2, 3}, 4).values())


def test_partitions_cover_uneven_sizes():
    strat = S.ring(S.make_uniform_network(3), "allreduce", 0, 10.0, n_chunks=4, m=3)
    for numel in (1, 7, 1001):
        parts = partitions(strat, numel)
        assert sum(length for _, length, _ in parts) == numel
        assert all(o2 == o1 + l1 for (o1, l1, _), (o2, _, _) in zip(parts, parts[1:]))


@pytest.fixture(scope="module")
def gloo_results():
    return run_all(world=4, timeout=240)


def test_gloo_end_to_end(gloo_results):
    assert sorted(gloo_results) == [0, 1, 2, 3]
    for rank, res in gloo_results.items():
        assert "error" not in res, res
        for key in ("allreduce_int_exact", "allreduce_float_close", "broadcast_exact",
                    "phase1_ready_sum_exact", "two_phase_full_sum_exact", "fig6_phase1_3_full_4",
                    "switched_strategy_close", "periodic_profile", "late_relay_joins_exact",
                    "late_leaf_exact"):
            assert res[key] is True, (rank, key)
        # rank 2 relays rank 3's data in phase 1 and joins from chunk 2 on: phase 2 runs
        # only chunks 0 and 1 of 6; the chain's leaf carries nothing, so it misses all 6
        assert res["late_relay_phase2_steps"] == [2, 6], (rank, res)
        assert res["late_leaf_phase2_steps"] == [6, 6], (rank, res)
    assert gloo_results[2]["reduce_root_exact"] is True
    prof = gloo_results[0]
    assert len(prof["gbps"]) == 12 and all(g > 0 and np.isfinite(g) for g in prof["gbps"])
    assert all(a >= 0 for a in prof["alpha_us"])


def test_shared_nic_network_reads_a_pairwise_profile_as_servers():
    """Ranks 0-1 on server 0 (NIC 0.1 Gbit/s), 2-3 on server 1 (NIC 0.04): every pair across
    runs at the slower NIC, pairs inside at 10 Gbit/s. Read as servers, rank r stays node r,
    each server gets four NIC relays, and a flow from rank 3 to rank 0 crosses both NICs."""
    import numpy as np

    from host.adapcc.costmodel import Network, on_gpus
    from host.adapcc.profiler import shared_nic_network
    from host.adapcc.synthesizer import Synthesizer
    servers = [0, 0, 1, 1]
    gbps = np.array([[0, 10, .04, .04], [10, 0, .04, .04], [.04, .04, 0, 10],
                     [.04, .04, 10, 0]], dtype=float)
    with np.errstate(divide="ignore"):
        beta = np.where(gbps > 0, 8 / (gbps * 1e9), np.inf)
    alpha = np.where(np.isfinite(beta), 100e-6, np.inf)
    profile = Network([f"rank{r}" for r in range(4)], ["gpu"] * 4, alpha, beta)
    net = shared_nic_network(profile, servers)
    assert net.kinds[:4] == ["gpu"] * 4 and net.kinds[4:] == ["nic"] * 8
    path = net.relay_path(3, 0)
    assert [net.kinds[v] for v in path] == ["gpu"] + ["nic"] * 4 + ["gpu"]
    rates = sorted({round(8 / float(net.beta[e]) / 1e9, 6) for e in zip(path, path[1:])})
    assert rates[0] == 0.04                      # the slower NIC is what limits the flow
    # the pick runs over ranks only once its relays are left out
    synth = Synthesizer("allreduce", 1 << 20, m=1)
    synth.update_profile(net)
    ranks_only = on_gpus(synth.current.strategy, net)
    for sub in ranks_only.subs:
        assert all(v < 4 for p in sub.routes.values() for v in p)
    with pytest.raises(ValueError, match="next to each other"):
        shared_nic_network(profile, [0, 1, 0, 1])
    with pytest.raises(ValueError, match="one server"):
        shared_nic_network(profile, [0, 0, 0, 0])
    with pytest.raises(ValueError, match="4 nodes"):
        shared_nic_network(profile, [0, 1])
