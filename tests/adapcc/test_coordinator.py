"""Coordinator: break-even bound (T14), decisions on a worked example, faults (T13-T16), the
wait before phase 2 in the cost, and the trend against always-wait on Fig. 3-calibrated times."""
import numpy as np
import pytest

from host.adapcc.coordinator import (Coordinator, SkiRentalCostModel, fault_timeout,
                                     faulty_workers, offline_optimum, redistribute_batch)
from host.experiments.adapcc.study import ready_times, study_cost_model

CYCLE = 0.005


def artifact_model(n=8):
    """The artifact's constants: S = 100 MB as Gbit, B = 50 Gbps per worker -> S/B = 1.95 ms."""
    s_gbit = 100 * 8 / 1024
    return SkiRentalCostModel(n, s_gbit * 1e9 / 8, tuple([50e9 / 8] * n))


def test_digest_example_costs():
    cost = artifact_model()
    assert cost.s_over_b == pytest.approx(1.953e-3, rel=1e-3)
    assert cost.full() == pytest.approx(27.3e-3, rel=2e-3)
    assert cost.buy(2) == pytest.approx(31.25e-3, rel=2e-3)
    assert cost.buy(7) == pytest.approx(42.4e-3, rel=2e-3)


def test_digest_example_decisions():
    # two ready at t=0, the rest never (within the trace horizon): proceed after one cycle
    d = Coordinator(artifact_model(), CYCLE).run_trace([0, 0] + [1.0] * 6)
    assert d.action == "partial" and d.time == pytest.approx(0.005)
    assert d.relays == frozenset(range(2, 8))
    # seven ready at t=0: extra cost 15.07 ms, so it proceeds at the first cycle with rent >= that
    assert artifact_model().extra(7) == pytest.approx(15.07e-3, rel=1e-3)
    d = Coordinator(artifact_model(), CYCLE).run_trace([0] * 7 + [1.0])
    assert d.action == "partial" and d.time == pytest.approx(0.020)
    assert d.ready == frozenset(range(7))


def test_partial_cost_includes_the_wait_before_phase_2():
    cost = artifact_model()
    # proceeds at 5 ms with two ready; the six late workers are ready at 1 s, so phase 2 (their
    # data) starts at 1 s, long after phase 1 ended
    d = Coordinator(cost, CYCLE).run_trace([0, 0] + [1.0] * 6)
    assert d.cost == pytest.approx(1.0 + cost.phase2())
    assert d.cost > d.time + cost.buy(2)
    # late data ready before phase 1 ends: no wait, the price the rule decided on
    d = Coordinator(cost, CYCLE).run_trace([0] * 7 + [0.021])
    assert d.action == "partial" and d.cost == pytest.approx(0.020 + cost.buy(7))
    # the offline optimum scores its partial choices the same way: no partial choice ends
    # before the late data is ready + phase 2
    assert offline_optimum(cost, [0, 0] + [1.0] * 6, CYCLE) == pytest.approx(1.0 + cost.phase2())


def test_live_partial_decision_leaves_the_cost_open():
    rule = Coordinator(artifact_model(), CYCLE)
    for w in range(7):
        rule.register_ready(w, 0.0)              # worker 7's ready time is not known yet
    d = rule.decide(0.020)
    assert d.action == "partial" and d.cost is None


def test_t13_everyone_ready_early_runs_full():
    d = Coordinator(artifact_model(), CYCLE).run_trace([0, 0.001, 0.002, 0, 0.003, 0, 0, 0.001])
    assert d.action == "full" and d.relays == frozenset()


def test_t15_decisions_on_cycle_boundaries_and_two_ready():
    d = Coordinator(artifact_model(), CYCLE).run_trace([0.0] + [0.5] * 7)
    assert d.action == "full"            # a single ready worker never proceeds alone
    times = np.random.default_rng(0).exponential(0.02, 8)
    d = Coordinator(artifact_model(), CYCLE).run_trace(list(times))
    assert ((d.time - times.min()) / CYCLE) == pytest.approx(round((d.time - times.min()) / CYCLE))


@pytest.mark.parametrize("scale", [0.002, 0.02, 0.2])
def test_t14_break_even_within_twice_offline_optimum(scale):
    rng = np.random.default_rng(11)
    for trial in range(300):
        n = int(rng.integers(2, 12))
        cost = SkiRentalCostModel(n, float(rng.uniform(1e6, 5e8)),
                                  tuple(rng.uniform(1e9, 2.5e10, n)))
        ready = list(rng.pareto(1.5, n) * scale)
        online = Coordinator(cost, CYCLE).run_trace(ready).cost
        opt = offline_optimum(cost, ready, CYCLE)
        assert online <= 2 * opt + 2 * CYCLE + 1e-12, (trial, online, opt)


def _replay(case, scenario, seed, traces=100):
    cost, rng = study_cost_model(), np.random.default_rng(seed)
    be, wait = [], []
    for _ in range(traces):
        trace = ready_times(rng, scenario, case)
        be.append(Coordinator(cost, CYCLE).run_trace(trace).cost)
        wait.append(Coordinator(cost, CYCLE, policy="always-wait").run_trace(trace).cost)
    return cost, np.array(be), np.array(wait)


@pytest.mark.parametrize("scenario", ["heterogeneous", "homogeneous"])
def test_calibrated_ready_times_match_fig3_medians(scenario):
    rng = np.random.default_rng(0)
    spreads = [np.ptp(ready_times(rng, scenario)) for _ in range(4000)]
    ratio = np.median(spreads) / study_cost_model().full()
    assert ratio == pytest.approx({"heterogeneous": 0.23, "homogeneous": 0.10}[scenario], rel=0.1)


@pytest.mark.parametrize("scenario", ["heterogeneous", "homogeneous"])
def test_break_even_never_worse_than_always_wait_on_calibrated_times(scenario):
    """With the wait before phase 2 counted, break-even's mean over 100 iterations stays within
    2 % of waiting for everyone on every seed, and no single iteration loses more than the rent
    the rule may pay before buying (max_k C_buy(k) - C_full)."""
    for seed in range(20):
        cost, be, wait = _replay("calibrated", scenario, seed)
        assert be.mean() <= 1.02 * wait.mean(), seed
        max_rent = max(cost.extra(k) for k in range(2, cost.n))
        assert (be - wait).max() <= max_rent + 1e-9, seed


def test_break_even_gains_on_heavy_straggler_times():
    """The heavy case (about 11x Fig. 3's median wait): break-even beats waiting on every seed,
    but modestly (a few %), once the wait before phase 2 is counted."""
    for seed in range(10):
        _, be, wait = _replay("heavy", "heterogeneous", seed)
        assert be.mean() <= 0.99 * wait.mean(), seed
        assert be.mean() >= 0.85 * wait.mean(), seed


def test_k_of_n_and_policies():
    cost = artifact_model()
    ready = [0, 0.001, 0.002, 0.012, 0.3, 0.3, 0.3, 0.3]
    assert Coordinator(cost, CYCLE, k_of_n=4).run_trace(ready).time == pytest.approx(0.015)
    assert Coordinator(cost, CYCLE, policy="always-wait").run_trace(ready).action == "full"
    never = Coordinator(cost, CYCLE, policy="never-wait").run_trace(ready)
    assert never.action == "partial" and never.time == pytest.approx(0.005)
    with pytest.raises(ValueError, match="k_of_n"):
        Coordinator(cost, CYCLE, k_of_n=1)


def test_t16_faulty_rule_and_redistribution():
    ready = {0: 0.0, 1: 0.01, 2: 0.02}
    # phase 1 ends at 0.03 -> deadline 0.03 + 5 * 0.03 = 0.18
    assert faulty_workers(ready, 4, 0.0, 0.03, now=0.1) == set()
    assert faulty_workers(ready, 4, 0.0, 0.03, now=0.2) == {3}
    assert faulty_workers({**ready, 3: 0.17}, 4, 0.0, 0.03, now=0.2) == set()
    # the default is the paper's rule alone: a never-ready worker is faulty right at 5x the span
    assert fault_timeout(0.0, 0.03) == pytest.approx(0.15)
    assert faulty_workers(ready, 4, 0.0, 0.03, now=0.1799) == set()
    assert faulty_workers(ready, 4, 0.0, 0.03, now=0.18) == {3}
    # the floor is an explicit option; it only lengthens a short 5x timeout
    assert faulty_workers(ready, 4, 0.0, 0.03, now=0.2, min_fault_timeout=2.0) == set()
    assert faulty_workers(ready, 4, 0.0, 0.03, now=2.03, min_fault_timeout=2.0) == {3}
    assert fault_timeout(0.0, 0.03, min_fault_timeout=0.1) == pytest.approx(0.15)
    batches = redistribute_batch(256, [0, 1, 2])
    assert sum(batches.values()) == 256 and max(batches.values()) - min(batches.values()) <= 1
    with pytest.raises(ValueError):
        redistribute_batch(256, [])


def test_live_coordinator_decides_in_real_time():
    from host.adapcc.coordinator import LiveCoordinator
    cost = SkiRentalCostModel(4, 100e6, tuple([1e10] * 4))     # extra(3) = 8.3 ms
    live = LiveCoordinator(cost, CYCLE)
    live.register_ready(0, 1, 3)
    d = live.wait_decision(10)
    assert d.action == "partial" and d.relays == frozenset({2})
    assert (d.time - live._rule.first_ready) == pytest.approx(0.010, abs=1e-9)
    everyone = LiveCoordinator(cost, CYCLE)
    everyone.register_ready(0, 1, 2, 3)
    assert everyone.wait_decision(10).action == "full"
    with pytest.raises(TimeoutError, match="two workers"):
        LiveCoordinator(cost, CYCLE).wait_decision(0.01)
