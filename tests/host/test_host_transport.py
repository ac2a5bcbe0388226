"""Worker transport against the real reference UDP aggregator on loopback."""
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

import thc
from dataplane.config import CONTROL_DSCP
from host.netlab.relay import LossyRelay, agg_worker, random_loss
from host.packets import TYPE_DATA, TYPE_FLUSH, decode_headers, encode_results, header_types
from host.transport import (AggregatorTimeout, AggregatorTransport, AggregatorUnreachable,
                            RetransmitTimer, StragglerNotice, constant_policy,
                            mmsg_available)

from hosttest_util import (TABLE, FakeAggregatorSocket, aggregator,  # noqa: F401 (fixture)
                           pack, random_indices)


def run_workers(n, fn):
    """Run fn(w) on n threads; return results, re-raising the first error."""
    results, errors = [None] * n, []

    def body(w):
        try:
            results[w] = fn(w)
        except Exception as exc:          # collected and re-raised in the test thread
            errors.append(exc)
    threads = [threading.Thread(target=body, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def transports(svc_address, addresses, pool_size, **kw):
    n = len(addresses)
    return [AggregatorTransport(svc_address, job=1, worker=w, expected=(1 << n) - 1,
                                pool_size=pool_size, local=addresses[w], **kw)
            for w in range(n)]


def one_datagram_per_syscall(t: AggregatorTransport) -> AggregatorTransport:
    """Switch a transport to its fallback path (send/recv_into loops, no sendmmsg)."""
    t._mmsg = False
    return t


SYSCALL_PATHS = pytest.mark.parametrize("batched", [True, False], ids=["mmsg", "loop"])


@SYSCALL_PATHS
def test_sums_exact_for_random_indices(aggregator, batched):
    if batched and not mmsg_available():
        pytest.skip("no sendmmsg/recvmmsg here (not Linux/glibc)")
    n, d, vpp, pool = 3, 5001, 256, 4
    svc, addrs = aggregator(n, pool)
    ts = transports(svc.address, addrs, pool, values_per_packet=vpp, timeout=10)
    if not batched:
        ts = [one_datagram_per_syscall(t) for t in ts]
    for t in ts:
        t.flush()
    for tensor, seed in enumerate([1, 2]):
        idx = random_indices(n, d, seed)
        out = run_workers(n, lambda w: ts[w].allreduce(pack(idx[w]), d, tensor))
        expected = np.sum([TABLE[i] for i in idx], axis=0)
        for res in out:
            assert np.array_equal(res.sums.astype(np.int64), expected)
            assert res.counts.tolist() == [n] * -(-d // vpp)
            assert set(res.contributors.tolist()) == {0b111}
            assert res.counts_per_value() == n
    c = svc.counters()["jobs"][1]
    assert c["results_multicast"] == 2 * -(-d // vpp)
    assert c["drop_bad_expected"] == c["drop_not_member"] == 0
    for t in ts:
        t.close()


def test_window_reuses_one_slot_in_order(aggregator):
    n, d, vpp, pool = 2, 1000, 64, 1
    svc, addrs = aggregator(n, pool)
    ts = transports(svc.address, addrs, pool, values_per_packet=vpp, timeout=10)
    idx = random_indices(n, d, 5)
    out = run_workers(n, lambda w: ts[w].allreduce(pack(idx[w]), d, 9))
    expected = np.sum([TABLE[i] for i in idx], axis=0)
    assert all(np.array_equal(r.sums.astype(np.int64), expected) for r in out)
    chunks = -(-d // vpp)
    assert [t.slot_rounds.tolist() for t in ts] == [[chunks]] * n   # round +1 per reuse
    c = svc.counters()["jobs"][1]
    assert c["results_multicast"] == chunks
    assert c["straggler_notices"] == 0          # never ran ahead of the window


def _decoded_run(svc_address, addrs, grads, codec, *, rounds=3, timeout=15):
    """Three THC allreduces of the same gradients; returns each worker's decoded means."""
    n, d = len(grads), len(grads[0])
    norms = np.max([codec.partition_norms(g) for g in grads], axis=0)
    ts = transports(svc_address, addrs, 8, values_per_packet=512, timeout=timeout)
    for t in ts:
        t.flush()

    def work(w):
        outs = []
        for r in range(rounds):
            packed = codec.quantize(codec.rotate(grads[w]), norms, worker=w, round=r, tensor=4)
            res = ts[w].allreduce(packed, codec.padded_length(d), 4)
            outs.append(codec.decode(res.sums, res.counts_per_value(), norms, d))
        return outs, ts[w].stats
    out = run_workers(n, work)
    for t in ts:
        t.close()
    return out


def test_one_percent_loss_both_ways_is_bit_identical(aggregator):
    n, d = 3, 40_000
    codec = thc.THCCodec(seed=11, partition_size=1 << 14)
    grads = [np.random.default_rng(w).standard_normal(d).astype(np.float32) for w in range(n)]
    svc, addrs = aggregator(n, 8)
    clean = _decoded_run(svc.address, addrs, grads, codec)

    # The relay's per-worker proxy sockets are the members the second aggregator knows.
    with LossyRelay(("127.0.0.1", 0), random_loss(0.01, seed=3), members=n,
                    member_of=agg_worker) as relay:
        svc2, _ = aggregator(n, 8, addresses=relay.member_addresses)
        relay.target = svc2.address
        t0 = time.monotonic()
        lossy = _decoded_run(relay.address, [("127.0.0.1", 0)] * n, grads, codec)
        elapsed = time.monotonic() - t0
    assert relay.counters["dropped_up"] > 0 and relay.counters["dropped_down"] > 0
    assert sum(stats.retransmissions for _, stats in lossy) > 0
    assert elapsed < 30                                    # nothing hung
    for (clean_outs, _), (lossy_outs, _) in zip(clean, lossy):
        for a, b in zip(clean_outs, lossy_outs):
            assert a.tobytes() == b.tobytes()              # bit-identical
    mean = np.mean(grads, axis=0)
    nmse = np.sum((clean[0][0][0] - mean) ** 2) / np.sum(mean ** 2)
    assert nmse < 0.05


def _killable_worker(address, local, w, n, pool, timeout, conn):
    """A worker process: allreduce until killed (w == n-1) or until an error, report it."""
    t = AggregatorTransport(address, job=1, worker=w, expected=(1 << n) - 1, pool_size=pool,
                            local=local, values_per_packet=128, timeout=timeout)
    idx = random_indices(1, 1000, w)[0]
    try:
        for step in range(1000):
            t.allreduce(pack(idx), 1000, 0)
            if step == 3 and w == n - 1:
                conn.send(("about to die", None))
                os.kill(os.getpid(), signal.SIGKILL)
        conn.send(("finished", None))
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc), time.monotonic()))


def test_killed_worker_fails_the_others_clearly(aggregator):
    n, pool, timeout = 3, 2, 1.5
    svc, addrs = aggregator(n, pool)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for w in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_killable_worker,
                        args=(svc.address, addrs[w], w, n, pool, timeout, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    assert pipes[n - 1].poll(60) and pipes[n - 1].recv()[0] == "about to die"
    died = time.monotonic()
    for w in range(n - 1):
        assert pipes[w].poll(timeout + 20), f"worker {w} hung"
        kind, message, when = pipes[w].recv()
        assert kind == "AggregatorTimeout"
        assert "worker(s) [2]" in message                 # names the dead worker
        assert when - died < timeout + 10
    for p in procs:
        p.join(10)
    assert procs[n - 1].exitcode == -signal.SIGKILL


def test_unreachable_aggregator_is_reported_quickly():
    port = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    port.bind(("127.0.0.1", 0))
    address = port.getsockname()
    port.close()                                           # nothing listens there now
    t = AggregatorTransport(address, job=1, worker=0, expected=1, pool_size=2, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(AggregatorUnreachable, match="nothing listens"):
        t.allreduce(np.zeros(10, np.uint8), 20, 0)
    assert time.monotonic() - t0 < 4


def test_silent_aggregator_times_out_with_a_message():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    t = AggregatorTransport(silent.getsockname(), job=1, worker=0, expected=1, pool_size=2,
                            timeout=0.6)
    t0 = time.monotonic()
    with pytest.raises(AggregatorTimeout, match="nothing was ever received"):
        t.allreduce(np.zeros(10, np.uint8), 20, 0)
    assert 0.5 < time.monotonic() - t0 < 3
    silent.close()


def test_duplicates_reorder_and_garbage_are_ignored():
    agg = FakeAggregatorSocket()
    t = AggregatorTransport(agg.address, job=7, worker=0, expected=0b11, pool_size=4,
                            values_per_packet=4, timeout=5)
    sums = np.arange(10, dtype=np.uint8)
    results = {}

    def worker():
        results["r"] = t.allreduce(np.zeros(5, np.uint8), 10, 3)
    th = threading.Thread(target=worker)
    th.start()
    grams = [agg.recv() for _ in range(3)]                # 3 chunks of <= 4 values
    source = grams[0][2]
    hdr = decode_headers([g[0] for g in grams])
    assert header_types(hdr).tolist() == [TYPE_DATA] * 3
    bufs, lens = encode_results(sums, 10, 4, job=7, worker=0, tensor=3,
                                slots=hdr["slot"], rounds=hdr["round"], expected=0b11,
                                contributors=0b11, count=2)
    wrong_job, _ = encode_results(sums, 10, 4, job=8, worker=0, tensor=3, slots=hdr["slot"],
                                  rounds=hdr["round"], expected=3, contributors=3, count=2)
    agg.sock.sendto(b"short", source)                      # malformed
    agg.sock.sendto(bytes(wrong_job[0, :lens[0]]), source)  # another job
    for k in (2, 0, 0, 1):                                 # reordered, one duplicate
        agg.sock.sendto(bytes(bufs[k, :lens[k]]), source)
    th.join(10)
    res = results["r"]
    assert np.array_equal(res.sums, sums)
    assert res.counts.tolist() == [2, 2, 2]
    assert t.stats.ignored >= 2
    assert t.stats.duplicates >= 1 or t.stats.results_accepted == 3


@SYSCALL_PATHS
def test_policy_sets_dscp_and_ecn_per_packet(batched):
    if batched and not mmsg_available():
        pytest.skip("no sendmmsg/recvmmsg here (not Linux/glibc)")
    agg = FakeAggregatorSocket()

    def policy(*, layer, num_layers, values, values_per_packet, num_packets):
        dscp = (32 + np.arange(num_packets) % 3).astype(np.uint8)
        ecn = (np.arange(num_packets) % 2).astype(np.uint8)
        return dscp, ecn
    t = AggregatorTransport(agg.address, job=1, worker=0, expected=1, pool_size=8,
                            values_per_packet=2, timeout=0.5, policy=policy)
    if not batched:
        one_datagram_per_syscall(t)
    with pytest.raises(AggregatorTimeout):
        t.allreduce(np.zeros(3, np.uint8), 6, 0)           # nobody answers: fine here
    tos = {}
    agg.sock.settimeout(0.5)
    try:
        while True:
            data, t_o_s, _ = agg.recv()
            h = decode_headers([data])[0]
            tos.setdefault(int(h["offset"]) // 2, t_o_s)
    except socket.timeout:
        pass
    assert tos == {k: ((32 + k % 3) << 2) | (k % 2) for k in range(3)}


def test_flush_resets_every_slot_of_the_pool():
    agg = FakeAggregatorSocket()
    t = AggregatorTransport(agg.address, job=2, worker=1, expected=0b10, pool_size=5, timeout=1,
                            policy=constant_policy(33))
    t.slot_rounds[:] = 7
    t.flush(repeats=1)
    received = [agg.recv() for _ in range(5)]
    # In DLCP's control class, whatever the data policy: a DLCP queue serves it before any
    # data band, so the stream's DATA sent after it cannot overtake it (protocol §4.6).
    assert {tos for _, tos, _ in received} == {CONTROL_DSCP << 2}
    hdr = decode_headers([data for data, _, _ in received])
    assert header_types(hdr).tolist() == [TYPE_FLUSH] * 5
    assert sorted(hdr["slot"].tolist()) == [0, 1, 2, 3, 4]
    assert set(hdr["job"].tolist()) == {2} and set(hdr["worker"].tolist()) == {1}
    assert t.slot_rounds.tolist() == [0] * 5


def test_straggler_notice_raises_a_clear_error(aggregator):
    svc, addrs = aggregator(1, 1)
    t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=1,
                            local=addrs[0], values_per_packet=8, timeout=5)
    for _ in range(3):                                     # slot 0 reaches round 2
        t.allreduce(np.zeros(4, np.uint8), 8, 0)
    t.slot_rounds[:] = 0                                   # as if this worker restarted
    with pytest.raises(StragglerNotice, match="round 2 but this worker sent round 0"):
        t.allreduce(np.zeros(4, np.uint8), 8, 0)


def test_retransmit_timer_follows_rtt_within_bounds():
    timer = RetransmitTimer(rto_init=0.2, rto_min=0.01, rto_max=1.0)
    assert timer.rto == 0.2
    for _ in range(50):
        timer.sample(0.002)
    assert timer.rto == pytest.approx(0.01)                # clamped at rto_min
    for _ in range(50):
        timer.sample(0.05)
    assert 0.05 <= timer.rto < 0.1                        # follows the new RTT
    timer.sample(5.0)
    assert timer.rto == 1.0                                # clamped at rto_max
    with pytest.raises(ValueError):
        RetransmitTimer(rto_init=0.001, rto_min=0.01)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="values_per_packet"):
        AggregatorTransport(("127.0.0.1", 50000), job=1, worker=0, expected=1, pool_size=2,
                            values_per_packet=9000)
    with pytest.raises(ValueError, match="expected bitmap"):
        AggregatorTransport(("127.0.0.1", 50000), job=1, worker=3, expected=0b11, pool_size=2)
    # 3 of the 2 expected workers: every packet would be drop_unsatisfiable (protocol §4.1)
    with pytest.raises(ValueError, match="min_count 3 can never be reached"):
        AggregatorTransport(("127.0.0.1", 50000), job=1, worker=0, expected=0b11, pool_size=2,
                            min_count=3)
    with pytest.raises(ValueError, match="HOST:PORT"):
        AggregatorTransport("localhost", job=1, worker=0, expected=1, pool_size=2)


def test_straggler_notice_can_give_the_chunk_up(aggregator):
    svc, addrs = aggregator(1, 1)
    t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=1,
                            local=addrs[0], values_per_packet=8, timeout=5,
                            on_straggler="skip")
    for _ in range(3):
        t.allreduce(np.zeros(4, np.uint8), 8, 0)
    t.slot_rounds[:] = 0
    res = t.allreduce(np.zeros(4, np.uint8), 8, 0)
    assert res.counts.tolist() == [0] and t.stats.straggler_notices == 1


def test_a_busy_worker_port_is_refused_clearly():
    from host.transport import TransportError
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.0.1", 0))
    with pytest.raises(TransportError, match="cannot bind its UDP address"):
        AggregatorTransport(("127.0.0.1", 50000), job=1, worker=0, expected=1, pool_size=2,
                            local=holder.getsockname())
    holder.close()


@pytest.mark.parametrize("background", [False, True], ids=["caller-driven", "io-thread"])
def test_a_streamed_tensor_gives_the_same_sums(aggregator, background):
    """Ranges submitted one by one, pumped in between (or by the stream's I/O thread),
    read back as they complete."""
    n, d, vpp, pool = 2, 6000, 256, 4
    svc, addrs = aggregator(n, pool)
    ts = transports(svc.address, addrs, pool, values_per_packet=vpp, timeout=10)
    idx = random_indices(n, d, 8)
    cuts = [0, 1024, 1024 + 2048, d]                 # ranges end on packet boundaries

    def work(w):
        stream = ts[w].open_stream(d, 5, background=background)
        done = []
        for lo, hi in zip(cuts, cuts[1:]):
            stream.submit(pack(idx[w][lo:hi]), hi - lo)
            stream.pump()
            done.append(stream.values_done())
        stream.wait_values(cuts[2])
        assert stream.values_done() >= cuts[2]
        partial = stream.sums[:cuts[2]].copy()
        res = stream.finish()
        return res, partial, done
    out = run_workers(n, work)
    expected = np.sum([TABLE[i] for i in idx], axis=0)
    for res, partial, done in out:
        assert np.array_equal(res.sums.astype(np.int64), expected)
        assert np.array_equal(partial.astype(np.int64), expected[:cuts[2]])
        assert done == sorted(done)                        # completion only moves forward
    assert [t.slot_rounds.tolist() for t in ts] == [[6, 6, 6, 6]] * n   # 24 chunks / 4 slots
    with pytest.raises(ValueError, match="packet boundary"):
        ts[0].open_stream(d, 6).submit(pack(idx[0][:100]), 100)
    for t in ts:
        t.close()


def _capture(agg, count):
    grams = []
    for _ in range(count):
        data, tos, _ = agg.recv()
        grams.append((data, tos))
    return grams


@pytest.mark.parametrize("marks", ["uniform", "runs"])
def test_gso_sends_the_same_datagrams_in_fewer_calls(marks):
    """UDP GSO (one super-datagram per run of full rows) vs one datagram per row: the
    aggregator receives identical datagrams with identical ToS bytes."""
    from host.transport import gso_available
    if not gso_available():
        pytest.skip("no UDP GSO path here (not Linux/glibc)")

    def policy(*, layer, num_layers, values, values_per_packet, num_packets):
        dscp = np.full(num_packets, 40, np.uint8)
        if marks == "runs":
            dscp = (40 + (np.arange(num_packets) // 3) % 2).astype(np.uint8)
        return dscp, np.zeros(num_packets, np.uint8)
    d, vpp = 40 * 64 + 17, 64                              # a short last packet
    packed = pack(random_indices(1, d, 3)[0])
    received, calls = {}, {}
    for gso in (True, False):
        agg = FakeAggregatorSocket()
        t = AggregatorTransport(agg.address, job=1, worker=0, expected=1, pool_size=64,
                                values_per_packet=vpp, timeout=0.3, policy=policy, gso=gso)
        with pytest.raises(AggregatorTimeout):
            t.allreduce(packed, d, 0)                      # nobody answers: fine here
        assert t.io.gso == gso                            # the path took GSO, no fallback
        received[gso] = _capture(agg, 41)
        calls[gso] = t.stats.send_messages
        t.close()
    first = {k: [g for g in v if not decode_headers([g[0]])["flags"][0]] for k, v in
             received.items()}
    assert first[True] == first[False] and len(first[True]) == 41
    assert calls[False] >= 41 and calls[True] < calls[False] / 2   # runs of rows in one
    expected_tos = {40 << 2} if marks == "uniform" else {40 << 2, 41 << 2}
    assert {tos for _, tos in first[True]} == expected_tos


def test_packets_larger_than_the_path_mtu_are_refused():
    """A network namespace whose loopback has a 1200-byte MTU: 1024-value RESULTs (1084
    bytes) fit, 2048-value ones would be fragmented, which no data plane reassembles."""
    from host.netlab.links import netns_available
    reason = netns_available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    import subprocess
    import sys
    import uuid
    ns = f"thcmtu{uuid.uuid4().hex[:6]}"
    code = ("import host.transport as t\n"
            "t.MAX_VALUES = 8192\n"
            "ok = t.AggregatorTransport(('127.0.0.1', 9), job=1, worker=0, expected=1, "
            "pool_size=2, values_per_packet=1024)\n"
            "try:\n"
            "    t.AggregatorTransport(('127.0.0.1', 9), job=1, worker=0, expected=1, "
            "pool_size=2, values_per_packet=2048)\n"
            "except ValueError as e:\n"
            "    print('refused:', e)\n")
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "mtu", "1200", "up"], check=True)
        res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=60,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                 os.path.abspath(__file__)))))
    finally:
        subprocess.run(["ip", "netns", "del", ns])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "refused:" in res.stdout and "path MTU to the aggregator 127.0.0.1 is 1200" in \
        res.stdout and "values_per_packet <= 1140" in res.stdout


def test_a_busy_caller_causes_no_spurious_retransmissions(aggregator):
    """Results that arrived while the pipeline was quantizing are taken in before any
    timer is checked: no retransmission although the caller was away for 20 RTOs."""
    svc, addrs = aggregator(1, 8)
    t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=8,
                            local=addrs[0], values_per_packet=64, timeout=10,
                            timer=RetransmitTimer(rto_init=0.005, rto_min=0.005))
    idx = random_indices(1, 512, 4)[0]
    t.allreduce(pack(idx), 512, 0)
    for wait in ("wait_values", "pump"):
        stream = t.open_stream(512, 1)
        stream.submit(pack(idx[:256]), 256)
        time.sleep(0.1)                                   # "quantizing the next range"
        if wait == "pump":
            stream.pump()
        stream.wait_values(256)
        stream.submit(pack(idx[256:]), 256)
        res = stream.finish()
        assert np.array_equal(res.sums, TABLE[idx])
    assert t.stats.retransmissions == 0 and t.stats.duplicates == 0
    t.close()


def test_an_io_thread_error_reaches_the_waiter():
    """Background mode: the I/O thread's timeout (a silent aggregator) and an ICMP port
    unreachable come out of wait_values in the caller's thread, and the stream closes."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    t = AggregatorTransport(silent.getsockname(), job=1, worker=0, expected=1, pool_size=2,
                            values_per_packet=8, timeout=0.5)
    stream = t.open_stream(32, 0, background=True)
    stream.submit(np.zeros(8, np.uint8), 16)
    t0 = time.monotonic()
    with pytest.raises(AggregatorTimeout, match="nothing was ever received"):
        stream.wait_values(16)
    assert time.monotonic() - t0 < 5 and stream.closed
    assert t.open_stream(32, 1) is not None                # the transport is free again
    silent.close()
    port = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    port.bind(("127.0.0.1", 0))
    gone = port.getsockname()
    port.close()
    t2 = AggregatorTransport(gone, job=1, worker=0, expected=1, pool_size=2, timeout=5)
    stream = t2.open_stream(20, 0, background=True)
    stream.submit(np.zeros(10, np.uint8), 20)
    with pytest.raises(AggregatorUnreachable, match="nothing listens"):
        stream.finish()


def test_rtt_samples_are_bounded():
    """A long run keeps only the most recent RTT samples (the soak found a list of all of
    them growing a worker's memory by about 80 MB an hour)."""
    from host.transport import RTT_SAMPLES_KEPT, TransportStats
    stats = TransportStats()
    stats.rtt_samples.extend(float(i) for i in range(3 * RTT_SAMPLES_KEPT))
    stats.rtt_samples.append(-1.0)
    assert len(stats.rtt_samples) == RTT_SAMPLES_KEPT and stats.rtt_samples[-1] == -1.0
    assert "rtt_samples" not in stats.as_dict()
