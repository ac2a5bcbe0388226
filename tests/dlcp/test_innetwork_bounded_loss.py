"""Bounded loss on the in-network THC path, over real sockets: the reference aggregator
behind a lossy relay, three worker processes (gloo process group for the agreement).

* Lost everywhere: the relay drops every DATA packet (retransmissions included) of one
  chunk from worker 0, so no worker ever gets that chunk. With loss_bound=0.2 every worker
  finishes, the chunk is decoded as lost alike everywhere (bit-identical means), and
  partitions without it equal the exact (loss-free) result bit for bit.
* Back at some workers only: in addition every RESULT of another chunk goes to workers 0
  and 2 only, plus 2 % random loss both ways. The workers that got every sum return at
  once; worker 1 asks for the call's sums over the collective, so every worker decodes the
  exact result.
* On a process group of the caller's (the agreement at the end of every call, fallback
  "raise") both cases decode what THC's own group decodes.
* Under DDP, with a chunk that never reaches worker 1: DDP's bucket rebuild after its first
  step (a collective on DDP's group) does not meet worker 1 still waiting for its rescue.
"""
import datetime
import time
import traceback

import numpy as np
import pytest

import thc
from dataplane.config import Job, Member, SwitchConfig
from dataplane.ports import free_port
from host.netlab.relay import (DOWN, UP, LossyRelay, agg_chunk, agg_worker, any_of,
                               random_loss)
from host.packets import TYPE_DATA, TYPE_RESULT

WORLD = 3
D = 50_000
PARTITION = 1 << 14
VPP = 1024
LOSS_BOUND = 0.2
BLACKHOLED = 3          # chunk whose DATA from worker 0 never arrives
HIDDEN_FROM_1 = 20      # chunk whose RESULT never reaches worker 1


TENSOR = 0              # the tensor id whose chunks the two fixed drops pick


def _chunk(data: bytes, ptype: int):
    return agg_chunk(data, ptype, VPP, TENSOR)


def blackholed(d) -> bool:
    return d.direction == UP and d.member == 0 and _chunk(d.data, TYPE_DATA) == BLACKHOLED


def hidden_from_1(d) -> bool:
    return d.direction == DOWN and d.member == 1 and _chunk(d.data, TYPE_RESULT) == HIDDEN_FROM_1


def agg_relay(loss: float, seed: int = 0, *rules) -> LossyRelay:
    """A relay for WORLD workers (one proxy each) dropping by `rules`, then at random."""
    return LossyRelay(("127.0.0.1", 1), any_of(*rules, random_loss(loss, seed=seed)),
                      members=WORLD, member_of=agg_worker)


def grad(rank):
    g = np.random.default_rng(rank).standard_normal(D).astype(np.float32)
    g[:PARTITION] *= 5.0                     # one partition of larger gradients
    return g


def _join(rank, init, timeout_s: float) -> None:
    """A worker process's start: one thread each for torch and the codec, the gloo group."""
    import numba
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker(rank, init, lossy, exact, own, queue):
    import torch
    import torch.distributed as dist

    from host.ddp_hook import thc_hook_state
    try:
        _join(rank, init, 60)
        codec = thc.THCCodec(seed=5, partition_size=PARTITION)
        g = torch.from_numpy(grad(rank))
        g_next = torch.from_numpy(grad(rank + WORLD))
        out = {}
        # The exact reference first, on a loss-free aggregator (round 0, no error feedback).
        state = thc_hook_state(aggregator=exact, job_config=own, codec=codec, pool_size=64,
                               timeout=10,
                               error_feedback=False, values_per_packet=VPP)
        out["exact"] = state.reduce(g, 0).numpy()
        out["exact_next"] = state.reduce(g_next, 0).numpy()
        state.close()
        state = thc_hook_state(aggregator=lossy, job_config=own, codec=codec, pool_size=64,
                               timeout=10,
                               error_feedback=False, values_per_packet=VPP,
                               loss_bound=LOSS_BOUND)
        t0 = time.monotonic()
        out["bounded"] = state.reduce(g, 0).numpy()
        out["seconds"] = time.monotonic() - t0
        out["stats"] = dict(state.allreduce.loss_stats)
        out["missing"] = state.allreduce.last_missing.copy()
        rounds = state.allreduce.exchange.transport.slot_rounds
        out["slot_rounds"] = [rounds.copy()]
        # The same tensor again: its slots must have moved on alike on every worker.
        out["bounded_next"] = state.reduce(g_next, 0).numpy()
        out["slot_rounds"].append(rounds.copy())
        # close(), not only the socket: a worker lacking sums of the last call gets them
        # in the control exchange close() holds.
        state.close()
        # With error feedback (rotated domain), a lost chunk's own share is kept.
        ef = thc_hook_state(aggregator=lossy, job_config=own, codec=codec, pool_size=64,
                            timeout=10,
                            values_per_packet=VPP, loss_bound=LOSS_BOUND)
        ef.reduce(g, 0)
        out["ef_error"] = np.asarray(ef.allreduce.error_feedback.error(0)).copy()
        out["ef_missing"] = ef.allreduce.last_missing.copy()
        out["rotated"] = np.asarray(codec.rotate(g.numpy()))
        ef.close()
        # On a process group of the caller's the agreement runs at the end of the call
        # (the same rule); fallback="raise": the call is not guarded.
        caller = thc_hook_state(aggregator=lossy, job_config=own, codec=codec, pool_size=64,
                                timeout=10, error_feedback=False, values_per_packet=VPP,
                                loss_bound=LOSS_BOUND, fallback="raise",
                                group=dist.new_group(backend="gloo"))
        out["caller_group"] = caller.reduce(g, 0).numpy()
        out["caller_next"] = caller.reduce(g_next, 0).numpy()
        queue.put((rank, out))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _ddp_worker(rank, init, lossy, exact, own, queue):
    """Three DDP steps with the THC hook under bounded loss; the parameters at the end."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from host.ddp_hook import thc_hook, thc_hook_state
    try:
        _join(rank, init, 30)       # the hang this guards against ends at gloo's timeout
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(1000, 50))   # one bucket, key 0
        state = thc_hook_state(aggregator=lossy, job_config=own,
                               codec=thc.THCCodec(seed=5, partition_size=PARTITION),
                               pool_size=64, timeout=10, values_per_packet=VPP,
                               loss_bound=LOSS_BOUND)
        model.register_comm_hook(state, thc_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.from_numpy(np.random.default_rng(rank).standard_normal((3, 8, 1000))
                                .astype(np.float32))
        for x in data:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        missing = dict(state.allreduce.loss_stats)
        state.close()           # worker 1's rescue of the last step's sums
        queue.put((rank, {"params": [p.detach().numpy().copy() for p in model.parameters()],
                          "stats": missing}))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _late_peers_worker(rank, init, lossy, exact, own, queue):
    """Two calls; workers 0 and 2 make the second one 2 s late (as if a collective of
    another group ran first). Worker 1 lacks a chunk of the first and waits for them."""
    import warnings

    import torch
    import torch.distributed as dist

    from host.allreduce import RescueWaitWarning
    from host.ddp_hook import thc_hook_state
    try:
        _join(rank, init, 60)
        state = thc_hook_state(aggregator=lossy, job_config=own,
                               codec=thc.THCCodec(seed=5, partition_size=PARTITION),
                               pool_size=64, timeout=10, error_feedback=False,
                               values_per_packet=VPP, loss_bound=LOSS_BOUND)
        state.allreduce.rescue_warn_s = 0.5
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = state.reduce(torch.from_numpy(grad(rank)), 0).numpy()
            if rank != 1:
                time.sleep(2.0)
            state.reduce(torch.from_numpy(grad(rank + WORLD)), 0)
        state.close()
        queue.put((rank, {"first": first,
                          "warnings": [str(w.message) for w in caught
                                       if issubclass(w.category, RescueWaitWarning)]}))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def _config(addresses, job=1, pool=64):
    members = [Member(worker=w, port=w, mac=f"02:00:00:00:01:{w + 1:02x}", ip=ip, udp_port=p)
               for w, (ip, p) in enumerate(addresses)]
    return SwitchConfig(ip="127.0.0.1", jobs=(Job.from_thc(job, pool, members,
                                                           values_per_packet=VPP),)).validate()


def _run(*rules, loss=0.0, worker=_worker):
    import torch.multiprocessing as mp

    from dataplane.udp_service import serve
    relay = agg_relay(loss, 11, *rules).start()
    lossy_svc = serve(_config(relay.member_addresses), "127.0.0.1", 0)
    relay.target = lossy_svc.address
    # Workers bind ephemeral ports: the exact run's aggregator knows them through a
    # loss-free relay's member ports too.
    clean = agg_relay(0.0).start()
    exact_svc = serve(_config(clean.member_addresses), "127.0.0.1", 0)
    clean.target = exact_svc.address
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "thc", "host.ddp_hook"])
    init = f"tcp://127.0.0.1:{free_port()}"
    queue = ctx.Queue()
    lossy = f"{relay.address[0]}:{relay.address[1]}"
    exact = f"{clean.address[0]}:{clean.address[1]}"
    # The workers' job description: their own addresses (the relays map them to the
    # member addresses the aggregators know).
    own = _config([("127.0.0.1", free_port()) for _ in range(WORLD)])
    procs = [ctx.Process(target=worker, args=(r, init, lossy, exact, own, queue))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + 120
        while len(results) < WORLD and time.monotonic() < deadline:
            try:
                rank, value = queue.get(timeout=1)
                results[rank] = value
            except Exception:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                assert not dead, f"worker processes {dead} died"
        assert len(results) == WORLD, f"only ranks {sorted(results)} reported in time"
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
        lossy_svc.stop()
        exact_svc.stop()
        counters = relay.stop()
        clean.stop()
    crashed = {r: v["crash"] for r, v in results.items() if "crash" in v}
    assert not crashed, crashed
    return results, counters


@pytest.fixture(scope="module")
def run():
    """One chunk lost everywhere."""
    return _run(blackholed)


@pytest.fixture(scope="module")
def partial_run():
    """One chunk lost everywhere, one back at workers 0 and 2 only, 2 % random loss."""
    return _run(blackholed, hidden_from_1, loss=0.02)


@pytest.fixture(scope="module")
def hidden_run():
    """Only one chunk back at workers 0 and 2 only: they end the call with every sum, and
    worker 1 alone asks for the redo."""
    return _run(hidden_from_1)


def test_every_worker_decodes_the_same_bounded_result(run):
    results, counters = run
    assert counters["dropped_up"] > 0
    for r in range(WORLD):
        assert np.array_equal(results[r]["bounded"], results[0]["bounded"]), r
        assert np.array_equal(results[r]["exact"], results[0]["exact"]), r


def test_the_agreement_at_the_end_of_the_call_decides_alike(run, partial_run):
    """A caller's process group: the end-of-call agreement gives what THC's own group's
    deferred one gives, chunk lost everywhere and chunk back at some workers alike."""
    for results, _ in (run, partial_run):
        for r in range(WORLD):
            assert np.array_equal(results[r]["caller_group"], results[r]["bounded"]), r


def test_a_chunk_back_at_some_workers_only_makes_every_worker_decode_the_exact_sums(
        partial_run):
    results, counters = partial_run
    assert counters["dropped_up"] > 0 and counters["dropped_down"] > 0
    chunks = -(-thc.THCCodec(partition_size=PARTITION).padded_length(D) // VPP)
    for r in range(WORLD):
        out = results[r]
        assert np.array_equal(out["bounded"], out["exact"]), r
        assert np.array_equal(out["exact"], results[0]["exact"]), r
        assert not out["missing"].any()
        assert out["stats"]["chunks"] == chunks and out["stats"]["missing_agreed"] == 0
    # Worker 1 lacked the hidden chunk besides the blackholed one; the others only that.
    assert results[1]["stats"]["missing_here"] >= 2
    assert results[0]["stats"]["missing_here"] >= 1


def test_the_call_after_a_redo_gets_exact_sums_on_every_worker(partial_run, hidden_run):
    """After a call redone over the collective, the next call of the same tensor (both
    drop rules again) is redone alike and exact, on THC's own group and a caller's. With
    the slots of the asking workers left behind, worker 1 met a straggler notice (its
    rounds behind those the others sent) or took the previous call's RESULTs."""
    for results, _ in (partial_run, hidden_run):
        for r in range(WORLD):
            out = results[r]
            # Every worker's slots moved on alike (the aggregator's copies did).
            for mine, first in zip(out["slot_rounds"], results[0]["slot_rounds"]):
                assert np.array_equal(mine, first) and mine.any(), r
            assert np.array_equal(out["bounded"], out["exact"]), r
            assert np.array_equal(out["bounded_next"], out["exact_next"]), r
            assert np.array_equal(out["caller_next"], out["exact_next"]), r
            assert not np.array_equal(out["exact_next"], out["exact"])


def test_ddps_bucket_rebuild_after_the_first_step_does_not_wait_on_a_rescue():
    """Worker 1 never gets one chunk of the bucket. Its first step ends with the agreement
    (THCHookState.reduce_bucket): with the agreement deferred, workers 0 and 2 entered
    DDP's bucket rebuild while worker 1 waited for them in THC's next control exchange,
    and all three hung until gloo's timeout. Every later step's sums are exact on every
    worker too (redone over the collective), so the models stay identical."""
    results, counters = _run(hidden_from_1, worker=_ddp_worker)
    assert counters["dropped_down"] > 0
    first = results[0]["params"]
    for rank in range(1, WORLD):
        for mine, theirs in zip(results[rank]["params"], first):
            np.testing.assert_array_equal(mine, theirs)
    assert results[1]["stats"]["missing_here"] >= 3        # one chunk in each of 3 steps
    assert all(r["stats"]["missing_agreed"] == 0 for r in results.values())


def test_a_worker_waiting_long_for_its_rescue_says_why_and_what_to_set():
    """Worker 1 lacks a chunk and waits in the others' next THC call for its sums; they
    come 2 s late. Past rescue_warn_s it warns, naming the collectives that would make the
    wait endless and defer_end_agreement; the call then completes with the sums the
    others have, and only worker 1 warns."""
    results, _ = _run(hidden_from_1, worker=_late_peers_worker)
    assert [len(results[r]["warnings"]) for r in range(WORLD)] == [0, 1, 0]
    text = results[1]["warnings"][0]
    assert "lacks sums of its last call" in text and "defer_end_agreement = False" in text
    assert "buffer broadcast" in text
    for rank in (1, 2):
        np.testing.assert_array_equal(results[rank]["first"], results[0]["first"])


def test_only_partitions_with_a_lost_chunk_differ_from_the_exact_result(run):
    results, _ = run
    exact, bounded = results[0]["exact"], results[0]["bounded"]
    per_partition = [np.array_equal(exact[lo:lo + PARTITION], bounded[lo:lo + PARTITION])
                     for lo in range(0, D, PARTITION)]
    missing = results[0]["missing"]
    assert missing[BLACKHOLED] and missing.sum() == 1
    for r in range(WORLD):
        assert results[r]["stats"]["missing_agreed"] == 1
        assert np.array_equal(results[r]["missing"], missing)
    lost = {c * VPP // PARTITION for c in np.flatnonzero(missing)}
    for k, same in enumerate(per_partition):
        assert same == (k not in lost), (k, same, sorted(lost))
    mean = np.mean([grad(r) for r in range(WORLD)], axis=0)
    nmse = float(np.sum((bounded - mean) ** 2) / np.sum(mean ** 2))
    assert nmse < 0.2, nmse


def test_error_feedback_keeps_the_share_of_lost_chunks(run):
    results, _ = run
    for r in range(WORLD):
        out = results[r]
        lost = np.repeat(out["ef_missing"], VPP)[:len(out["rotated"])]
        e, x = out["ef_error"], out["rotated"]
        assert lost.any()
        # Lost: the whole compensated value goes to the next round (x - q + q).
        np.testing.assert_allclose(e[lost], x[lost], rtol=0, atol=1e-5 * np.abs(x).max())
        # Delivered: only the quantization error stays.
        assert np.linalg.norm(e[~lost]) < 0.3 * np.linalg.norm(x[~lost])


def test_bounded_loss_with_partial_aggregation_is_refused_at_set_up():
    """With min_count k below the members, every result completes with k contributors, and
    bounded loss counts only full results as back: every chunk would be decoded as lost.
    The allreduce refuses the pair at set-up and says what to change; min_count equal to
    the members (or 0) is the full set and is accepted."""
    import torch.distributed as dist

    from host.allreduce import AggregatorExchange, THCAllreduce
    from host.transport import AggregatorTransport
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    codec = thc.THCCodec(seed=0)
    try:
        for min_count, refused in ((1, True), (2, False), (0, False)):
            t = AggregatorTransport(("127.0.0.1", free_port()), job=1, worker=0,
                                    expected=0b11, min_count=min_count, pool_size=8)
            try:
                if refused:
                    with pytest.raises(ValueError, match="min_count 1 of 2 members.*"
                                                         "loss_bound=0"):
                        THCAllreduce(codec, AggregatorExchange(t, codec), loss_bound=0.1)
                else:
                    ar = THCAllreduce(codec, AggregatorExchange(t, codec), loss_bound=0.1)
                    assert ar.loss_bound == 0.1
                # exact calls take partial results as they always did
                THCAllreduce(codec, AggregatorExchange(t, codec), loss_bound=0.0)
            finally:
                t.close()
    finally:
        dist.destroy_process_group()
