"""The native worker data path (host/native) against the Python path: the same datagrams,
the same results, the same errors, through the real reference UDP service on loopback."""
import ctypes
import os
import select
import shutil
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from host import native
from host.netlab.relay import LossyRelay, agg_worker, random_loss
from host.packets import FLAG_RETX, TYPE_DATA, decode_headers, header_types
from host.transport import (AggregatorTimeout, AggregatorTransport, AggregatorUnreachable,
                            RetransmitTimer, StragglerNotice, constant_policy)

from hosttest_util import (TABLE, aggregator, pack,  # noqa: F401 (fixture)
                           random_indices)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])


@pytest.fixture(autouse=True)
def native_built():
    """`make test` builds it first; a test run without the build says what to do."""
    if not native.available():
        pytest.fail(f"the native data path is not usable: {native.reason()}")


class RecordingRelay:
    """A real UDP socket standing in for the aggregator: it records every datagram a worker
    sends (bytes and ToS byte, in arrival order) and forwards it to the real aggregator,
    and the aggregator's answers back."""

    def __init__(self, aggregator_address):
        self.aggregator = aggregator_address
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        self.front.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.back.bind(("127.0.0.1", 0))
        self.address, self.member_address = self.front.getsockname(), self.back.getsockname()
        self.received: list[tuple[bytes, int]] = []
        self.worker = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            readable, _, _ = select.select([self.front, self.back], [], [], 0.05)
            if self.front in readable:
                data, anc, _, self.worker = self.front.recvmsg(65536, socket.CMSG_SPACE(4))
                tos = [c[2][0] for c in anc if c[1] == socket.IP_TOS]
                self.received.append((data, tos[0] if tos else 0))
                self.back.sendto(data, self.aggregator)
            if self.back in readable:
                data = self.back.recv(65536)
                self.front.sendto(data, self.worker)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.front.close()
        self.back.close()


def _first_transmissions(received):
    """The DATA datagrams as first sent (no RETX flag), in order."""
    out = []
    for data, tos in received:
        hdr = decode_headers([data])
        if header_types(hdr)[0] == TYPE_DATA and not hdr["flags"][0] & FLAG_RETX:
            out.append((data, tos))
    return out


def _marking_policy(*, layer, num_layers, values, values_per_packet, num_packets):
    """DSCP in runs of three and alternating ECN: a ToS that changes within every batch."""
    dscp = (40 + (np.arange(num_packets) // 3) % 3).astype(np.uint8)
    return dscp, (np.arange(num_packets) % 2).astype(np.uint8)


@pytest.mark.parametrize("policy", [constant_policy(46), _marking_policy],
                         ids=["one-tos", "tos-per-packet"])
def test_both_paths_send_byte_identical_datagrams(aggregator, policy):
    """One worker, a tensor of 41 chunks through a pool of 4 (ten windows), streamed in
    three submissions; the relay in front of the reference service records every datagram."""
    d, vpp, pool = 40 * 256 + 17, 256, 4
    idx = random_indices(1, d, 21)[0]
    cuts = [0, 10 * 256, 30 * 256, d]
    sent, results, counters = {}, {}, {}
    for use_native in (True, False):
        relay = RecordingRelay(None)
        svc, _ = aggregator(1, pool, addresses=[relay.member_address])
        relay.aggregator = svc.address
        t = AggregatorTransport(relay.address, job=1, worker=0, expected=1, pool_size=pool,
                                values_per_packet=vpp, timeout=10, policy=policy,
                                native=use_native)
        t.flush(repeats=1)
        for tensor in (3, 4):                              # two calls: rounds move on
            stream = t.open_stream(d, tensor)
            assert (stream.native is not None) == use_native
            for lo, hi in zip(cuts, cuts[1:]):
                stream.submit(pack(idx[lo:hi]), hi - lo)
            results[use_native, tensor] = stream.finish()
        sent[use_native] = _first_transmissions(relay.received)
        counters[use_native] = svc.counters()["jobs"][1]
        assert t.stats.packets_sent == len(relay.received)
        t.close()
        relay.close()
    assert len(sent[True]) == 2 * 41
    assert sent[True] == sent[False]                       # bytes, ToS and order
    if policy is _marking_policy:
        assert len({tos for _, tos in sent[True]}) == 6
    for tensor in (3, 4):
        for use_native in (True, False):
            res = results[use_native, tensor]
            assert np.array_equal(res.sums, TABLE[idx])
            assert res.counts.tolist() == [1] * 41
    keys = ("results_multicast", "straggler_notices", "drop_bad_expected", "drop_not_member")
    assert [counters[True][k] for k in keys] == [counters[False][k] for k in keys]
    assert counters[True]["results_multicast"] == 2 * 41


def _allreduce_all(svc_address, addresses, n, pool, vpp, tensors, native_of, timeout=15):
    """n workers in threads, one transport each (worker w native when native_of(w)),
    allreduce every tensor; returns per worker the results and the transport."""
    ts = [AggregatorTransport(svc_address, job=1, worker=w, expected=(1 << n) - 1,
                              pool_size=pool, local=addresses[w], values_per_packet=vpp,
                              timeout=timeout, native=native_of(w)) for w in range(n)]
    for t in ts:
        t.flush()
    try:
        results = _in_threads(n, lambda w: [ts[w].allreduce(pack(idx[w]), len(idx[w]), k)
                                            for k, idx in enumerate(tensors)])
    finally:
        for t in ts:
            t.close()
    return results, ts


def _in_threads(n, work):
    """work(w) for w in range(n), each in its own thread; their results, or the first
    error re-raised here."""
    results, errors = [None] * n, []

    def run(w):
        try:
            results[w] = work(w)
        except Exception as exc:          # re-raised in the caller's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(w,)) for w in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]
    return results


def test_identical_allreduce_results_through_a_lossy_path(aggregator):
    """Three workers through a relay that drops 2% both ways: retransmissions happen, and
    the native and the Python path give the same, exact sums."""
    n, pool, vpp = 3, 8, 512
    tensors = [random_indices(n, d, seed) for seed, d in ((1, 60 * 512), (2, 37 * 512 + 99))]
    expected = [np.sum([TABLE[i] for i in idx], axis=0) for idx in tensors]
    by_path, retx = {}, {}
    for use_native in (True, False):
        with LossyRelay(("127.0.0.1", 0), random_loss(0.02, seed=5), members=n,
                        member_of=agg_worker) as relay:
            svc, _ = aggregator(n, pool, addresses=relay.member_addresses)
            relay.target = svc.address
            results, ts = _allreduce_all(relay.address, [("127.0.0.1", 0)] * n, n, pool, vpp,
                                         [list(idx) for idx in tensors],
                                         lambda w: use_native)
            assert relay.counters["dropped_up"] > 0 and relay.counters["dropped_down"] > 0
        by_path[use_native] = results
        retx[use_native] = sum(t.stats.retransmissions for t in ts)
        assert all(t.native == use_native for t in ts)
        if use_native:
            assert all(t.stats.rtt_samples for t in ts)    # the C loop's timer samples
    assert retx[True] > 0 and retx[False] > 0
    for use_native in (True, False):
        for worker_results in by_path[use_native]:
            for res, exp in zip(worker_results, expected):
                assert np.array_equal(res.sums.astype(np.int64), exp)
                assert set(res.counts.tolist()) == {n}
                assert set(res.contributors.tolist()) == {(1 << n) - 1}


def test_native_and_python_workers_share_one_job(aggregator):
    """Worker 0 on the native path, the others on the Python path, in one job."""
    n, pool, vpp = 3, 4, 1024
    svc, addrs = aggregator(n, pool)
    tensors = [random_indices(n, 25 * 1024 + 5, 9)]
    results, ts = _allreduce_all(svc.address, addrs, n, pool, vpp,
                                 [list(idx) for idx in tensors], lambda w: w == 0)
    expected = np.sum([TABLE[i] for i in tensors[0]], axis=0)
    assert [t.native for t in ts] == [True, False, False]
    for worker_results in results:
        assert np.array_equal(worker_results[0].sums.astype(np.int64), expected)
    assert svc.counters()["jobs"][1]["results_multicast"] == 26


@PATHS
def test_a_straggler_notice_gives_the_same_error_or_give_up(aggregator, use_native):
    for on_straggler in ("raise", "skip"):
        svc, addrs = aggregator(1, 1)
        t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=1,
                                local=addrs[0], values_per_packet=8, timeout=5,
                                on_straggler=on_straggler, native=use_native)
        for _ in range(3):                                 # slot 0 reaches round 2
            t.allreduce(np.zeros(4, np.uint8), 8, 0)
        t.slot_rounds[:] = 0                               # as if this worker restarted
        if on_straggler == "raise":
            with pytest.raises(StragglerNotice, match="round 2 but this worker sent round 0"):
                t.allreduce(np.zeros(4, np.uint8), 8, 0)
        else:
            res = t.allreduce(np.zeros(4, np.uint8), 8, 0)
            assert res.counts.tolist() == [0] and t.stats.straggler_notices == 1
        t.close()


@PATHS
def test_unreachable_and_silent_aggregators_give_the_same_errors(use_native):
    port = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    port.bind(("127.0.0.1", 0))
    gone = port.getsockname()
    port.close()                                           # nothing listens there now
    t = AggregatorTransport(gone, job=1, worker=0, expected=1, pool_size=2, timeout=5,
                            native=use_native)
    with pytest.raises(AggregatorUnreachable, match="nothing listens"):
        t.allreduce(np.zeros(10, np.uint8), 20, 0)
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    t = AggregatorTransport(silent.getsockname(), job=1, worker=0, expected=1, pool_size=2,
                            timeout=0.5, native=use_native)
    with pytest.raises(AggregatorTimeout, match="nothing was ever received"):
        t.allreduce(np.zeros(10, np.uint8), 20, 0)
    assert t.stats.retransmissions > 0                     # the timer ran meanwhile
    silent.close()


def test_a_missing_or_broken_library_is_reported(tmp_path):
    lib, reason = native.open_library(str(tmp_path / "absent.so"))
    assert lib is None and "is not built (run `make build`)" in reason
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    lib, reason = native.open_library(str(broken))
    assert lib is None and "does not load" in reason and "make build" in reason


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None,
                    reason="no make or cc here")
def test_the_makefile_builds_the_shared_object(tmp_path):
    """`make native` (a dependency of `make build`) compiles datapath.c into a shared
    object that loads and matches the loader's struct, and rebuilds when the .c changes."""
    src, so = tmp_path / "datapath.c", tmp_path / "datapath.so"
    shutil.copy(os.path.join(REPO, "host", "native", "datapath.c"), src)
    paths = [f"NATIVE_SRC={src}", f"NATIVE_SO={so}"]
    dry = subprocess.run(["make", "-n", "build", *paths], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert f"-o {so} {src}" in dry.stdout, dry.stdout + dry.stderr
    subprocess.run(["make", "native", *paths], cwd=REPO, check=True, capture_output=True,
                   timeout=120)
    lib, reason = native.open_library(str(so))
    assert reason is None and lib.dp_stream_size() == ctypes.sizeof(native.DpStream)
    up_to_date = ["make", "-q", "native", *paths]
    assert subprocess.run(up_to_date, cwd=REPO, timeout=60).returncode == 0
    os.utime(src, (os.path.getmtime(so) + 5,) * 2)         # the .c changed
    assert subprocess.run(up_to_date, cwd=REPO, timeout=60).returncode == 1


def _background_stream(ts, w, idx, pieces, vpp, tensor, log):
    """Worker w submits its indices in `pieces` ranges through a background stream, waiting
    for each range's sums right after submitting the next (as THCAllreduce's pipeline
    does); log gets (range, values done when its wait returned)."""
    n_values = len(idx)
    step = -(-n_values // pieces // vpp) * vpp
    stream = ts[w].open_stream(n_values, tensor, background=True)
    bounds = [(lo, min(lo + step, n_values)) for lo in range(0, n_values, step)]
    for k, (lo, hi) in enumerate(bounds):
        stream.submit(pack(idx[lo:hi]), hi - lo)
        if k:
            stream.wait_values(bounds[k - 1][1])
            log.append((k - 1, stream.values_done()))
    return stream.finish()


@PATHS
def test_a_background_stream_gives_exact_sums_range_by_range(aggregator, use_native):
    """The I/O thread of a background stream (native: one C call per batch of submitted
    chunks, woken by each submission and each new waiter): exact sums, each range's wait
    returns once that range is in, and a stream closed while its thread waits in the
    aggregator's silence ends at once."""
    n, pool, vpp = 3, 8, 512
    svc, addrs = aggregator(n, pool)
    idx = random_indices(n, 40 * vpp + 77, 21)
    ts = [AggregatorTransport(svc.address, job=1, worker=w, expected=(1 << n) - 1,
                              pool_size=pool, local=addrs[w], values_per_packet=vpp,
                              timeout=15, native=use_native) for w in range(n)]
    for t in ts:
        t.flush()
    logs = [[] for _ in range(n)]
    results = _in_threads(n, lambda w: _background_stream(ts, w, idx[w], 4, vpp, 5, logs[w]))
    expected = np.sum([TABLE[i] for i in idx], axis=0)
    for w in range(n):
        assert np.array_equal(results[w].sums.astype(np.int64), expected)
        assert [k for k, _ in logs[w]] == [0, 1, 2]
        assert all(done >= (k + 1) * 10 * vpp for k, done in logs[w])
    # A stream whose aggregator never answers (worker 0 alone): close() wakes the thread.
    lone = ts[0].open_stream(4 * vpp, 6, background=True)
    lone.submit(pack(idx[0][:4 * vpp]), 4 * vpp)
    time.sleep(0.2)                                   # the thread is waiting for results
    t0 = time.monotonic()
    lone.close()
    assert time.monotonic() - t0 < 2.0
    for t in ts:
        t.close()
    assert svc.counters()["jobs"][1]["results_multicast"] == 41


def test_result_moderation_gathers_results_without_changing_them(aggregator):
    """With RESULT moderation (the C loop pauses while half the window is in flight) the
    sums are the same, exact, and the loop takes RESULTs in several per receive call
    instead of waking for each; a pause that would hold the window shut is refused."""
    vpp, pool, chunks = 256, 64, 400
    idx = random_indices(1, chunks * vpp, 33)[0]
    for moderation in (0.0, 0.002):
        svc, addrs = aggregator(1, pool)
        t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=pool,
                                local=addrs[0], values_per_packet=vpp, timeout=15,
                                native=True, moderation=moderation)
        t.flush()
        before = t.stats.recv_calls
        res = t.allreduce(pack(idx), len(idx), 7)
        recvs = t.stats.recv_calls - before
        t.close()
        assert np.array_equal(res.sums, TABLE[idx])
        if moderation:
            # a 2 ms pause lets several of the aggregator's slot-by-slot answers gather
            assert recvs <= chunks // 2, recvs
    with pytest.raises(ValueError, match="moderation"):
        AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=pool,
                            moderation=0.5)


@pytest.mark.parametrize("background", [False, True], ids=["caller", "io-thread"])
def test_a_completion_rule_with_a_hint_waits_in_c(aggregator, monkeypatch, background):
    """A caller's own completion rule (bounded loss: enough chunks back) with the number of
    done chunks it needs first: the native loop waits for those in one call instead of
    returning to Python after every round, and the rule and the sums are the same."""
    from host.native import NativeWindow
    vpp, pool, chunks = 256, 16, 120
    idx = random_indices(1, chunks * vpp, 41)[0]
    calls = {"hinted": 0, "all": 0}
    real_run = NativeWindow.run

    def counting_run(self, block, target, at_least=None):
        calls["all"] += 1
        calls["hinted"] += at_least is not None
        return real_run(self, block, target, at_least)
    monkeypatch.setattr(NativeWindow, "run", counting_run)
    rounds = {}
    for hint in (None, chunks - 10):
        svc, addrs = aggregator(1, pool)
        t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=pool,
                                local=addrs[0], values_per_packet=vpp, timeout=15,
                                native=True)
        t.flush()
        calls.update(hinted=0, all=0)
        stream = t.open_stream(len(idx), 3, background=background)
        stream.submit(pack(idx), len(idx))
        stream.wait_until(lambda: int(stream.ex.done.sum()) >= chunks - 10, at_least=hint)
        assert stream.ex.done.sum() >= chunks - 10
        res = stream.finish()
        t.close()
        assert np.array_equal(res.sums, TABLE[idx])
        rounds[hint] = dict(calls)
    assert rounds[None]["hinted"] == 0
    assert rounds[chunks - 10]["hinted"] >= 1
    # without the hint the rule is looked at after every round (one call per round)
    assert rounds[chunks - 10]["all"] < rounds[None]["all"], rounds


@PATHS
def test_each_layer_keeps_its_own_rtt_estimate(aggregator, use_native):
    """Streams of one layer (a DDP bucket, a DLCP band) learn and use their own
    retransmission timer: a band whose packets wait behind a higher one's in a strict-
    priority queue must not time out on the estimate the fast band keeps short."""
    vpp, pool = 256, 8
    svc, addrs = aggregator(1, pool)
    t = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=pool,
                            local=addrs[0], values_per_packet=vpp, timeout=15,
                            native=use_native)
    t.flush()
    idx = random_indices(1, 20 * vpp, 5)[0]
    t.allreduce(pack(idx), len(idx), 1, layer=0, num_layers=2)
    front = t.timer
    assert front.srtt is not None
    slow = t._layer_timer(1)
    slow.srtt, slow.rttvar = 0.5, 0.1            # as if layer 1 had always waited 0.5 s
    srtt_front = front.srtt
    res = t.allreduce(pack(idx), len(idx), 2, layer=1, num_layers=2)
    assert np.array_equal(res.sums, TABLE[idx])
    assert t.timer is slow and slow.srtt < 0.5   # its own samples moved it
    assert front.srtt == srtt_front              # the other layer's estimate untouched
    t.allreduce(pack(idx), len(idx), 3, layer=0, num_layers=2)
    assert t.timer is front and front.rto < 0.5
    t.close()


@PATHS
@pytest.mark.parametrize("background", [False, True], ids=["caller", "io-thread"])
def test_wait_all_ends_at_its_time_limit(aggregator, use_native, background):
    """A bounded-loss rule's grace period: wait_all returns when every chunk is in, or at its
    time limit when some never come (here the job's second worker never sends, so no chunk
    completes), long before the stream's timeout; the stream stays usable for give-up."""
    vpp, pool, chunks = 256, 16, 40
    idx = random_indices(1, chunks * vpp, 5)[0]

    def submitted(workers: int, tensor: int):
        """Worker 0's stream of idx, in a job of `workers` members."""
        svc, addrs = aggregator(workers, pool)
        t = AggregatorTransport(svc.address, job=1, worker=0, expected=(1 << workers) - 1,
                                pool_size=pool, local=addrs[0], values_per_packet=vpp,
                                timeout=15, native=use_native)
        t.flush()
        stream = t.open_stream(len(idx), tensor, background=background)
        stream.submit(pack(idx), len(idx))
        return t, stream
    t, stream = submitted(2, 4)
    started = time.monotonic()
    stream.wait_all(started + 0.3)
    waited = time.monotonic() - started
    assert 0.25 <= waited < 2.0, waited
    assert not stream.ex.done.any() and stream.until == float("inf")
    assert stream.give_up_rest().tolist() == list(range(chunks))
    stream.close()
    t.close()
    # and with every chunk answered it returns as soon as they are in
    t, stream = submitted(1, 5)
    started = time.monotonic()
    stream.wait_all(started + 30.0)
    assert stream.ex.all_done() and time.monotonic() - started < 10.0
    assert np.array_equal(stream.finish().sums, TABLE[idx])
    t.close()


def _drops_data_of_chunk(chunk: int, vpp: int):
    """A relay rule: every DATA datagram of `chunk` going up, nothing else."""
    from host.netlab.relay import UP, agg_chunk
    return lambda d: d.direction == UP and agg_chunk(d.data, TYPE_DATA, vpp) == chunk


@PATHS
@pytest.mark.parametrize("background", [False, True], ids=["caller", "io-thread"])
def test_wait_grace_gives_the_last_chunks_a_grace_period(aggregator, use_native, background):
    """A bounded-loss rule's wait in one call (TensorStream.wait_grace): a relay drops every
    DATA of one chunk, so once the other chunks are in the wait ends a grace period of RTOs
    later, long before the stream's timeout, without that chunk; with every chunk answered
    it ends as soon as they are in. Native: the grace period starts in C (start_grace)."""
    vpp, pool, chunks, lost = 256, 16, 40, 37     # no chunk waits for lost's slot
    idx = random_indices(1, chunks * vpp, 6)[0]
    drop_chunk = _drops_data_of_chunk(lost, vpp)

    for dropping, tensor in ((True, 4), (False, 5)):
        with LossyRelay(("127.0.0.1", 0), drop_chunk if dropping else None, members=1,
                        member_of=agg_worker) as relay:
            svc, _ = aggregator(1, pool, addresses=relay.member_addresses)
            relay.target = svc.address
            t = AggregatorTransport(relay.address, job=1, worker=0, expected=1, pool_size=pool,
                                    values_per_packet=vpp, timeout=15, native=use_native)
            t.flush()
            stream = t.open_stream(len(idx), tensor, background=background)
            stream.submit(pack(idx), len(idx))
            started = time.monotonic()
            stream.wait_grace(chunks - 1, 2.0)
            waited = time.monotonic() - started
            assert waited < 8.0, waited
            done = stream.ex.done.copy()
            assert stream.until == float("inf") and stream.grace_at == -1
            if dropping:
                assert not done[lost] and done.sum() == chunks - 1
                assert t.stats.retransmissions > 0      # the overdue chunk went out again
                assert stream.give_up_rest().tolist() == [lost]
            else:
                assert done.all()
            res = stream.finish()
            keep = np.repeat(done, vpp)
            assert np.array_equal(res.sums[keep], TABLE[idx][keep])
            t.close()


@PATHS
@pytest.mark.parametrize("background", [False, True], ids=["caller", "io-thread"])
def test_a_grace_period_resends_a_chunk_armed_with_an_older_rto(aggregator, use_native,
                                                                  background):
    """A lost chunk sent before any RTT sample has its timer armed with the initial RTO
    (1 s here); once the other chunks are in, the RTO is a few ms and the grace period
    2 of those. wait_grace re-arms the pending chunk's timer to at most one current RTO,
    so it goes out again inside the grace period, which still ends long before the first
    timer would have fired. Without the re-arming it never went out again (a CI failure:
    the RTO had shrunk between the chunk's sending and the grace period)."""
    vpp, pool, chunks, lost = 256, 16, 12, 3      # one window: every chunk sent at once
    idx = random_indices(1, chunks * vpp, 7)[0]
    with LossyRelay(("127.0.0.1", 0), _drops_data_of_chunk(lost, vpp), members=1,
                    member_of=agg_worker) as relay:
        svc, _ = aggregator(1, pool, addresses=relay.member_addresses)
        relay.target = svc.address
        t = AggregatorTransport(relay.address, job=1, worker=0, expected=1, pool_size=pool,
                                values_per_packet=vpp, timeout=15, native=use_native,
                                timer=RetransmitTimer(rto_init=1.0, rto_max=2.0))
        t.flush()
        stream = t.open_stream(len(idx), 4, background=background)
        stream.submit(pack(idx), len(idx))
        started = time.monotonic()
        stream.wait_grace(chunks - 1, 2.0)
        waited = time.monotonic() - started
        assert waited < 0.9, waited          # the grace period, not the 1 s timer
        assert not stream.ex.done[lost] and stream.ex.done.sum() == chunks - 1
        assert len(relay.dropped) >= 2, relay.dropped     # sent, and sent again
        assert t.stats.retransmissions >= 1
        assert stream.give_up_rest().tolist() == [lost]
        stream.finish()
        t.close()


@PATHS
def test_a_peer_that_starts_late_costs_one_backed_off_resend_per_stall(aggregator,
                                                                       use_native):
    """Worker 0 sends its window of 16 chunks; worker 1 starts its call 150 ms later, so
    nothing completes meanwhile (a result needs both). Each stall re-sends only the
    oldest chunk, and the next stall waits for its doubled timer (10 ms RTO here: about
    10, 30, 70 and 150 ms), so the wait costs a handful of datagrams. Before, every stall
    re-sent the whole window (16, 16, 16, ...: some 60 duplicates into the bottleneck).
    The sums are exact either way."""
    vpp, pool, chunks, late = 256, 16, 16, 0.15
    idx = random_indices(2, chunks * vpp, 13)
    svc, addrs = aggregator(2, pool)
    ts = [AggregatorTransport(svc.address, job=1, worker=w, expected=0b11, pool_size=pool,
                              local=addrs[w], values_per_packet=vpp, timeout=15,
                              native=use_native,
                              timer=RetransmitTimer(rto_init=0.01, rto_min=0.01))
          for w in range(2)]
    for t in ts:
        t.flush()
    results = [None, None]

    def call(w):
        results[w] = ts[w].allreduce(pack(idx[w]), chunks * vpp, 3)
    early = threading.Thread(target=call, args=(0,))
    early.start()
    time.sleep(late)
    call(1)
    early.join(15)
    for res in results:
        assert np.array_equal(res.sums.astype(np.int64), TABLE[idx[0]] + TABLE[idx[1]])
    assert 1 <= ts[0].stats.retransmissions <= 6, ts[0].stats.retransmissions
    assert ts[1].stats.retransmissions == 0
    for t in ts:
        t.close()
