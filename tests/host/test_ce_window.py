"""The worker's CE window (AggregatorTransport ce_window): RESULTs that come back CE-marked
halve the chunks a worker keeps in flight, on the native and the Python path alike.

A relay in front of the real reference UDP service plays a DLCP queue that marked the
contributions completing the first chunks: it sets CE on their RESULTs on the way back
(docs/protocol.md §5: a RESULT carries the ToS of the packet that completed it). It holds
each RESULT for DELAY_S, a round trip long enough that the worker's window fills, and
counts, at every first transmission it sees, how many chunks the worker had in flight.
"""
import select
import socket
import threading
import time
from collections import deque

import numpy as np
import pytest

from host import native
from host.dlcp.marking import ECN_CE
from host.packets import FLAG_RETX, TYPE_DATA, TYPE_RESULT, decode_headers, header_types
from host.transport import AggregatorTransport, constant_policy

from hosttest_util import TABLE, aggregator, pack, random_indices  # noqa: F401 (fixture)

PATHS = pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
DELAY_S = 0.02


class MarkingRelay:
    """Forwards a worker's datagrams to the aggregator and the answers back, the first
    `marks` RESULTs with ECN set to CE; records the worker's flight (first transmissions
    seen minus RESULTs returned) at each first transmission, with the marks sent so far."""

    def __init__(self, marks: int):
        self.marks_left = marks
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.bind(("127.0.0.1", 0))
        self.address, self.member_address = self.front.getsockname(), self.back.getsockname()
        self.aggregator = self.worker = None
        self.sent = self.answered = 0
        self.flight: list[tuple[int, int]] = []       # (RESULTs returned, chunks in flight)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        held = deque()                                  # (release time, datagram)
        while not self._stop.is_set():
            wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.05
            readable, _, _ = select.select([self.front, self.back], [], [], wait)
            if self.front in readable:
                data, self.worker = self.front.recvfrom(65536)
                hdr = decode_headers([data])
                if header_types(hdr)[0] == TYPE_DATA and not hdr["flags"][0] & FLAG_RETX:
                    self.sent += 1
                    self.flight.append((self.answered, self.sent - self.answered))
                self.back.sendto(data, self.aggregator)
            if self.back in readable:
                held.append((time.monotonic() + DELAY_S, self.back.recv(65536)))
            while held and held[0][0] <= time.monotonic():
                self._answer(held.popleft()[1])

    def _answer(self, data: bytes) -> None:
        tos = 0
        if header_types(decode_headers([data]))[0] == TYPE_RESULT:
            self.answered += 1
            if self.marks_left > 0:
                self.marks_left -= 1
                tos = ECN_CE
        self.front.sendmsg([data], [(socket.IPPROTO_IP, socket.IP_TOS,
                                     tos.to_bytes(4, "little"))], 0, self.worker)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.front.close()
        self.back.close()


def _call_through_relay(aggregator, marks, *, use_native, pool, chunks, vpp=256, **kw):
    relay = MarkingRelay(marks)
    svc, _ = aggregator(1, pool, addresses=[relay.member_address])
    relay.aggregator = svc.address
    d = chunks * vpp
    idx = random_indices(1, d, 5)[0]
    t = AggregatorTransport(relay.address, job=1, worker=0, expected=1, pool_size=pool,
                            values_per_packet=vpp, timeout=10, native=use_native,
                            policy=constant_policy(32, 2), **kw)
    try:
        t.flush(repeats=1)
        result = t.allreduce(pack(idx), d, 1)
    finally:
        t.close()
        relay.close()
    assert np.array_equal(result.sums, TABLE[idx])     # the window changes timing only
    return t, relay


@pytest.fixture(autouse=True)
def native_built():
    if not native.available():
        pytest.fail(f"the native data path is not usable: {native.reason()}")


@PATHS
def test_ce_marked_results_halve_the_flight(aggregator, use_native):
    pool, marks = 16, 3
    t, relay = _call_through_relay(aggregator, marks, use_native=use_native, pool=pool,
                                   chunks=160, window_increase=1e-3)
    assert t.stats.ce_results == marks
    assert t.stats.window_cuts >= 1
    assert int(t.cwnd) <= pool // 2
    before = [f for answered, f in relay.flight if answered == 0]
    # A pool's worth after the marks, every first transmission fits the halved window.
    after = [f for answered, f in relay.flight if answered >= marks + pool]
    assert max(before) > pool // 2              # more than half a pool before the marks
    assert after and max(after) <= pool // 2


@PATHS
def test_unmarked_results_open_the_window_again(aggregator, use_native):
    pool, marks = 16, 2
    t, relay = _call_through_relay(aggregator, marks, use_native=use_native, pool=pool,
                                   chunks=200)
    assert t.stats.window_cuts >= 1
    # pool / 8 = 2 chunks more per window of unmarked RESULTs: back at the pool well
    # before 200 chunks are done, and the last first transmissions exceed half a pool.
    assert t.cwnd == pool
    assert max(f for _, f in relay.flight[-2 * pool:]) > pool // 2


@PATHS
def test_without_marks_the_window_stays_the_pool(aggregator, use_native):
    pool = 16
    t, relay = _call_through_relay(aggregator, 0, use_native=use_native, pool=pool, chunks=64)
    assert t.stats.ce_results == 0 and t.stats.window_cuts == 0 and t.cwnd == pool


def test_ce_window_off_ignores_the_marks(aggregator):
    pool = 16
    t, relay = _call_through_relay(aggregator, 8, use_native=True, pool=pool, chunks=96,
                                   ce_window=False)
    assert t.stats.ce_results == 0 and t.cwnd == pool
    assert max(f for answered, f in relay.flight if answered >= 8 + pool) > pool // 2


def test_window_increase_must_be_positive():
    with pytest.raises(ValueError, match="window_increase"):
        AggregatorTransport(("127.0.0.1", 9), job=1, worker=0, expected=1, pool_size=4,
                            window_increase=0)
