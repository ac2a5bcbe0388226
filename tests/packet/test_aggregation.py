"""Aggregation semantics (docs/protocol.md §4-§5), every target."""
import numpy as np
import pytest

from host.packets import FLAG_LATE, FLAG_RESERVE, FLAG_RETX, TYPE_STRAGGLER
from .scenario import (TABLE, check_counters, check_result, data_frames, flush_frame,
                       make_config, make_job, outputs, sums_of, tos_of, vpp_for)


def all_bits(n):
    return (1 << n) - 1


@pytest.mark.parametrize("n_workers", range(2, 9))
def test_aggregation_sums_match_numpy(target, n_workers):
    vpp = vpp_for(target)
    job = make_job(1, n_workers)
    target.start(make_config(job))
    num_values = 2 * vpp + vpp // 2 + 1            # two full packets and an odd tail
    rng = np.random.default_rng(n_workers)
    idx = rng.integers(0, 16, (n_workers, num_values))
    frames = []
    for w, m in enumerate(job.members):
        frames += data_frames(m, idx[w], job=1, slot=3, expected=all_bits(n_workers), vpp=vpp,
                              offset=500, tos=tos_of(band=2))
    got = outputs(target.run(frames))
    assert len(got) == 3 * n_workers, "one RESULT per member per packet"
    want = sums_of(idx)
    by_slot = {}
    for o in got:
        by_slot.setdefault(o.slot, []).append(o)
    assert sorted(by_slot) == [3, 4, 5]
    for k, slot in enumerate([3, 4, 5]):
        per_member = sorted(by_slot[slot], key=lambda o: o.worker)
        for m, o in zip(job.members, per_member):
            check_result(o, m, job=1, slot=slot, round_=0, sums=want[k * vpp:(k + 1) * vpp],
                         contributors=all_bits(n_workers), expected=all_bits(n_workers),
                         offset=500 + k * vpp, tos=tos_of(band=2))
    check_counters(target, jobs={1: dict(rx=3 * n_workers, aggregated=3 * n_workers,
                                         results_multicast=3)})


def test_every_index_value_maps_through_the_table(target):
    job = make_job(1, 2)
    target.start(make_config(job))
    a = np.arange(16)
    b = np.arange(16)[::-1]
    frames = (data_frames(job.members[0], a, job=1, expected=3, vpp=16)
              + data_frames(job.members[1], b, job=1, expected=3, vpp=16))
    got = outputs(target.run(frames))
    assert len(got) == 2
    want = np.asarray(TABLE) + np.asarray(TABLE)[::-1]
    for m, o in zip(job.members, sorted(got, key=lambda o: o.worker)):
        check_result(o, m, job=1, slot=0, round_=0, sums=want, contributors=3, expected=3)


def test_retransmitted_contribution_is_not_double_counted(target):
    job = make_job(1, 3)
    target.start(make_config(job))
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 16, (3, 10))
    m0, m1, m2 = job.members
    first = data_frames(m0, idx[0], job=1, expected=7, vpp=10)
    retx = data_frames(m0, idx[0], job=1, expected=7, vpp=10, flags=FLAG_RETX)
    assert target.run(first + retx + first) == []
    check_counters(target, jobs={1: dict(rx=3, aggregated=1, drop_duplicate=2)})
    got = outputs(target.run(data_frames(m1, idx[1], job=1, expected=7, vpp=10)
                             + data_frames(m2, idx[2], job=1, expected=7, vpp=10)))
    assert len(got) == 3
    for m, o in zip(job.members, sorted(got, key=lambda o: o.worker)):
        check_result(o, m, job=1, slot=0, round_=0, sums=sums_of(idx), contributors=7, expected=7)


def test_lost_result_is_reserved_by_unicast(target):
    job = make_job(1, 3)
    target.start(make_config(job))
    idx = np.random.default_rng(2).integers(0, 16, (3, 9))
    frames = [f for w, m in enumerate(job.members)
              for f in data_frames(m, idx[w], job=1, slot=5, expected=7, vpp=9, tensor=11)]
    assert len(target.run(frames)) == 3
    m1 = job.members[1]
    tos = tos_of(band=0, ecn=1)
    got = outputs(target.run(data_frames(m1, idx[1], job=1, slot=5, expected=7, vpp=9,
                                         tensor=11, flags=FLAG_RETX, tos=tos)))
    assert len(got) == 1, "a re-serve goes to the requester only"
    check_result(got[0], m1, job=1, slot=5, round_=0, sums=sums_of(idx), contributors=7,
                 expected=7, flags=FLAG_RESERVE, tensor=11, tos=tos)
    check_counters(target, jobs={1: dict(rx=4, aggregated=3, results_multicast=1,
                                         results_reserved=1)})


def run_round(target, job, idx, *, slot, round_, expected=None):
    expected = expected or job.expected_all
    frames = [f for w, m in enumerate(job.members)
              for f in data_frames(m, idx[w], job=job.job, slot=slot, round_=round_,
                                   expected=expected, vpp=idx.shape[1])]
    return outputs(target.run(frames))


def test_slot_reuse_across_rounds_keeps_two_copies(target):
    job = make_job(1, 2)
    target.start(make_config(job))
    rng = np.random.default_rng(3)
    rounds = [rng.integers(0, 16, (2, 12)) for _ in range(3)]
    m0, m1 = job.members
    for r in (0, 1):
        got = run_round(target, job, rounds[r], slot=2, round_=r)
        assert len(got) == 2 and all(o.round == r for o in got)
        np.testing.assert_array_equal(got[0].values, sums_of(rounds[r]))
    # Round 2 starts in copy 0 (overwrites round 0) while round 1 stays re-servable.
    assert target.run(data_frames(m0, rounds[2][0], job=1, slot=2, round_=2, expected=3,
                                  vpp=12)) == []
    got = outputs(target.run(data_frames(m1, rounds[1][1], job=1, slot=2, round_=1, expected=3,
                                         vpp=12, flags=FLAG_RETX)))
    assert len(got) == 1
    check_result(got[0], m1, job=1, slot=2, round_=1, sums=sums_of(rounds[1]), contributors=3,
                 expected=3, flags=FLAG_RESERVE)
    got = outputs(target.run(data_frames(m1, rounds[2][1], job=1, slot=2, round_=2, expected=3,
                                         vpp=12)))
    assert len(got) == 2
    for m, o in zip(job.members, sorted(got, key=lambda o: o.worker)):
        check_result(o, m, job=1, slot=2, round_=2, sums=sums_of(rounds[2]), contributors=3,
                     expected=3)
    check_counters(target, jobs={1: dict(rx=7, aggregated=6, results_multicast=3,
                                         results_reserved=1)})


def test_obsolete_round_gets_a_straggler_notice(target):
    job = make_job(1, 2)
    target.start(make_config(job))
    rng = np.random.default_rng(4)
    for r in range(3):
        run_round(target, job, rng.integers(0, 16, (2, 6)), slot=1, round_=r)
    m0 = job.members[0]
    # Copy 0 now holds round 2; worker 0 is far behind with round 0 of slot 1.
    tos = tos_of(band=4, ecn=0)
    got = outputs(target.run(data_frames(m0, np.arange(6), job=1, slot=1, round_=0, expected=3,
                                         vpp=6, tensor=9, offset=12, tos=tos)))
    assert len(got) == 1
    o = got[0]
    assert o.type == TYPE_STRAGGLER and o.port == m0.port and o.worker == 0
    assert (o.job, o.slot, o.round, o.contributors, o.count) == (1, 1, 2, 3, 2)
    assert (o.num_values, len(o.values), o.tensor, o.offset, o.expected) == (0, 0, 9, 12, 3)
    assert o.tos == tos
    check_counters(target, jobs={1: dict(rx=7, aggregated=6, results_multicast=3,
                                         straggler_notices=1)})


def test_completion_by_expected_set_names_the_contributors(target):
    job = make_job(1, 4)
    target.start(make_config(job))
    idx = np.random.default_rng(5).integers(0, 16, (4, 8))
    m = job.members
    assert target.run(data_frames(m[1], idx[1], job=1, expected=0b0110, vpp=8)) == []
    got = outputs(target.run(data_frames(m[2], idx[2], job=1, expected=0b0110, vpp=8)))
    assert len(got) == 4, "the result goes to every member of the job"
    for mem, o in zip(m, sorted(got, key=lambda o: o.worker)):
        check_result(o, mem, job=1, slot=0, round_=0, sums=sums_of(idx[1:3]),
                     contributors=0b0110, expected=0b0110)


def test_completion_by_min_count_and_late_worker(target):
    job = make_job(1, 4)
    target.start(make_config(job))
    idx = np.random.default_rng(6).integers(0, 16, (4, 7))
    m = job.members
    kw = dict(job=1, slot=9, expected=0b1111, min_count=2, vpp=7)
    assert target.run(data_frames(m[3], idx[3], **kw)) == []
    got = outputs(target.run(data_frames(m[0], idx[0], **kw)))
    assert len(got) == 4
    for mem, o in zip(m, sorted(got, key=lambda o: o.worker)):
        check_result(o, mem, job=1, slot=9, round_=0, sums=sums_of(idx[[0, 3]]),
                     contributors=0b1001, expected=0b1111, min_count=2)
    # Worker 2 arrives after the partial completion: it gets the stored result, LATE.
    got = outputs(target.run(data_frames(m[2], idx[2], **kw)))
    assert len(got) == 1
    check_result(got[0], m[2], job=1, slot=9, round_=0, sums=sums_of(idx[[0, 3]]),
                 contributors=0b1001, expected=0b1111, min_count=2,
                 flags=FLAG_RESERVE | FLAG_LATE)
    check_counters(target, jobs={1: dict(rx=3, aggregated=2, results_multicast=1,
                                         results_reserved=1)})


def test_two_jobs_run_side_by_side_without_interference(target):
    job_a = make_job(1, 3, first_port=0)
    job_b = make_job(2, 2, first_port=3)
    target.start(make_config(job_a, job_b))
    rng = np.random.default_rng(7)
    ia, ib = rng.integers(0, 16, (3, 20)), rng.integers(0, 16, (2, 20))
    frames = []
    # Same slot and round in both jobs, interleaved packet by packet.
    fa = [data_frames(m, ia[w], job=1, slot=4, expected=7, vpp=20) for w, m in enumerate(job_a.members)]
    fb = [data_frames(m, ib[w], job=2, slot=4, expected=3, vpp=20) for w, m in enumerate(job_b.members)]
    frames = fa[0] + fb[0] + fa[1] + fb[1] + fa[2]
    got = outputs(target.run(frames))
    assert len(got) == 5
    for o in got:
        jb, idx = (job_a, ia) if o.job == 1 else (job_b, ib)
        m = jb.members[o.worker]
        check_result(o, m, job=jb.job, slot=4, round_=0, sums=sums_of(idx),
                     contributors=jb.expected_all, expected=jb.expected_all)
    check_counters(target, jobs={1: dict(rx=3, aggregated=3, results_multicast=1),
                                 2: dict(rx=2, aggregated=2, results_multicast=1)})


def test_flush_resets_the_slot(target):
    job = make_job(1, 2)
    target.start(make_config(job))
    rng = np.random.default_rng(8)
    stale, fresh = rng.integers(0, 16, (2, 10)), rng.integers(0, 16, (2, 10))
    m0, m1 = job.members
    assert target.run(data_frames(m0, stale[0], job=1, slot=6, expected=3, vpp=10)) == []
    assert target.run([flush_frame(m1, job=1, slot=6)]) == []
    # Worker 0's stale contribution is gone: its new one aggregates (no duplicate).
    got = run_round(target, job, fresh, slot=6, round_=0)
    assert len(got) == 2
    np.testing.assert_array_equal(got[0].values, sums_of(fresh))
    # After a flush a completed round is gone too: a retransmission starts afresh.
    assert target.run([flush_frame(m0, job=1, slot=6)]) == []
    assert target.run(data_frames(m0, fresh[0], job=1, slot=6, expected=3, vpp=10,
                                  flags=FLAG_RETX)) == []
    check_counters(target, jobs={1: dict(rx=6, aggregated=4, results_multicast=1, flushes=2)})


def test_rounds_wrap_around_with_serial_number_order(target):
    """§4.2 (R1): round 0 is newer than 0xFFFFFFFF and 0xFFFFFFFE; a round half the
    number space away (2^31) counts as older."""
    job = make_job(1, 2)
    target.start(make_config(job))
    rng = np.random.default_rng(11)
    m0 = job.members[0]
    for r in (0xFFFFFFFE, 0xFFFFFFFF, 0, 1):        # copies 0, 1, 0, 1: each replaces one
        idx = rng.integers(0, 16, (2, 5))
        got = run_round(target, job, idx, slot=1, round_=r)
        assert len(got) == 2, f"round {r:#x} must aggregate and complete"
        for m, o in zip(job.members, sorted(got, key=lambda o: o.worker)):
            check_result(o, m, job=1, slot=1, round_=r, sums=sums_of(idx), contributors=3,
                         expected=3)
    # Stale rounds of either copy, and a round 2^31 ahead of copy 0's round 0.
    for stale, now_in_copy in ((0xFFFFFFFE, 0), (0xFFFFFFFF, 1), (0x80000000, 0)):
        got = outputs(target.run(data_frames(m0, np.arange(5), job=1, slot=1, round_=stale,
                                             expected=3, vpp=5)))
        assert len(got) == 1, f"round {stale:#x}"
        o = got[0]
        assert o.type == TYPE_STRAGGLER and o.worker == 0 and o.port == m0.port
        assert (o.round, o.contributors, o.count) == (now_in_copy, 3, 2), f"round {stale:#x}"
    check_counters(target, jobs={1: dict(rx=11, aggregated=8, results_multicast=4,
                                         straggler_notices=3)})


def test_largest_packets_aggregate(target):
    """8192 values in one DATA (R7): a job sized for it, where the plane allows it."""
    values = 8192
    if target.max_values < values:
        pytest.skip(f"{target.name} carries at most {target.max_values} values per packet")
    job = make_job(1, 2, pool_size=4, values_per_packet=values)
    target.start(make_config(job))
    idx = np.random.default_rng(12).integers(0, 16, (2, values))
    frames = [f for w, m in enumerate(job.members)
              for f in data_frames(m, idx[w], job=1, slot=3, expected=3, vpp=values)]
    assert len(frames) == 2 and len(frames[0][1]) == 14 + 20 + 8 + 32 + values // 2
    got = outputs(target.run(frames))
    assert len(got) == 2
    for m, o in zip(job.members, sorted(got, key=lambda o: o.worker)):
        assert len(o.frame) == 14 + 20 + 8 + 32 + values        # 8266 bytes on the wire
        check_result(o, m, job=1, slot=3, round_=0, sums=sums_of(idx), contributors=3,
                     expected=3)
    check_counters(target, jobs={1: dict(rx=2, aggregated=2, results_multicast=1)})
