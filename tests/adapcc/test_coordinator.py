"""Coordinator: break-even bound (T14), decisions on a worked example, faults (T13-T16)."""
import numpy as np
import pytest

from host.adapcc.coordinator import (Coordinator, SkiRentalCostModel, faulty_workers,
                                     offline_optimum, redistribute_batch)

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
