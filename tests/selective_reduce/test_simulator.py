"""Controller/simulator properties S1-S3 and the default-setting comparison (short runs)."""
import pytest

from host.selective_reduce.policies import AllReduce, PartialReduce, SelectiveReduce
from host.selective_reduce.simulator import SimConfig, Simulation


def run(policy, **kw):
    return Simulation(SimConfig(**kw), policy).run()


def assert_no_overlap(result):
    """S2: a worker is never in two syncs at once."""
    by_worker = {}
    for s in result.syncs:
        for w in s.members:
            by_worker.setdefault(w, []).append((s.start, s.end))
    for spans in by_worker.values():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert b0 >= a1 - 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_s1_s2_selective_vs_partial_defaults(seed):
    kw = dict(n=40, duration=30.0, seed=seed)
    sr, pr = run(SelectiveReduce(), **kw), run(PartialReduce(), **kw)
    p = SimConfig(**kw).p
    assert all(len(s.members) == p for s in pr.syncs)
    assert all(len(s.members) >= p for s in sr.syncs)
    assert sr.avg_scale >= pr.avg_scale
    assert sr.avg_sync_time < pr.avg_sync_time
    assert sr.iterations > pr.iterations
    assert not sr.deadlocked
    for r in (sr, pr):
        assert_no_overlap(r)
        assert r.iterations >= sum(len(s.members) for s in r.syncs)


def test_full_sync_every_c_has_size_n():
    r = run(SelectiveReduce(), n=20, duration=30.0, full_sync_every=3, seed=4)
    sizes = [len(s.members) for s in r.syncs]
    assert 20 in sizes
    assert all(size >= r_p for size in sizes for r_p in [SimConfig(n=20).p])
    # at most c partial syncs between two full syncs
    run_len = 0
    for size in sizes:
        run_len = 0 if size == 20 else run_len + 1
        assert run_len <= 3


def test_all_reduce_scale_is_n():
    r = run(AllReduce(), n=12, duration=60.0)   # 4 s compute rounds: a barrier needs time
    assert r.syncs and all(len(s.members) == 12 for s in r.syncs)


def test_literal_pseudocode_deadlocks_interpretation_a_does_not():
    kw = dict(n=8, p=2, duration=20.0, lam=1.0, eta=0.0, seed=5)
    literal = run(SelectiveReduce(), literal=True, **kw)
    assert literal.deadlocked and literal.total_syncs == 0
    fixed = run(SelectiveReduce(), **kw)
    assert not fixed.deadlocked and fixed.total_syncs > 0


def test_s3_uniform_bandwidth_never_waits():
    r = run(SelectiveReduce(), n=16, duration=20.0, lam=1.0, eta=0.0, seed=6)
    assert r.wasted_wait == 0.0
    assert all(len(s.members) >= SimConfig(n=16).p for s in r.syncs)


def test_cold_start_and_bandwidth_error_run():
    for kw in (dict(warm=False), dict(bw_error=0.3), dict(bw_error=0.3, bw_error_mode="dynamic")):
        r = run(SelectiveReduce(), n=20, duration=20.0, **kw)
        assert r.total_syncs > 0 and not r.deadlocked
        assert r.avg_scale >= SimConfig(n=20).p


def test_bad_config_refused():
    with pytest.raises(ValueError, match="p must be"):
        SimConfig(n=10, p=11)
    with pytest.raises(ValueError, match="trace"):
        SimConfig(trace="rnn")
