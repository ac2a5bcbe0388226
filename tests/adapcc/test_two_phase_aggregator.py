"""Phase 1 (expected = ready set) + phase 2 through the reference UDP aggregator: full sum."""
import threading
import time

import numpy as np
import pytest

import thc
from dataplane.config import Job, Member, SwitchConfig
from dataplane.ports import free_port
from dataplane.udp_service import serve
from host.adapcc.coordinator import LiveCoordinator, SkiRentalCostModel
from host.adapcc.partial_aggregation import two_phase_allreduce
from host.transport import AggregatorTransport

TABLE = np.asarray(thc.optimal_table(4, 30, 1 / 32, symmetric=True))


def pack(idx):
    if len(idx) % 2:
        idx = np.concatenate([idx, np.zeros(1, np.uint8)])
    return ((idx[0::2] << 4) | idx[1::2]).astype(np.uint8)


@pytest.fixture
def job():
    n, pool = 4, 3
    addrs = [("127.0.0.1", free_port()) for _ in range(n)]
    members = [Member(worker=w, port=w, mac=f"02:00:00:00:01:{w + 1:02x}", ip=ip, udp_port=p)
               for w, (ip, p) in enumerate(addrs)]
    cfg = SwitchConfig(ip="127.0.0.1", jobs=(Job.from_thc(1, pool, members),)).validate()
    svc = serve(cfg, "127.0.0.1", 0)
    ts = [AggregatorTransport(svc.address, job=1, worker=w, expected=(1 << n) - 1, pool_size=pool,
                              local=addrs[w], values_per_packet=128, timeout=10) for w in range(n)]
    for t in ts:
        t.flush()
    time.sleep(0.05)
    yield svc, ts
    for t in ts:
        t.close()
    svc.stop()


def run_threads(n, fn, delays):
    out, errors = [None] * n, []

    def body(w):
        try:
            time.sleep(delays[w])
            out[w] = fn(w)
        except Exception as exc:
            errors.append(exc)
    threads = [threading.Thread(target=body, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_two_phase_equals_full_sum_with_a_late_worker(job):
    svc, ts = job
    n, d = 4, 1001
    rng = np.random.default_rng(3)
    idx = [rng.integers(0, 16, d).astype(np.uint8) for _ in range(n)]
    # S/B = 25 ms: extra(2) = 50 ms, extra(3) = 83 ms, so only a 50 ms stall between the
    # ready workers' registrations could make the decision leave out a ready worker
    cost = SkiRentalCostModel(n, 100e6, tuple([1e9] * n))
    live = LiveCoordinator(cost, 0.005)
    late = 2

    def worker(w):
        if w == late:                       # straggler: ready only after the coordinator moved on
            live.wait_decision(30)
            time.sleep(0.05)
        live.register_ready(w)
        decision = live.wait_decision(30)
        return decision, two_phase_allreduce(ts[w], pack(idx[w]), d, set(decision.ready),
                                             set(range(n)), (10, 11))
    pairs = run_threads(n, worker, [0.0, 0.002, 0.0, 0.001])
    decision = pairs[0][0]
    assert decision.action == "partial" and decision.relays == frozenset({late})
    ready = set(decision.ready)
    out = [res for _, res in pairs]
    full = np.sum([TABLE[i] for i in idx], axis=0)
    phase1 = np.sum([TABLE[idx[w]] for w in ready], axis=0)
    for w, res in enumerate(out):
        assert np.array_equal(res.sums.astype(np.int64), full), w
        assert np.array_equal(res.phase1.sums.astype(np.int64), phase1), w
        assert set(res.counts.tolist()) == {n}
    assert len({tuple(t.slot_rounds.tolist()) for t in ts}) == 1      # rounds stay in step
    # a normal full allreduce afterwards still works (slot rounds consistent at the aggregator)
    again = run_threads(n, lambda w: ts[w].allreduce(pack(idx[w]), d, 12), [0] * n)
    assert all(np.array_equal(r.sums.astype(np.int64), full) for r in again)
    c = svc.counters()["jobs"][1]
    assert c["drop_bad_expected"] == 0


def test_two_phase_refuses_bad_ready_set(job):
    _, ts = job
    with pytest.raises(ValueError, match="subset"):
        two_phase_allreduce(ts[0], pack(np.zeros(4, np.uint8)), 4, {7}, {0, 1, 2, 3}, (1, 2))


def test_faulty_worker_is_dropped_and_survivors_sum(job):
    from host.adapcc.coordinator import faulty_workers
    svc, ts = job
    n, d = 4, 300
    rng = np.random.default_rng(4)
    idx = [rng.integers(0, 16, d).astype(np.uint8) for _ in range(n)]
    ready_at = {0: 0.0, 1: 0.001, 3: 0.002}            # worker 2 never becomes ready
    faulty = faulty_workers(ready_at, n, first_ready=0.0, phase1_end=0.01, now=0.2)
    assert faulty == {2}
    survivors = set(range(n)) - faulty
    out = run_threads(n - 1, lambda k: two_phase_allreduce(
        ts[sorted(survivors)[k]], pack(idx[sorted(survivors)[k]]), d, survivors, survivors,
        (20, 21)), [0, 0, 0])
    want = np.sum([TABLE[idx[w]] for w in survivors], axis=0)
    for res in out:
        assert res.phase2 is None
        assert np.array_equal(res.sums.astype(np.int64), want)
        assert set(res.counts.tolist()) == {3}
