"""host.control_channel: THC's MAX exchanges over direct TCP connections, checked against
gloo's all_reduce in real worker processes (a gloo group of 3 on loopback)."""
import contextlib
import datetime
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

from host import control_channel
from host.control_channel import ControlChannel, ControlChannelError
from hosttest_util import one_rank_group, run_worker_processes  # noqa: F401 (fixture)

WORLD = 3


def _vectors(rank: int, rnd: int):
    """A float64, a float32 (with a NaN at 5 on worker 1) and a uint8 vector per worker."""
    rng = np.random.default_rng(100 * rnd + rank)
    f64 = torch.from_numpy(rng.standard_normal(77))
    f32 = torch.from_numpy(rng.standard_normal(300).astype(np.float32))
    if rank == 1:
        f32[5] = float("nan")
    u8 = torch.from_numpy(rng.integers(0, 2, 40).astype(np.uint8))
    return [f64, f32, u8]


def _same_as_gloo(rank, channel):
    for rnd in range(4):
        mine = _vectors(rank, rnd)
        over_channel = [v.clone() for v in mine]
        # Two in flight at once, waited for in the other order.
        works = [channel.all_reduce_max(v) for v in over_channel]
        for work in reversed(works):
            work.wait()
        for v in mine:
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        for got, want in zip(over_channel, mine):
            assert got.dtype == want.dtype
            if got.dtype == torch.float32:
                # A NaN anywhere is NaN everywhere here (gloo's max drops or keeps it
                # depending on the order it meets it in).
                assert torch.isnan(got[5]) and int(torch.isnan(got).sum()) == 1
                got, want = got[torch.arange(len(got)) != 5], want[torch.arange(len(want)) != 5]
            assert np.array_equal(got.numpy(), want.numpy()), (rnd, got.dtype)
    assert channel.exchanges == 12


def _a_peer_that_exits_is_named(rank, channel):
    if rank == 2:
        channel.close()
        return
    t0 = time.monotonic()
    with pytest.raises(ControlChannelError, match="worker 2 closed its connection"):
        channel.all_reduce_max(torch.zeros(8)).wait()
    assert time.monotonic() - t0 < 10          # at once, not after the group's timeout


def _out_of_step_is_refused(rank, channel):
    n = 16 if rank == 0 else 8
    with pytest.raises(ControlChannelError, match="out of step"):
        channel.all_reduce_max(torch.zeros(n)).wait()


def _a_silent_peer_times_out(rank, channel):
    if rank == 2:
        time.sleep(3)
        return
    with pytest.raises(ControlChannelError, match=r"no answer from worker\(s\) \[2\]"):
        channel.all_reduce_max(torch.zeros(4)).wait(datetime.timedelta(seconds=0.5))


def _full_buffers_do_not_deadlock(rank, channel):
    """Every worker sends three 64 KB exchanges before it waits for any, through socket
    buffers of a few KB: sends that block must read meanwhile, or all wait for ever."""
    import socket
    for s in channel._peers.values():
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    n = control_channel.MAX_BYTES // 8
    mine = [torch.from_numpy(np.random.default_rng(10 * rank + i).standard_normal(n))
            for i in range(3)]
    works = [channel.all_reduce_max(v.clone()) for v in mine]
    results = [w._tensor for w in works]
    for w in works:
        w.wait()
    for v, got in zip(mine, results):
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        assert torch.equal(got, v)


SCENARIOS = {"same_as_gloo": _same_as_gloo, "full_buffers": _full_buffers_do_not_deadlock,
             "peer_exits": _a_peer_that_exits_is_named, "out_of_step": _out_of_step_is_refused,
             "timeout": _a_silent_peer_times_out}


def _worker(rank, init, scenario, unreachable_rank, queue):
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        if rank == unreachable_rank:             # advertise an address nobody can reach
            control_channel._advertised_address = lambda: "192.0.2.1"
        expect_warning = pytest.warns(RuntimeWarning, match="stay on gloo") \
            if unreachable_rank >= 0 else contextlib.nullcontext()
        with expect_warning:
            channel = ControlChannel.connect(timeout=2.0)
        if unreachable_rank >= 0:
            assert channel is None
        else:
            assert channel is not None
            SCENARIOS[scenario](rank, channel)
            dist.barrier()
            channel.close()
        queue.put((rank, {}))
    except BaseException:
        queue.put((rank, {"crash": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(scenario="same_as_gloo", unreachable_rank=-1):
    run_worker_processes(_worker, lambda r, init, queue: (r, init, scenario, unreachable_rank,
                                                          queue), WORLD, seconds=120)


def test_exchanges_give_what_gloo_gives_in_any_wait_order():
    _run("same_as_gloo")


def test_sends_into_full_buffers_read_meanwhile_instead_of_deadlocking():
    _run("full_buffers")


def test_a_peer_that_exits_fails_the_exchange_at_once_and_is_named():
    _run("peer_exits")


def test_workers_out_of_step_are_told_so():
    _run("out_of_step")


def test_a_silent_peer_times_out_naming_it():
    _run("timeout")


def test_workers_that_cannot_connect_all_keep_gloo():
    _run(unreachable_rank=1)


def test_one_worker_needs_no_connection(one_rank_group):
    channel = ControlChannel.connect()
    v = torch.arange(5, dtype=torch.float64)
    channel.all_reduce_max(v).wait()
    assert v.tolist() == [0, 1, 2, 3, 4]


def test_fits_only_small_contiguous_cpu_tensors():
    assert ControlChannel.fits(torch.zeros(1024, dtype=torch.float64))
    assert not ControlChannel.fits(torch.zeros(control_channel.MAX_BYTES // 8 + 1,
                                               dtype=torch.float64))
    assert not ControlChannel.fits(torch.zeros(8, 2)[:, 0])
    assert not ControlChannel.fits(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        ControlChannel({}, 1.0).all_reduce_max(torch.zeros(4, dtype=torch.float16))


def test_thc_uses_the_channel_unless_told_to_keep_gloo(one_rank_group, monkeypatch):
    import thc
    from host.allreduce import SumAllreduceExchange, THCAllreduce
    codec = thc.THCCodec(seed=1)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(5000).astype(np.float32))
    means = []
    for keep_gloo in ("", "1"):
        monkeypatch.setenv("THC_GLOO_CONTROL", keep_gloo)
        ar = THCAllreduce(codec, SumAllreduceExchange(codec))
        means.append(ar(x, 0))
        assert (ar._channel is None) == (keep_gloo == "1")
        if ar._channel is not None:
            assert ar._channel.exchanges >= 1
        ar.close()
    assert torch.equal(means[0], means[1])
