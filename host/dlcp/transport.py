"""DLCP bounded-loss transport for plain fp32 tensor transfers (notes/dlcp.md §2).

Two channels between a sender and a receiver:

* **Data: UDP.** Every datagram is a 16-byte DLCP header followed by big-endian fp32
  values. A tensor is cut into consecutive segments of ``values_per_segment`` values (no
  value spans two datagrams); the header says where a segment goes, so arrival order
  does not matter. Each datagram carries its own DSCP/ECN (``IP_TOS`` control message)
  chosen by the marking policy.
* **Control: TCP**, sent with the control DSCP (48, queue 7). Messages START, FIN,
  FIN_CONFIRM, STOP, RETX_REQ, RATE_REPORT, ERROR, framed as ``type u8 | length u32 | body``.

Protocol (per tensor):

1. Zero-RTT start: the sender sends START(tensor, size, p) and immediately starts sending
   data. Data that reaches the receiver before START is dropped and counted
   (``early_drops``); it counts as lost, which the bound and the retransmission cover.
2. The receiver copies each segment into place and sends FIN at the first arrival at
   which ``received >= ceil((1-p) * num_segments)``. The sender stops sending on FIN,
   answers FIN_CONFIRM and the receiver delivers the tensor.
3. When the sender runs out of segments without a FIN it sends STOP. A receiver still
   below the bound answers RETX_REQ(list of missing segments) and the sender sends just
   those (rate reset to line rate). There is no timer-driven data retransmission
   (``recovery="timer"`` exists only as the evaluation baseline).
4. Segment order is a fresh seeded permutation per (tensor, iteration), so the tail that
   FIN cuts off is not the same parameters every iteration.
5. End of a round: after its last datagram the sender also sends an empty END_MARK
   datagram in the same band (ECT, so only a full buffer drops it), then STOP on TCP.
   STOP overtakes data still queued in the network (it rides the top queue); the marker
   does not (same FIFO), so its arrival tells the receiver that everything sent before
   it has arrived or was dropped. The receiver answers STOP with RETX_REQ when the marker
   is in, when it has seen as many datagrams as the sender sent, or (marker lost) when
   the tensor's data has been idle for ``stop_drain_s``. This is our extension: without
   it a receiver requests segments that are merely queued behind higher bands.
6. The receiver reports its receive rate every ``report_period_s`` (200 us); the sender
   runs :class:`~host.dlcp.ratecontrol.RateController` on it and paces to its rate.

Missing segments in a delivered tensor follow ``missing_policy``: ``"zero"`` leaves them
0, ``"own"`` fills them with the receiver's own gradient for that tensor (the paper's
Appendix A model: a worker that misses a block applies its local gradient).
"""
from __future__ import annotations

import math
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dataplane.config import CONTROL_DSCP, DATA_DSCP_BASE, NUM_DATA_BANDS
from host.dlcp.marking import tos_byte
from host.dlcp.ratecontrol import REPORT_PERIOD_S, RateController

# --- wire format -------------------------------------------------------------------
DATA_HEADER = struct.Struct("!IIHIBB")   # tensor_id, offset (values), length (values), seq, flags, reserved
DATA_HEADER_LEN = DATA_HEADER.size       # 16
FLAG_RETX = 0x01
FLAG_END_MARK = 0x02                     # in-band end-of-round marker (no payload), see below
VALUES_PER_SEGMENT = 350                 # 1400 B of fp32: one 1500-byte-MTU datagram
MAX_VALUES_PER_SEGMENT = (65507 - DATA_HEADER_LEN) // 4
WIRE_OVERHEAD = 14 + 20 + 8              # Ethernet + IPv4 + UDP, for pacing

MSG_START, MSG_FIN, MSG_FIN_CONFIRM, MSG_STOP, MSG_RETX_REQ, MSG_RATE, MSG_ERROR = range(1, 8)
FRAME = struct.Struct("!BI")
START_BODY = struct.Struct("!IIIHdB")    # tensor_id, num_values, num_segments, vps, p, stage
FIN_BODY = struct.Struct("!II")          # tensor_id, segments received
STOP_BODY = struct.Struct("!II")         # tensor_id, datagrams sent
RATE_BODY = struct.Struct("!Idd")        # tensor_id, receive rate (bit/s), window (s)
ID_BODY = struct.Struct("!I")
STAGES = ("push", "pull")
MISSING_POLICIES = ("zero", "own")
CONTROL_TOS = tos_byte(CONTROL_DSCP, 0)


class DlcpError(RuntimeError):
    """The peer refused a transfer or the control connection broke."""


def priority_rank(dscp: int) -> int:
    """0 for data band 0 (served first among data) ... 6 for band 6, 7 for anything else."""
    band = dscp - DATA_DSCP_BASE
    return band if 0 <= band < NUM_DATA_BANDS else NUM_DATA_BANDS


def frame(msg_type: int, body: bytes) -> bytes:
    return FRAME.pack(msg_type, len(body)) + body


class FrameReader:
    """Reassembles control frames from a TCP byte stream."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        out = []
        while len(self.buf) >= FRAME.size:
            msg_type, length = FRAME.unpack_from(self.buf, 0)
            end = FRAME.size + length
            if len(self.buf) < end:
                break
            out.append((msg_type, bytes(self.buf[FRAME.size:end])))
            del self.buf[:end]
        return out


def segment_count(num_values: int, values_per_segment: int) -> int:
    return -(-num_values // values_per_segment)


def segment_bounds(num_values: int, values_per_segment: int) -> np.ndarray:
    """[offset, length] of every segment: consecutive, no value in two segments."""
    starts = np.arange(segment_count(num_values, values_per_segment), dtype=np.int64)
    starts *= values_per_segment
    lengths = np.minimum(starts + values_per_segment, num_values) - starts
    return np.stack([starts, lengths], axis=1)


def fin_threshold(num_segments: int, p: float) -> int:
    """Segments needed before FIN: ceil((1-p)*n), robust to float error (p=0.1, n=10 -> 9)."""
    return min(num_segments, math.ceil(round((1.0 - p) * num_segments, 9)))


def send_order(num_segments: int, seed: int, tensor_id: int, iteration: int,
               order: str = "random") -> np.ndarray:
    """Segment send order: a seeded permutation per (tensor, iteration), a rotation, or 0..n-1."""
    if order == "random":
        rng = np.random.default_rng([seed, tensor_id, iteration])
        return rng.permutation(num_segments)
    if order == "rotate":
        return np.roll(np.arange(num_segments), -(iteration * 7919) % max(1, num_segments))
    if order == "sequential":
        return np.arange(num_segments)
    raise ValueError(f"segment order {order!r}: use 'random', 'rotate' or 'sequential'")


def encode_segments(tensor_id: int, values: np.ndarray, values_per_segment: int) -> np.ndarray:
    """All data datagrams of a tensor as rows of one uint8 array (vectorized, seq = 0)."""
    flat = np.ascontiguousarray(np.ravel(values), dtype=np.float32)
    bounds = segment_bounds(flat.size, values_per_segment)
    n = len(bounds)
    rows = np.zeros((n, DATA_HEADER_LEN + 4 * values_per_segment), np.uint8)
    hdr = rows[:, :DATA_HEADER_LEN]
    hdr[:, 0:4] = np.frombuffer(np.full(n, tensor_id, ">u4").tobytes(), np.uint8).reshape(n, 4)
    hdr[:, 4:8] = bounds[:, 0].astype(">u4").view(np.uint8).reshape(n, 4)
    hdr[:, 8:10] = bounds[:, 1].astype(">u2").view(np.uint8).reshape(n, 2)
    padded = np.zeros(n * values_per_segment, ">f4")
    padded[:flat.size] = flat
    rows[:, DATA_HEADER_LEN:] = padded.view(np.uint8).reshape(n, -1)
    return rows


def apply_missing_policy(values: np.ndarray, received: np.ndarray, values_per_segment: int,
                         policy: str, own: np.ndarray | None) -> np.ndarray:
    """Fill the segments that never arrived: 'zero' (leave 0) or 'own' (local gradient)."""
    if policy not in MISSING_POLICIES:
        raise ValueError(f"missing policy {policy!r}: use one of {MISSING_POLICIES}")
    if policy == "zero" or received.all():
        return values
    if own is None:
        raise ValueError("missing policy 'own' needs the receiver's own gradient (set_own)")
    own = np.ravel(own)
    for seg in np.flatnonzero(~received):
        lo = seg * values_per_segment
        hi = min(lo + values_per_segment, values.size)
        values[lo:hi] = own[lo:hi]
    return values


@dataclass(frozen=True)
class LossBounds:
    """Per-stage loss bounds; pulled values are aggregates, so p_pull <= p_push."""
    p_push: float = 0.1
    p_pull: float = 0.01

    def __post_init__(self) -> None:
        for name in ("p_push", "p_pull"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"LossBounds: {name}={v} must be in [0, 1)")
        if self.p_pull > self.p_push:
            raise ValueError(f"LossBounds: p_pull={self.p_pull} > p_push={self.p_push}; the "
                             "pull stage carries aggregates and needs the stricter bound")

    def for_stage(self, stage: str) -> float:
        if stage not in STAGES:
            raise ValueError(f"stage {stage!r}: use 'push' or 'pull'")
        return self.p_push if stage == "push" else self.p_pull


# --- receiver ------------------------------------------------------------------------
@dataclass
class TransferResult:
    tensor_id: int
    values: np.ndarray
    received: np.ndarray          # bool per segment (arrived before delivery)
    need: int                     # segments required for FIN
    received_at_fin: int
    p: float
    stage: str
    start_time: float             # receiver clock when START arrived
    fin_time: float
    retx_requests: int
    duplicates: int

    @property
    def delivered_fraction(self) -> float:
        return float(self.received.mean()) if self.received.size else 1.0


@dataclass
class _Inbound:
    tensor_id: int
    conn: socket.socket
    values: np.ndarray
    received: np.ndarray
    vps: int
    need: int
    p: float
    stage: str
    start_time: float
    count: int = 0
    fin_time: float | None = None
    received_at_fin: int = 0
    retx_requests: int = 0
    duplicates: int = 0
    window_bytes: int = 0
    window_start: float = 0.0
    arrivals: int = 0                 # datagrams of this tensor, duplicates included
    last_arrival: float = 0.0
    stop_sent: int | None = None      # STOP seen (datagrams the sender had sent), not answered
    stop_time: float = 0.0
    rank: int = 7                     # priority rank of its datagrams (0 = band 0 ... 7 = best effort)
    mark_seen: int = -1               # `sent` carried by the newest END_MARK
    answered_sent: int = -1           # the round (by `sent`) already answered


class DlcpReceiver:
    """DLCP receiver: one UDP data socket and a TCP control listener, served by a thread."""

    def __init__(self, host: str = "127.0.0.1", udp_port: int = 0, tcp_port: int = 0, *,
                 max_values: int = 1 << 24, missing_policy: str = "zero",
                 report_period_s: float = REPORT_PERIOD_S, stop_drain_s: float = 0.02,
                 rcvbuf: int = 8 << 20) -> None:
        if missing_policy not in MISSING_POLICIES:
            raise ValueError(f"missing_policy {missing_policy!r}: use one of {MISSING_POLICIES}")
        if report_period_s <= 0:
            raise ValueError("report_period_s must be > 0")
        self.max_values = max_values
        self.missing_policy = missing_policy
        self.report_period_s = report_period_s
        self.stop_drain_s = stop_drain_s
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.udp.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_RECVTOS", 13), 1)
        self.udp.bind((host, udp_port))
        self.udp.setblocking(False)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, tcp_port))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.udp_addr = self.udp.getsockname()
        self.tcp_addr = self.listener.getsockname()
        # Counters (read them after wait()): datagrams by fate, and arrivals per ToS byte.
        self.early_drops = 0          # data for a tensor with no START yet (zero-RTT race)
        self.late_packets = 0         # data for a tensor already delivered
        self.malformed = 0
        self.malformed_control = 0
        self.end_marks = 0
        self.data_packets = 0
        self.tos_counts: dict[int, int] = {}
        self._active: dict[int, _Inbound] = {}
        self._own: dict[int, np.ndarray] = {}
        self._done: dict[int, TransferResult] = {}
        self._finished_ids: set[int] = set()
        self._errors: list[str] = []
        self._cond = threading.Condition()
        self._readers: dict[socket.socket, FrameReader] = {}
        self._dead: set[socket.socket] = set()
        self._rank_last_arrival = [0.0] * 8   # newest data arrival per priority rank
        self._stop = threading.Event()
        self._rxbuf = bytearray(65536)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.udp, selectors.EVENT_READ, "udp")
        self._sel.register(self.listener, selectors.EVENT_READ, "listen")
        self._thread = threading.Thread(target=self._run, name="dlcp-receiver", daemon=True)

    def __enter__(self) -> "DlcpReceiver":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for sock in list(self._readers) + [self.udp, self.listener]:
            sock.close()
        self._sel.close()

    def set_own(self, tensor_id: int, values: np.ndarray) -> None:
        """The receiver's own gradient for tensor_id, used by missing_policy='own'."""
        with self._cond:
            self._own[tensor_id] = np.ravel(values).astype(np.float32)

    def wait(self, tensor_id: int, timeout: float = 30.0) -> TransferResult:
        """Block until tensor_id is delivered (FIN_CONFIRM seen); pops the result."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while tensor_id not in self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"tensor {tensor_id} not delivered within {timeout} s")
                self._cond.wait(left)
            return self._done.pop(tensor_id)

    # -- event loop --
    def _run(self) -> None:
        next_report = time.monotonic() + self.report_period_s
        while not self._stop.is_set():
            timeout = 0.05
            if self._active:
                timeout = min(max(0.0, next_report - time.monotonic()), self.stop_drain_s)
            # Control first: START then usually precedes its own zero-RTT data in one batch.
            events = sorted(self._sel.select(timeout), key=lambda ev: ev[0].data == "udp")
            for key, _ in events:
                if key.data == "udp":
                    self._drain_udp()
                elif key.data == "listen":
                    self._accept()
                else:
                    self._read_control(key.fileobj)
            now = time.monotonic()
            self._answer_stops(now)
            if now >= next_report:
                self._send_rate_reports(now)
                next_report = now + self.report_period_s
            for conn in self._dead:
                if conn in self._readers:
                    self._drop_conn(conn)
            self._dead.clear()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, CONTROL_TOS)
        conn.settimeout(2.0)      # a peer that stops reading is dropped, never waited on forever
        self._readers[conn] = FrameReader()
        self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _send(self, conn: socket.socket, data: bytes) -> None:
        """Control message out; a broken connection is dropped after this event, not raised."""
        try:
            conn.sendall(data)
        except OSError:
            self._dead.add(conn)

    def _drop_conn(self, conn: socket.socket) -> None:
        if conn not in self._readers:
            return
        self._sel.unregister(conn)
        self._readers.pop(conn, None)
        for tid in [t for t, st in self._active.items() if st.conn is conn]:
            del self._active[tid]
        conn.close()

    def _read_control(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return                    # already read (a START looked up early)
        except OSError:
            data = b""
        if not data:
            self._drop_conn(conn)
            return
        for msg_type, body in self._readers[conn].feed(data):
            try:
                self._on_control(conn, msg_type, body)
            except struct.error:
                self.malformed_control += 1     # bad body length: dropped and counted

    def _on_control(self, conn: socket.socket, msg_type: int, body: bytes) -> None:
        if msg_type == MSG_START:
            self._on_start(conn, *START_BODY.unpack(body))
        elif msg_type == MSG_STOP:
            self._on_stop(*STOP_BODY.unpack(body))
        elif msg_type == MSG_FIN_CONFIRM:
            self._deliver(ID_BODY.unpack(body)[0])
        else:
            self._errors.append(f"unexpected control message type {msg_type}")

    def _refuse(self, conn: socket.socket, tensor_id: int, why: str) -> None:
        self._errors.append(why)
        self._send(conn, frame(MSG_ERROR, ID_BODY.pack(tensor_id) + why.encode()))

    def _on_start(self, conn, tensor_id, num_values, num_segments, vps, p, stage) -> None:
        if tensor_id in self._active:
            return self._refuse(conn, tensor_id, f"tensor {tensor_id} is already in transfer")
        if num_values > self.max_values:
            return self._refuse(conn, tensor_id, f"tensor {tensor_id}: {num_values} values exceed "
                                f"the receive buffer ({self.max_values}); raise max_values")
        if num_segments != segment_count(num_values, vps) or not 0 <= p < 1 or stage > 1:
            return self._refuse(conn, tensor_id, f"tensor {tensor_id}: inconsistent START")
        now = time.monotonic()
        st = _Inbound(tensor_id, conn, np.zeros(num_values, np.float32),
                      np.zeros(num_segments, bool), vps, fin_threshold(num_segments, p), p,
                      STAGES[stage], now, window_start=now)
        self._finished_ids.discard(tensor_id)
        self._active[tensor_id] = st
        if st.need == 0:
            self._send_fin(st, now)

    def _on_stop(self, tensor_id: int, sent: int) -> None:
        st = self._active.get(tensor_id)
        if st is None or st.fin_time is not None or sent <= st.answered_sent:
            return      # FIN already on its way, or this round was answered on its marker
        st.stop_sent = sent
        st.stop_time = time.monotonic()
        self._answer_stops(st.stop_time)

    def _answer_stops(self, now: float) -> None:
        """Answer STOP with RETX_REQ(missing) once no data of the tensor is still in flight.

        STOP travels on the top-priority control queue and overtakes data still queued in
        the network; answering at once would request segments that are about to arrive.
        So the receiver answers when it has seen as many datagrams as the sender sent, or
        when the tensor's data has been idle for stop_drain_s (the rest is lost).
        """
        for st in self._active.values():
            if st.stop_sent is None or st.fin_time is not None:
                continue
            # Fallback clock: runs only while nothing of this priority or above arrives.
            # Under strict priority a starved band's data sits in the switch; asking for
            # it again would only add duplicates to a full queue.
            busy = max(self._rank_last_arrival[:st.rank + 1])
            drained = (st.mark_seen >= st.stop_sent or st.arrivals >= st.stop_sent
                       or now - max(st.last_arrival, st.stop_time, busy) >= self.stop_drain_s)
            if drained:
                self._request_missing(st, st.stop_sent)

    def _request_missing(self, st: _Inbound, sent: int) -> None:
        st.stop_sent = None
        st.answered_sent = sent
        missing = np.flatnonzero(~st.received).astype(">u4")
        st.retx_requests += 1
        self._send(st.conn, frame(MSG_RETX_REQ, ID_BODY.pack(st.tensor_id) + missing.tobytes()))

    def _on_end_mark(self, st: _Inbound, sent: int) -> None:
        """The round's marker: all of the round is in or lost; answer now if STOP came."""
        st.mark_seen = max(st.mark_seen, sent)
        if st.fin_time is None and st.stop_sent is not None and sent >= st.stop_sent:
            self._request_missing(st, st.stop_sent)

    def _send_fin(self, st: _Inbound, now: float) -> None:
        st.fin_time = now
        st.received_at_fin = st.count
        self._send(st.conn, frame(MSG_FIN, FIN_BODY.pack(st.tensor_id, st.count)))

    def _deliver(self, tensor_id: int) -> None:
        st = self._active.pop(tensor_id, None)
        if st is None:
            return
        self._finished_ids.add(tensor_id)
        with self._cond:
            own = self._own.pop(tensor_id, None)
            values = apply_missing_policy(st.values, st.received, st.vps, self.missing_policy, own)
            self._done[tensor_id] = TransferResult(
                tensor_id, values, st.received, st.need, st.received_at_fin, st.p, st.stage,
                st.start_time, st.fin_time if st.fin_time is not None else time.monotonic(),
                st.retx_requests, st.duplicates)
            self._cond.notify_all()

    def _drain_udp(self) -> None:
        cmsg_space = socket.CMSG_SPACE(4)
        for _ in range(512):
            try:
                nbytes, anc, _flags, _addr = self.udp.recvmsg_into([self._rxbuf], cmsg_space)
            except BlockingIOError:
                return
            self._on_data(nbytes, anc[0][2][0] if anc else 0)

    def _on_data(self, nbytes: int, tos: int) -> None:
        if nbytes < DATA_HEADER_LEN:
            self.malformed += 1
            return
        tensor_id, offset, length, seq, flags, _ = DATA_HEADER.unpack_from(self._rxbuf, 0)
        rank = priority_rank(tos >> 2)
        self._rank_last_arrival[rank] = time.monotonic()
        if not flags & FLAG_END_MARK:      # per-ToS arrivals of data datagrams (E3 accounting)
            self.tos_counts[tos] = self.tos_counts.get(tos, 0) + 1
        st = self._active.get(tensor_id)
        if st is None and tensor_id not in self._finished_ids:
            st = self._start_pending_control(tensor_id)
        if st is None:
            if flags & FLAG_END_MARK:
                return                      # a marker of a finished round: nothing to count
            if tensor_id in self._finished_ids:
                self.late_packets += 1
            else:
                self.early_drops += 1
            return
        if flags & FLAG_END_MARK:
            if length or nbytes != DATA_HEADER_LEN:
                self.malformed += 1
            else:
                self.end_marks += 1
                self._on_end_mark(st, seq)
            return
        seg, rem = divmod(offset, st.vps)
        expected_len = min(st.vps, st.values.size - offset) if offset < st.values.size else -1
        if rem or length != expected_len or nbytes != DATA_HEADER_LEN + 4 * length:
            self.malformed += 1
            return
        self.data_packets += 1
        st.rank = rank
        st.arrivals += 1
        st.last_arrival = time.monotonic()
        st.window_bytes += nbytes + WIRE_OVERHEAD
        if st.received[seg]:
            st.duplicates += 1
            return
        st.values[offset:offset + length] = np.frombuffer(self._rxbuf, ">f4", length, DATA_HEADER_LEN)
        st.received[seg] = True
        st.count += 1
        if st.fin_time is None and st.count >= st.need:
            self._send_fin(st, time.monotonic())

    def _start_pending_control(self, tensor_id: int) -> _Inbound | None:
        """Unknown tensor: read control messages already waiting (its START may be there,
        queued behind the datagrams this thread is draining) before calling it early."""
        for key, _ in self._sel.select(0):
            if key.data == "conn":
                self._read_control(key.fileobj)
        return self._active.get(tensor_id)

    def _send_rate_reports(self, now: float) -> None:
        for st in self._active.values():
            if st.fin_time is not None:
                continue
            window = now - st.window_start
            if window <= 0:
                continue
            rate = st.window_bytes * 8 / window
            self._send(st.conn, frame(MSG_RATE, RATE_BODY.pack(st.tensor_id, rate, window)))
            st.window_bytes, st.window_start = 0, now


# --- sender --------------------------------------------------------------------------
@dataclass
class SendStats:
    tensor_id: int
    num_segments: int
    completion_s: float            # START sent -> FIN received
    packets_sent: int
    retransmitted: int
    stops: int
    retx_requests: int
    received_at_fin: int
    rate_halvings: int
    final_rate_bps: float
    tos: np.ndarray = field(repr=False)           # ToS byte per segment
    sends: np.ndarray = field(repr=False)         # transmissions per segment
    retx_lists: list = field(default_factory=list, repr=False)  # each RETX_REQ's segments


class DlcpSender:
    """DLCP sender to one receiver; send_tensor() is blocking and one tensor at a time.

    link_bps: host line rate (initial and maximum pacing rate); None sends unpaced.
    recovery: "dlcp" (STOP as soon as the data runs out) or "timer" (baseline: wait
    rto_s for FIN first, i.e. timeout-driven recovery; use with p = 0).
    retx_important: send retransmitted segments ECT whatever their importance: the
    receiver asked for them to meet the bound, and a Not-ECT resend would be dropped
    again and again while the queue stays above its threshold (our extension).
    rate_scope: "tensor" (the paper: every tensor starts at line rate) or "connection"
    (the rate carries over from one tensor to the next to the same receiver; our option
    for incasts of many small tensors). reset_on_retx: line rate again for a
    retransmission round (the paper) or keep the current rate.
    """

    def __init__(self, receiver_udp: tuple[str, int], receiver_tcp: tuple[str, int], *,
                 link_bps: float | None = 1e9, values_per_segment: int = VALUES_PER_SEGMENT,
                 bounds: LossBounds = LossBounds(), policy=None, seed: int = 0,
                 order: str = "random", rate_control: bool = True, recovery: str = "dlcp",
                 rto_s: float = 0.01, source_ip: str | None = None, timeout_s: float = 60.0,
                 start_delay_s: float = 0.0, retx_important: bool = True,
                 rate_scope: str = "tensor", reset_on_retx: bool = True) -> None:
        if not 1 <= values_per_segment <= MAX_VALUES_PER_SEGMENT:
            raise ValueError(f"values_per_segment must be in 1..{MAX_VALUES_PER_SEGMENT}")
        if recovery not in ("dlcp", "timer"):
            raise ValueError(f"recovery {recovery!r}: use 'dlcp' or 'timer'")
        if link_bps is not None and link_bps <= 0:
            raise ValueError("link_bps must be > 0 (or None for unpaced)")
        send_order(1, seed, 0, 0, order)    # validates `order`
        self.receiver_udp = receiver_udp
        self.vps = values_per_segment
        self.bounds = bounds
        self.policy = policy
        self.seed = seed
        self.order = order
        self.link_bps = link_bps
        self.rate_control = rate_control and link_bps is not None
        self.recovery = recovery
        self.rto_s = rto_s
        self.timeout_s = timeout_s
        self.start_delay_s = start_delay_s
        self.retx_important = retx_important
        if rate_scope not in ("tensor", "connection"):
            raise ValueError(f"rate_scope {rate_scope!r}: use 'tensor' or 'connection'")
        self.rate_scope = rate_scope
        self.reset_on_retx = reset_on_retx
        self.shared_rate = RateController(link_bps) if link_bps and rate_scope == "connection" else None
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        if source_ip:
            self.udp.bind((source_ip, 0))
        # Control DSCP before connect: the SYN too must ride the control queue, or a
        # best-effort queue full of background traffic can hold the handshake back.
        self.ctrl = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.ctrl.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, CONTROL_TOS)
        self.ctrl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if source_ip:
            self.ctrl.bind((source_ip, 0))
        self.ctrl.settimeout(30)
        self.ctrl.connect(receiver_tcp)
        self.ctrl.setblocking(False)
        self.reader = FrameReader()

    def close(self) -> None:
        self.udp.close()
        self.ctrl.close()

    def __enter__(self) -> "DlcpSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def marks(self, values: np.ndarray, layer: int, num_layers: int, n: int) -> np.ndarray:
        """ToS byte per segment from the marking policy (best effort when none)."""
        if self.policy is None:
            return np.zeros(n, np.uint8)
        dscp, ecn = self.policy(layer=layer, num_layers=num_layers, values=values,
                                values_per_packet=self.vps, num_packets=n)
        return ((dscp.astype(np.uint8) & 0x3F) << 2 | (ecn.astype(np.uint8) & 0x3)).astype(np.uint8)

    def send_tensor(self, tensor_id: int, values: np.ndarray, *, stage: str = "push",
                    layer: int = 0, num_layers: int = 1, iteration: int = 0,
                    p: float | None = None) -> SendStats:
        flat = np.ravel(values)
        if flat.size == 0:
            raise ValueError(f"tensor {tensor_id} is empty")
        if not np.all(np.isfinite(flat)):
            raise ValueError(f"tensor {tensor_id} has {int(np.count_nonzero(~np.isfinite(flat)))} "
                             "NaN/inf values")
        p = self.bounds.for_stage(stage) if p is None else p
        if not 0 <= p < 1:
            raise ValueError(f"loss bound p={p} must be in [0, 1)")
        return _Transfer(self, tensor_id, flat, stage, layer, num_layers, iteration, p).run()


class _Transfer:
    """One tensor transfer on the sender side (send loop, STOP/RETX rounds, pacing)."""

    def __init__(self, sender: DlcpSender, tensor_id, flat, stage, layer, num_layers,
                 iteration, p) -> None:
        self.s = sender
        self.tensor_id = tensor_id
        self.rows = encode_segments(tensor_id, flat, sender.vps)
        self.n = len(self.rows)
        self.lengths = DATA_HEADER_LEN + 4 * segment_bounds(flat.size, sender.vps)[:, 1]
        self.tos = sender.marks(flat, layer, num_layers, self.n)
        self.sends = np.zeros(self.n, np.int64)
        self.pending = list(send_order(self.n, sender.seed, tensor_id, iteration, sender.order))
        self.start = START_BODY.pack(tensor_id, flat.size, self.n, sender.vps, p,
                                     STAGES.index(stage))
        self.rc = sender.shared_rate or (RateController(sender.link_bps) if sender.link_bps else None)
        self.fin: int | None = None
        self.retx: list[int] | None = None
        self.seq = 0
        self.stops = 0
        self.retx_requests = 0
        self.retx_lists: list[list[int]] = []
        self.sent_bytes_window = 0
        self.window_start = 0.0

    def run(self) -> SendStats:
        t0 = time.monotonic()
        self.deadline = t0 + self.s.timeout_s
        if self.s.start_delay_s <= 0:
            self._control(MSG_START, self.start)        # zero-RTT: data follows at once
        self.window_start = t0
        retransmission = False
        while True:
            self._send_pending(retransmission, t0)
            if self.fin is not None:
                break
            if self.s.recovery == "timer":
                self._wait(time.monotonic() + self.s.rto_s)   # baseline: retransmit on timeout
                if self.fin is not None:
                    break
            self.stops += 1
            self._control(MSG_STOP, STOP_BODY.pack(self.tensor_id, int(self.sends.sum())))
            self._wait(self.deadline, until_retx=True)
            if self.fin is not None:
                break
            self.pending, self.retx, retransmission = self.retx, None, True
            if self.rc is not None and self.s.reset_on_retx:
                self.rc.on_retransmission()
        done = time.monotonic()
        self._control(MSG_FIN_CONFIRM, ID_BODY.pack(self.tensor_id))
        total = int(self.sends.sum())
        return SendStats(self.tensor_id, self.n, done - t0, total, total - int((self.sends > 0).sum()),
                         self.stops, self.retx_requests, self.fin,
                         self.rc.halvings if self.rc else 0,
                         self.rc.rate_bps if self.rc else 0.0, self.tos, self.sends,
                         self.retx_lists)

    def _control(self, msg_type: int, body: bytes) -> None:
        ctrl = self.s.ctrl
        ctrl.settimeout(10.0)
        try:
            ctrl.sendall(frame(msg_type, body))
        finally:
            ctrl.setblocking(False)

    def _send_pending(self, retransmission: bool, t0: float) -> None:
        udp, addr = self.s.udp, self.s.receiver_udp
        flags = FLAG_RETX if retransmission else 0
        next_t = time.monotonic()
        for i, seg in enumerate(self.pending):
            if i % 4 == 0:
                self._poll()
                if self.fin is not None:
                    return
            if self.s.start_delay_s > 0 and time.monotonic() - t0 >= self.s.start_delay_s:
                self._control(MSG_START, self.start)   # test hook: START after some data
                self.s.start_delay_s = 0
            row = self.rows[seg]
            row[14] = flags
            struct.pack_into("!I", row, 10, self.seq & 0xFFFFFFFF)
            length = int(self.lengths[seg])
            tos = int(self.tos[seg])
            if retransmission and self.s.retx_important:
                tos = (tos & 0xFC) | 0b10     # requested to meet the bound: not droppable
            udp.sendmsg([row[:length]], [(socket.IPPROTO_IP, socket.IP_TOS,
                                           struct.pack("i", tos))], 0, addr)
            self.seq += 1
            self.sends[seg] += 1
            self.sent_bytes_window += length + WIRE_OVERHEAD
            next_t = self._pace(next_t, length + WIRE_OVERHEAD)
        if self.s.start_delay_s > 0:
            self._control(MSG_START, self.start)
            self.s.start_delay_s = 0
        if self.s.recovery == "dlcp" and self.pending:
            self._send_end_mark(self.pending[-1])

    def _send_end_mark(self, last_seg: int) -> None:
        """Empty END_MARK behind the round's data, same DSCP, ECT; seq = datagrams sent."""
        tos = (int(self.tos[last_seg]) & 0xFC) | 0b10
        mark = DATA_HEADER.pack(self.tensor_id, 0, 0, int(self.sends.sum()), FLAG_END_MARK, 0)
        self.s.udp.sendmsg([mark], [(socket.IPPROTO_IP, socket.IP_TOS, struct.pack("i", tos))],
                           0, self.s.receiver_udp)

    def _pace(self, next_t: float, wire_bytes: int) -> float:
        """Token-bucket pacing at the controller's rate; sleeps only when >0.5 ms ahead."""
        if self.rc is None:
            return next_t
        now = time.monotonic()
        next_t = max(next_t, now - 0.002) + wire_bytes * 8 / self.rc.rate_bps
        if next_t - now > 0.0005:
            time.sleep(next_t - now)
        return next_t

    def _poll(self, timeout: float = 0.0) -> None:
        ctrl = self.s.ctrl
        if timeout > 0:
            ctrl.settimeout(timeout)
        try:
            data = ctrl.recv(65536)
        except (BlockingIOError, socket.timeout):
            return
        finally:
            ctrl.setblocking(False)
        if not data:
            raise DlcpError(f"tensor {self.tensor_id}: control connection closed by receiver")
        for msg_type, body in self.s.reader.feed(data):
            self._on_control(msg_type, body)

    def _on_control(self, msg_type: int, body: bytes) -> None:
        tid = ID_BODY.unpack_from(body)[0]
        if tid != self.tensor_id:
            return          # a stale message of an earlier tensor (e.g. a late rate report)
        if msg_type == MSG_FIN:
            self.fin = FIN_BODY.unpack(body)[1]
        elif msg_type == MSG_RETX_REQ:
            self.retx_requests += 1
            self.retx = np.frombuffer(body, ">u4", offset=4).astype(np.int64).tolist()
            self.retx_lists.append(list(self.retx))
        elif msg_type == MSG_RATE:
            self._on_rate(*RATE_BODY.unpack(body)[1:])
        elif msg_type == MSG_ERROR:
            raise DlcpError(f"receiver refused tensor {tid}: {body[4:].decode(errors='replace')}")

    def _on_rate(self, recv_bps: float, _window: float) -> None:
        now = time.monotonic()
        elapsed = now - self.window_start
        if self.rc is None or not self.s.rate_control or elapsed <= 0:
            return
        send_bps = self.sent_bytes_window * 8 / elapsed
        self.sent_bytes_window, self.window_start = 0, now
        self.rc.on_report(send_bps, recv_bps)

    def _wait(self, until: float, until_retx: bool = False) -> None:
        """Process control messages until FIN (or RETX_REQ) or the time `until`."""
        while self.fin is None and not (until_retx and self.retx is not None):
            left = until - time.monotonic()
            if left <= 0:
                if until_retx:
                    raise TimeoutError(f"tensor {self.tensor_id}: no FIN/RETX_REQ within "
                                       f"{self.s.timeout_s} s of START")
                return
            self._poll(min(left, 0.05))
