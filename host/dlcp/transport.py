"""DLCP bounded-loss transport for plain fp32 tensor transfers (DLCP paper, §3.2.1 and §4.1).

Two channels between a sender and a receiver:

* **Data: UDP**, on the batched datagram core (:mod:`host.datagram`: sendmmsg/recvmmsg,
  a ToS byte per datagram as an ``IP_TOS`` control message). Every datagram is a 16-byte
  DLCP header followed by big-endian fp32 values. A tensor is cut into consecutive
  segments of ``values_per_segment`` values (no value spans two datagrams); the header
  says where a segment goes, so arrival order does not matter. The ToS byte (band DSCP,
  ECT/Not-ECT) comes from the marking policy.
* **Control: TCP**, sent with the control DSCP (48, queue 7), framed as
  ``type u8 | length u32 | body``: ANNOUNCE, END, STATUS, RATE_REPORT, ERROR.

Protocol: the unit of control is an **iteration** (a batch of tensors, e.g. every
gradient of one training step), named by its key = the first tensor's id.

1. Zero-RTT start: the sender sends one ANNOUNCE listing every tensor of the iteration
   (id, size, segments, p, stage) and at once starts sending the data of all of them,
   back to back, paced by one rate controller that lives as long as the sender. Data
   that reaches the receiver before ANNOUNCE is dropped and counted (``early_drops``);
   it counts as lost, which the bound and the band's STATUS cover.
2. The receiver copies each segment into place. A tensor is complete at the first
   arrival at which ``received >= ceil((1-p) * num_segments)`` (its completion time is
   recorded). When every tensor of the iteration is complete the receiver sends
   STATUS(done) at once; the sender stops sending (the FIN cut, per iteration) and the
   receiver delivers the tensors.
3. **A STATUS per band, when that band has passed.** The iteration is cut into band
   sections (:func:`band_sections`: consecutive tensors whose datagrams use the same
   DSCPs; in backprop order with DlcpPolicy, one section per band). Right behind a
   section's last datagram the sender sends an empty END_MARK datagram in every band the
   section used (ECT, so only a full buffer drops it; same FIFO as the section's data).
   When all of a section's markers are in, everything of it sent before them has arrived
   or was dropped, so the receiver at once sends a STATUS naming, for each of the
   section's tensors still below its bound, its missing segments (tensors within their
   bound and other sections are not named). The sender puts those resends (ECT, flag
   RETX) at the front of its queue, i.e. right after the STATUS, while later sections are
   still being sent, and ends them with the section's markers again, so a resend lost
   again is asked for in the same way. The loss bound is thus met band by band: a band
   is asked about only once its own data has passed, and a band still queued behind
   higher ones (late, not lost) is waited for.
4. END (the paper's STOP): when the sender's queue runs dry before STATUS(done) it sends
   every section's newest marker batch once more (a batch lost to a full buffer still
   brings its STATUS; one already answered is known by its seq and ignored), then END on
   TCP. END overtakes data still queued in the network (it rides the top queue),
   so the receiver answers it only for tensors no marker has covered yet, and only when
   it has seen as many datagrams as the sender sent or (a marker lost) when the
   iteration's data has been idle for ``stop_drain_s``, counting only idle time in which
   nothing of the same or higher priority arrived (our extension: without it a receiver
   requests segments that are merely queued behind higher bands). After that idle time
   it names every tensor below its bound, including those whose resends' marker was
   lost. There is no timer-driven data retransmission (``recovery="timer"`` exists only
   as the evaluation baseline: no markers, END after ``rto_s``).
5. Segment order is a fresh seeded permutation per (tensor, iteration), so the tail that
   a cut or a loss takes is not the same parameters every iteration.
6. The receiver reports the iteration's receive rate every ``report_period_s``; the
   sender runs :class:`~host.dlcp.ratecontrol.RateController` on it and paces to its
   rate. The controller is not restarted per tensor or per iteration.

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
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dataplane.config import CONTROL_DSCP, DATA_DSCP_BASE, NUM_DATA_BANDS
from host.datagram import SOCKET_BUFFER_BYTES, DatagramSocket, PacketRows
from host.dlcp.marking import tos_byte
from host.dlcp.ratecontrol import REPORT_PERIOD_S, RateController

FINISHED_MEMORY = 4096      # finished tensor ids a receiver remembers (late vs early datagrams)

# --- wire format -------------------------------------------------------------------
DATA_HEADER = struct.Struct("!IIHIBB")   # tensor_id, offset (values), length (values), seq, flags, reserved
DATA_HEADER_LEN = DATA_HEADER.size       # 16
HEADER_DTYPE = np.dtype([("tensor", ">u4"), ("offset", ">u4"), ("length", ">u2"),
                         ("seq", ">u4"), ("flags", "u1"), ("reserved", "u1")])
FLAG_RETX = 0x01
FLAG_END_MARK = 0x02     # end of a band section: tensor = iteration key, offset = the section's
                         # first tensor (ANNOUNCE order), length = its tensors, seq = data
                         # datagrams sent so far, reserved = markers sent with it; no payload
VALUES_PER_SEGMENT = 350                 # 1400 B of fp32: one 1500-byte-MTU datagram
MAX_VALUES_PER_SEGMENT = (65507 - DATA_HEADER_LEN) // 4
WIRE_OVERHEAD = 14 + 20 + 8              # Ethernet + IPv4 + UDP, for pacing
RX_ROWS = 64                             # datagrams per recvmmsg
BATCH_MAX = 64                           # datagrams per sendmmsg

MSG_ANNOUNCE, MSG_END, MSG_STATUS, MSG_RATE, MSG_ERROR = range(1, 6)
FRAME = struct.Struct("!BI")
ANNOUNCE_HEAD = struct.Struct("!II")     # key, tensors
TENSOR_ENTRY = struct.Struct("!IIIHdB")  # tensor_id, num_values, num_segments, vps, p, stage
END_BODY = struct.Struct("!II")          # key, datagrams sent (all rounds)
STATUS_HEAD = struct.Struct("!IBI")      # key, done, entries
STATUS_ENTRY = struct.Struct("!III")     # tensor_id, received, missing listed (then u32 each)
RATE_BODY = struct.Struct("!Iddd")       # key, receive rate (bit/s), window (s), CE share
ID_BODY = struct.Struct("!I")
STAGES = ("push", "pull")
MISSING_POLICIES = ("zero", "own")
CONTROL_TOS = tos_byte(CONTROL_DSCP, 0)
ECT0 = 0b10


class DlcpError(RuntimeError):
    """The peer refused a transfer or the control connection broke."""


def priority_rank(dscp):
    """0 for data band 0 (served first among data) ... 6 for band 6, 7 for anything else
    (works on a DSCP or an array of them)."""
    band = np.asarray(dscp, np.int64) - DATA_DSCP_BASE
    rank = np.where((band >= 0) & (band < NUM_DATA_BANDS), band, NUM_DATA_BANDS)
    return int(rank) if rank.ndim == 0 else rank


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


@dataclass(frozen=True)
class TensorAnnouncement:
    tensor_id: int
    num_values: int
    num_segments: int
    vps: int
    p: float
    stage: int


def announce_body(key: int, tensors: list[TensorAnnouncement]) -> bytes:
    return ANNOUNCE_HEAD.pack(key, len(tensors)) + b"".join(
        TENSOR_ENTRY.pack(t.tensor_id, t.num_values, t.num_segments, t.vps, t.p, t.stage)
        for t in tensors)


def parse_announce(body: bytes) -> tuple[int, list[TensorAnnouncement]]:
    key, count = ANNOUNCE_HEAD.unpack_from(body, 0)
    if len(body) != ANNOUNCE_HEAD.size + count * TENSOR_ENTRY.size:
        raise struct.error("ANNOUNCE length disagrees with its tensor count")
    return key, [TensorAnnouncement(*TENSOR_ENTRY.unpack_from(body, ANNOUNCE_HEAD.size + k * TENSOR_ENTRY.size))
                 for k in range(count)]


def status_body(key: int, done: bool, entries: list[tuple[int, int, np.ndarray]]) -> bytes:
    parts = [STATUS_HEAD.pack(key, int(done), len(entries))]
    for tid, received, missing in entries:
        parts.append(STATUS_ENTRY.pack(tid, received, len(missing)))
        parts.append(np.asarray(missing, ">u4").tobytes())
    return b"".join(parts)


def parse_status(body: bytes) -> tuple[int, bool, dict[int, tuple[int, np.ndarray]]]:
    """key, done, {tensor_id: (segments received, missing segments asked for)}."""
    key, done, count = STATUS_HEAD.unpack_from(body, 0)
    pos, out = STATUS_HEAD.size, {}
    for _ in range(count):
        tid, received, nmiss = STATUS_ENTRY.unpack_from(body, pos)
        pos += STATUS_ENTRY.size
        if pos + 4 * nmiss > len(body):
            raise struct.error("STATUS entry runs past the message")
        out[tid] = (received, np.frombuffer(body, ">u4", nmiss, pos).astype(np.int64))
        pos += 4 * nmiss
    return key, bool(done), out


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


def band_sections(tos_per_tensor: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Cut an iteration (tensors in send order, each with its datagrams' ToS bytes) into
    band sections: maximal runs of consecutive tensors whose datagrams use the same set
    of DSCPs. Returns each tensor's section and each section's (first tensor, count).
    In backprop order with DlcpPolicy a section is one band: it is sent in one stretch,
    and its END_MARK right behind it says the band has passed."""
    section_of = np.zeros(len(tos_per_tensor), np.int64)
    sections: list[tuple[int, int]] = []
    previous = None
    for k, tos in enumerate(tos_per_tensor):
        dscps = frozenset((np.asarray(tos) >> 2).tolist())
        if dscps == previous:
            first, count = sections[-1]
            sections[-1] = (first, count + 1)
        else:
            sections.append((k, 1))
        section_of[k], previous = len(sections) - 1, dscps
    return section_of, sections


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
    need: int                     # segments required for completion
    received_at_fin: int          # segments in when the tensor reached its bound
    p: float
    stage: str
    start_time: float             # receiver clock (monotonic) when ANNOUNCE arrived
    fin_time: float               # receiver clock when the tensor reached its bound
    retx_requests: int            # STATUS messages that asked for its segments
    duplicates: int

    @property
    def delivered_fraction(self) -> float:
        return float(self.received.mean()) if self.received.size else 1.0


@dataclass(eq=False)
class _Inbound:
    """One announced tensor: its buffer as rows of one segment each."""
    tensor_id: int
    iteration: "_InboundIteration"
    padded: np.ndarray            # float32 [segments, vps]; values = padded.ravel()[:num_values]
    num_values: int
    received: np.ndarray
    vps: int
    need: int
    p: float
    stage: str
    count: int = 0
    fin_time: float | None = None
    received_at_fin: int = 0
    retx_requests: int = 0
    duplicates: int = 0
    asked: bool = False           # a STATUS asked for its segments; no marker behind the answer yet

    @property
    def complete(self) -> bool:
        return self.fin_time is not None


@dataclass(eq=False)         # identity: iterations are set members
class _InboundIteration:
    key: int
    conn: socket.socket
    tensors: list
    start_time: float
    incomplete: int = 0
    window_bytes: int = 0
    window_start: float = 0.0
    window_packets: int = 0
    window_ce: int = 0                # CE-marked arrivals in the report window
    arrivals: int = 0                 # data datagrams, duplicates included
    last_arrival: float = 0.0
    rank: int = 0                     # lowest priority (highest rank) its data arrived with
    stop_sent: int | None = None      # END seen (datagrams the sender had sent), not answered
    stop_time: float = 0.0
    marks: dict = field(default_factory=dict)   # (first tensor, seq) -> [markers seen, in the batch]
    section_answered: dict = field(default_factory=dict)   # first tensor -> newest seq answered
    answered_sent: int = -1           # the END (by `sent`) already answered
    done: bool = False


class DlcpReceiver:
    """DLCP receiver: one UDP data socket and a TCP control listener, served by a thread."""

    def __init__(self, host: str = "127.0.0.1", udp_port: int = 0, tcp_port: int = 0, *,
                 max_values: int = 1 << 24, missing_policy: str = "zero",
                 report_period_s: float = REPORT_PERIOD_S, stop_drain_s: float = 0.02,
                 rcvbuf: int = 8 << 20, batched: bool | None = None,
                 finished_memory: int = FINISHED_MEMORY) -> None:
        if missing_policy not in MISSING_POLICIES:
            raise ValueError(f"missing_policy {missing_policy!r}: use one of {MISSING_POLICIES}")
        if report_period_s <= 0:
            raise ValueError("report_period_s must be > 0")
        if finished_memory < 1:
            raise ValueError("finished_memory must be >= 1 (tensor ids remembered as finished)")
        self.max_values = max_values
        self.finished_memory = finished_memory
        self.missing_policy = missing_policy
        self.report_period_s = report_period_s
        self.stop_drain_s = stop_drain_s
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.udp.bind((host, udp_port))
        self.io = DatagramSocket(self.udp, rx_rows=RX_ROWS, rx_width=65536, batched=batched,
                                 rx_tos=True)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, tcp_port))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.udp_addr = self.udp.getsockname()
        self.tcp_addr = self.listener.getsockname()
        # Counters (read them after wait()): datagrams by fate, and arrivals per ToS byte.
        self.early_drops = 0          # data for a tensor not announced yet (zero-RTT race)
        self.late_packets = 0         # data for a tensor already delivered
        self.malformed = 0
        self.malformed_control = 0
        self.end_marks = 0
        self.data_packets = 0
        self.tos_counts: dict[int, int] = {}
        self.control_counts: dict[int, int] = {}   # control messages received, by type
        self.statuses_sent = 0
        self._active: dict[int, _Inbound] = {}
        self._iterations: dict[int, _InboundIteration] = {}
        self._own: dict[int, np.ndarray] = {}
        self._done: dict[int, TransferResult] = {}
        # the newest finished tensor ids, oldest first: their stray datagrams count as late
        # (older ones as early drops); bounded, as ids grow with the iteration
        self._finished_ids: dict[int, None] = {}
        self._errors: list[str] = []
        self._failure: BaseException | None = None   # what ended the event loop, if anything
        self._cond = threading.Condition()
        self._readers: dict[socket.socket, FrameReader] = {}
        self._dead: set[socket.socket] = set()
        self._rank_last_arrival = np.zeros(NUM_DATA_BANDS + 1)   # newest data arrival per rank
        self._stop = threading.Event()
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
        """Block until tensor_id is delivered (its iteration is done); pops the result."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while tensor_id not in self._done:
                if self._failure is not None:
                    raise DlcpError(f"tensor {tensor_id}: the receiver stopped: "
                                    f"{self._failure!r}") from self._failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"tensor {tensor_id} not delivered within {timeout} s")
                self._cond.wait(left)
            return self._done.pop(tensor_id)

    # -- event loop --
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:       # reported to the senders and to wait(), with its traceback
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """The event loop died: every sender with an iteration in flight gets an ERROR
        naming the cause (its send raises at once instead of timing out), every control
        connection is closed (a sender between iterations reads that as the end) and so is
        the listener (a new sender's connect is refused), and wait() raises."""
        why = f"receiver stopped: {exc!r}"
        for it in list(self._iterations.values()):
            self._send(it.conn, frame(MSG_ERROR, ID_BODY.pack(it.key) + why.encode()))
        for sock in list(self._readers) + [self.listener]:
            sock.close()
        with self._cond:
            self._failure = exc
            self._cond.notify_all()

    def _loop(self) -> None:
        next_report = time.monotonic() + self.report_period_s
        while not self._stop.is_set():
            timeout = 0.05
            if self._iterations:
                timeout = min(max(0.0, next_report - time.monotonic()), self.stop_drain_s)
            # Control first: ANNOUNCE then usually precedes its own zero-RTT data in one batch.
            events = sorted(self._sel.select(timeout), key=lambda ev: ev[0].data == "udp")
            for key, _ in events:
                if key.data == "udp":
                    self._drain_udp()
                elif key.data == "listen":
                    self._accept()
                else:
                    self._read_control(key.fileobj)
            now = time.monotonic()
            self._answer_ends(now)
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
        for key in [k for k, it in self._iterations.items() if it.conn is conn]:
            self._forget(self._iterations.pop(key))
        conn.close()

    def _forget(self, it: _InboundIteration) -> None:
        for st in it.tensors:
            self._active.pop(st.tensor_id, None)

    def _read_control(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return                    # already read (an ANNOUNCE looked up early)
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
        self.control_counts[msg_type] = self.control_counts.get(msg_type, 0) + 1
        if msg_type == MSG_ANNOUNCE:
            self._on_announce(conn, *parse_announce(body))
        elif msg_type == MSG_END:
            self._on_end(*END_BODY.unpack(body))
        else:
            self.malformed_control += 1
            self._errors.append(f"unexpected control message type {msg_type}")

    def _refuse(self, conn: socket.socket, key: int, why: str) -> None:
        self._errors.append(why)
        self._send(conn, frame(MSG_ERROR, ID_BODY.pack(key) + why.encode()))

    def _check(self, t: TensorAnnouncement, seen: set) -> str | None:
        """Why an announced tensor is refused (None: accepted)."""
        tid = t.tensor_id
        if tid in self._active or tid in seen:
            return f"tensor {tid} is already in transfer"
        if t.num_values > self.max_values:
            return (f"tensor {tid}: {t.num_values} values exceed the receive buffer "
                    f"({self.max_values}); raise max_values")
        if not 1 <= t.vps <= MAX_VALUES_PER_SEGMENT or t.num_values < 1 \
                or t.num_segments != segment_count(t.num_values, t.vps) \
                or not 0 <= t.p < 1 or t.stage > 1:
            return f"tensor {tid}: inconsistent ANNOUNCE entry"
        return None

    def _on_announce(self, conn, key: int, tensors: list[TensorAnnouncement]) -> None:
        if not tensors or tensors[0].tensor_id != key:
            return self._refuse(conn, key, f"iteration {key}: the key must be its first tensor's id")
        seen: set[int] = set()
        for t in tensors:
            why = self._check(t, seen)
            if why:
                return self._refuse(conn, key, f"iteration {key}: {why}")
            seen.add(t.tensor_id)
        now = time.monotonic()
        it = _InboundIteration(key, conn, [], now, window_start=now)
        for t in tensors:
            st = _Inbound(t.tensor_id, it, np.zeros((t.num_segments, t.vps), np.float32),
                          t.num_values, np.zeros(t.num_segments, bool), t.vps,
                          fin_threshold(t.num_segments, t.p), t.p, STAGES[t.stage])
            if st.need == 0:
                st.fin_time = now
            else:
                it.incomplete += 1
            it.tensors.append(st)
            self._active[t.tensor_id] = st
            self._finished_ids.pop(t.tensor_id, None)
        self._iterations[key] = it
        if it.incomplete == 0:
            self._finish(it)

    def _on_end(self, key: int, sent: int) -> None:
        it = self._iterations.get(key)
        if it is None or it.done or sent <= it.answered_sent:
            return      # done already, or this END was answered
        it.stop_sent = sent
        it.stop_time = time.monotonic()
        self._answer_ends(it.stop_time)

    def _answer_ends(self, now: float) -> None:
        """Answer END with a STATUS for the tensors no band marker has covered, once none
        of them is still in flight.

        END travels on the top-priority control queue and overtakes data still queued in
        the network; answering at once would request segments that are about to arrive.
        A tensor below its bound that is not `asked` has no marker behind its data yet:
        its band is late (starved under strict priority), not lost, and is waited for.
        """
        for it in list(self._iterations.values()):
            if it.stop_sent is None or it.done:
                continue
            # Fallback clock (a marker lost): runs only while nothing of this priority or
            # above arrives. Under strict priority a starved band's data sits in the
            # switch; asking for it again would only add duplicates to a full queue.
            busy = float(self._rank_last_arrival[:it.rank + 1].max())
            idle = now - max(it.last_arrival, it.stop_time, busy) >= self.stop_drain_s
            short = [st for st in it.tensors if not st.complete]
            unasked = [st for st in short if not st.asked]
            if idle:
                self._request_missing(it, short)       # resends whose marker was lost, too
            elif unasked and it.arrivals >= it.stop_sent:
                self._request_missing(it, unasked)     # every datagram sent is in
            else:
                continue                               # in flight, or every band already asked
            it.answered_sent, it.stop_sent = it.stop_sent, None

    def _answer_section(self, it: _InboundIteration, first: int, count: int, seq: int) -> None:
        """A band section's markers are all in: everything sent before them has arrived or
        was dropped, so ask at once for the missing segments of its tensors below their
        bound (its other tensors, and other sections, are not named)."""
        it.section_answered[first] = seq
        section = it.tensors[first:first + count]
        for st in section:
            st.asked = False
        short = [st for st in section if not st.complete]
        if short:
            self._request_missing(it, short)

    def _request_missing(self, it: _InboundIteration, short: list) -> None:
        """One STATUS (not done) listing, for each tensor in `short` (all below their
        bound), the segments it is missing."""
        entries = []
        for st in short:
            st.retx_requests += 1
            st.asked = True
            entries.append((st.tensor_id, st.count, np.flatnonzero(~st.received)))
        self.statuses_sent += 1
        self._send(it.conn, frame(MSG_STATUS, status_body(it.key, False, entries)))

    def _finish(self, it: _InboundIteration) -> None:
        """Every tensor met its bound: STATUS(done) and deliver (nothing more is sent)."""
        it.done = True
        entries = [(st.tensor_id, st.count, np.zeros(0, np.int64)) for st in it.tensors]
        self.statuses_sent += 1
        self._send(it.conn, frame(MSG_STATUS, status_body(it.key, True, entries)))
        del self._iterations[it.key]
        self._forget(it)
        with self._cond:
            for st in it.tensors:
                self._finished_ids[st.tensor_id] = None
                if len(self._finished_ids) > self.finished_memory:
                    del self._finished_ids[next(iter(self._finished_ids))]
                own = self._own.pop(st.tensor_id, None)
                values = apply_missing_policy(st.padded.reshape(-1)[:st.num_values], st.received,
                                              st.vps, self.missing_policy, own)
                self._done[st.tensor_id] = TransferResult(
                    st.tensor_id, values, st.received, st.need, st.received_at_fin, st.p,
                    st.stage, it.start_time, st.fin_time, st.retx_requests, st.duplicates)
            self._cond.notify_all()

    # -- data --
    def _drain_udp(self) -> None:
        for _ in range(64):
            n = self.io.receive()
            if n == 0:
                return
            self._on_batch(n)

    def _on_batch(self, n: int) -> None:
        """A batch of datagrams: headers parsed at once, segments copied per tensor."""
        now = time.monotonic()
        nbytes = self.io.rx_len[:n]
        tos = self.io.rx_tos[:n].astype(np.int64)
        short = nbytes < DATA_HEADER_LEN
        self.malformed += int(short.sum())
        rows = np.flatnonzero(~short)
        if not len(rows):
            return
        hdr = np.ascontiguousarray(self.io.rx[rows, :DATA_HEADER_LEN]).view(HEADER_DTYPE).ravel()
        rank = priority_rank(tos[rows] >> 2)
        self._rank_last_arrival[np.unique(rank)] = now
        is_mark = (hdr["flags"] & FLAG_END_MARK) != 0
        kinds, counts = np.unique(tos[rows][~is_mark], return_counts=True)
        for k, c in zip(kinds.tolist(), counts.tolist()):     # per-ToS arrivals (E3 accounting)
            self.tos_counts[k] = self.tos_counts.get(k, 0) + c
        data = ~is_mark
        tids = hdr["tensor"][data]
        for tid in np.unique(tids).tolist():
            pick = np.flatnonzero(data)[tids == tid]
            self._on_tensor_data(tid, rows[pick], hdr[pick], rank[pick], tos[rows[pick]], now)
        for it in {self._active[t].iteration for t in np.unique(tids).tolist() if t in self._active}:
            if it.incomplete == 0 and not it.done:
                self._finish(it)
        # Markers last: a marker in this batch came after the data in it.
        for i in np.flatnonzero(is_mark):
            self._on_end_mark(hdr[i], int(nbytes[rows[i]]))

    def _lookup(self, tensor_id: int) -> _Inbound | None:
        """An unknown tensor: read control messages already waiting (its ANNOUNCE may be
        there, queued behind the datagrams this thread is draining) before calling it early."""
        st = self._active.get(tensor_id)
        if st is None and tensor_id not in self._finished_ids:
            for key, _ in self._sel.select(0):
                if key.data == "conn":
                    self._read_control(key.fileobj)
            st = self._active.get(tensor_id)
        return st

    def _on_end_mark(self, h, nbytes: int) -> None:
        st = self._lookup(int(h["tensor"]))
        if st is None:
            return                          # a marker of a finished iteration: nothing to count
        it = st.iteration
        first, count, seq = int(h["offset"]), int(h["length"]), int(h["seq"])
        if (nbytes != DATA_HEADER_LEN or it.key != st.tensor_id or count < 1
                or first + count > len(it.tensors) or h["reserved"] < 1):
            self.malformed += 1
            return
        self.end_marks += 1
        seen = it.marks.setdefault((first, seq), [0, int(h["reserved"])])
        seen[0] += 1
        if (not it.done and seen[0] == seen[1]
                and seq > it.section_answered.get(first, -1)):
            del it.marks[(first, seq)]
            self._answer_section(it, first, count, seq)

    def _on_tensor_data(self, tid: int, rows, h, rank, tos, now: float) -> None:
        st = self._lookup(tid)
        if st is None:
            if tid in self._finished_ids:
                self.late_packets += len(rows)
            else:
                self.early_drops += len(rows)
            return
        nbytes = self.io.rx_len[rows]
        offset, length = h["offset"].astype(np.int64), h["length"].astype(np.int64)
        seg, rem = np.divmod(offset, st.vps)
        expected = np.where(offset < st.num_values, np.minimum(st.vps, st.num_values - offset), -1)
        ok = (rem == 0) & (length == expected) & (nbytes == DATA_HEADER_LEN + 4 * length)
        self.malformed += int((~ok).sum())
        if not ok.any():
            return
        rows, seg, nbytes = rows[ok], seg[ok], nbytes[ok]
        it = st.iteration
        self.data_packets += len(rows)
        it.arrivals += len(rows)
        it.last_arrival = now
        it.rank = max(it.rank, int(rank[ok].max()))
        it.window_bytes += int(nbytes.sum()) + WIRE_OVERHEAD * len(rows)
        it.window_packets += len(rows)
        it.window_ce += int(np.count_nonzero(tos[ok] & 3 == 3))
        seg, first = np.unique(seg, return_index=True)
        fresh = ~st.received[seg]
        st.duplicates += len(rows) - int(fresh.sum())
        seg, rows = seg[fresh], rows[first[fresh]]
        if not len(seg):
            return
        payload = self.io.rx[rows, DATA_HEADER_LEN:DATA_HEADER_LEN + 4 * st.vps]
        st.padded[seg] = payload.view(">f4")
        st.received[seg] = True
        st.count += len(seg)
        if not st.complete and st.count >= st.need:
            st.fin_time, st.received_at_fin = now, st.count
            it.incomplete -= 1

    def _send_rate_reports(self, now: float) -> None:
        for it in self._iterations.values():
            window = now - it.window_start
            if it.done or window <= 0:
                continue
            rate = it.window_bytes * 8 / window
            ce = it.window_ce / it.window_packets if it.window_packets else 0.0
            self._send(it.conn, frame(MSG_RATE, RATE_BODY.pack(it.key, rate, window, ce)))
            it.window_bytes, it.window_start, it.window_packets, it.window_ce = 0, now, 0, 0


# --- sender --------------------------------------------------------------------------
@dataclass
class SendStats:
    """One tensor of an iteration, as the sender saw it."""
    tensor_id: int
    num_segments: int
    first_sent: float              # sender clock (monotonic) of its first datagram
    completion_s: float            # the iteration's ANNOUNCE -> STATUS(done)
    packets_sent: int
    retransmitted: int
    stops: int                     # END messages of the iteration
    retx_requests: int             # STATUS messages that asked for its segments
    received_at_fin: int           # segments the receiver had when the iteration was done
    rate_halvings: int             # of the sender's controller, so far
    final_rate_bps: float
    tos: np.ndarray = field(repr=False)           # ToS byte per segment
    sends: np.ndarray = field(repr=False)         # transmissions per segment
    retx_lists: list = field(default_factory=list, repr=False)  # each request's segments
    last_seq: np.ndarray | None = field(default=None, repr=False)  # seq of each segment's last send


@dataclass(frozen=True)
class TensorToSend:
    """A tensor of an iteration: id, values and its layer (for the marking policy)."""
    tensor_id: int
    values: np.ndarray
    layer: int = 0


class DlcpSender:
    """DLCP sender to one receiver; send_iteration() is blocking, one iteration at a time.

    link_bps: host line rate (initial and maximum pacing rate); None sends unpaced.
    recovery: "dlcp" (an END_MARK behind every band section, so each band's STATUS comes
    as soon as the band has passed; END when the data runs out) or "timer" (baseline: wait
    rto_s for STATUS(done) first, i.e. timeout-driven recovery; use with p = 0).
    retx_important: send retransmitted segments ECT whatever their importance: the
    receiver asked for them to meet the bound, and a Not-ECT resend would be dropped
    again and again while the queue stays above its threshold (our extension).
    The rate controller lives as long as the sender: tensors and iterations carry its
    rate over. reset_on_retx: line rate again for a retransmission round (the paper).
    rate_delta, rate_ai, ce_threshold: the controller's Δ, additive increase (a fraction of
    the link per report) and its optional ECN echo (ratecontrol); None keeps the defaults.
    pace_burst_s: how far the pacer may catch up after falling behind (a sender that was
    descheduled sends that much of its rate at once, no more).
    retx_extra: None resends every segment a STATUS lists (the paper); a number resends
    only the tensor's deficit (need - received) times (1 + retx_extra) of them, in send
    order, since the bound needs no more (our option; the resends are ECT, so only a full
    buffer loses them).
    """

    def __init__(self, receiver_udp: tuple[str, int], receiver_tcp: tuple[str, int], *,
                 link_bps: float | None = 1e9, values_per_segment: int = VALUES_PER_SEGMENT,
                 bounds: LossBounds = LossBounds(), policy=None, seed: int = 0,
                 order: str = "random", rate_control: bool = True, recovery: str = "dlcp",
                 rto_s: float = 0.01, source_ip: str | None = None, timeout_s: float = 60.0,
                 start_delay_s: float = 0.0, retx_important: bool = True,
                 reset_on_retx: bool = True, batched: bool | None = None,
                 rate_delta: float | None = None, ce_threshold: float | None = None,
                 retx_extra: float | None = None, rate_ai: float | None = None,
                 pace_burst_s: float = 0.002) -> None:
        if not 1 <= values_per_segment <= MAX_VALUES_PER_SEGMENT:
            raise ValueError(f"values_per_segment must be in 1..{MAX_VALUES_PER_SEGMENT}")
        if recovery not in ("dlcp", "timer"):
            raise ValueError(f"recovery {recovery!r}: use 'dlcp' or 'timer'")
        if link_bps is not None and link_bps <= 0:
            raise ValueError("link_bps must be > 0 (or None for unpaced)")
        send_order(1, seed, 0, 0, order)    # validates `order`
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
        self.reset_on_retx = reset_on_retx
        if retx_extra is not None and retx_extra < 0:
            raise ValueError("retx_extra must be >= 0 (or None to resend every missing segment)")
        self.retx_extra = retx_extra
        if pace_burst_s < 0:
            raise ValueError("pace_burst_s must be >= 0")
        self.pace_burst_s = pace_burst_s
        self.rate_log: list[tuple[float, float, float, float, float]] = []   # see _on_rate
        self.rc = None
        if link_bps:
            tuned = {k: v for k, v in (("delta", rate_delta), ("ai_fraction", rate_ai)) if v is not None}
            self.rc = RateController(link_bps, ce_threshold=ce_threshold, **tuned)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        if source_ip:
            udp.bind((source_ip, 0))
        udp.connect(receiver_udp)
        self.udp = udp
        self.io = DatagramSocket(udp, rx_rows=1, rx_width=16, batched=batched)
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
        """One tensor as an iteration of its own."""
        return self.send_iteration([TensorToSend(tensor_id, values, layer)], stage=stage,
                                   num_layers=num_layers, iteration=iteration, p=p)[0]

    def send_iteration(self, tensors, *, stage: str = "push", num_layers: int = 1,
                       iteration: int = 0, p: float | None = None) -> list[SendStats]:
        """Send every tensor of an iteration (in the given order) with one control
        exchange; returns per-tensor stats once the receiver has them all within bound."""
        tensors = [t if isinstance(t, TensorToSend) else TensorToSend(*t) for t in tensors]
        if not tensors:
            raise ValueError("an iteration needs at least one tensor")
        ids = [t.tensor_id for t in tensors]
        if len(set(ids)) != len(ids):
            raise ValueError("tensor ids within an iteration must be distinct")
        p = self.bounds.for_stage(stage) if p is None else p
        if not 0 <= p < 1:
            raise ValueError(f"loss bound p={p} must be in [0, 1)")
        flats = []
        for t in tensors:
            flat = np.ravel(t.values)
            if flat.size == 0:
                raise ValueError(f"tensor {t.tensor_id} is empty")
            if not np.all(np.isfinite(flat)):
                raise ValueError(f"tensor {t.tensor_id} has "
                                 f"{int(np.count_nonzero(~np.isfinite(flat)))} NaN/inf values")
            flats.append(flat)
        return _IterationTransfer(self, tensors, flats, stage, num_layers, iteration, p).run()


@dataclass(eq=False)
class _Chunk:
    """Rows to send in order (a band section's first transmission or a STATUS's resends
    for it), then that section's END_MARKs."""
    rows: np.ndarray
    section: int
    pos: int = 0                  # rows already sent


class _IterationTransfer:
    """One iteration on the sender side: every tensor's datagrams as rows of one array
    (in send order), sent in paced batches as a queue of band-section chunks, each
    followed by its END_MARKs; a STATUS's resends go to the front of the queue; END when
    the queue runs dry."""

    def __init__(self, sender: DlcpSender, tensors, flats, stage, num_layers, iteration, p):
        s = self.s = sender
        self.key = tensors[0].tensor_id
        self.tensors = tensors
        self.counts = [segment_count(f.size, s.vps) for f in flats]
        self.base = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        rows, lengths, tos, self.position = [], [], [], []
        for t, flat, n in zip(tensors, flats, self.counts):
            order = send_order(n, s.seed, t.tensor_id, iteration, s.order)
            rows.append(encode_segments(t.tensor_id, flat, s.vps)[order])
            lengths.append((DATA_HEADER_LEN + 4 * segment_bounds(flat.size, s.vps)[:, 1])[order])
            tos.append(s.marks(flat, t.layer, num_layers, n)[order])
            position = np.empty(n, np.int64)          # segment -> its row within the tensor
            position[order] = np.arange(n)
            self.position.append(position)
        self.packets = PacketRows(np.concatenate(rows), np.concatenate(lengths), np.concatenate(tos))
        self.first_tos = self.packets.tos.copy()
        self.row_sends = np.zeros(len(self.packets.rows), np.int64)
        self.row_last_seq = np.full(len(self.packets.rows), -1, np.int64)
        self.queued = np.ones(len(self.packets.rows), bool)    # waiting in self.queue
        self.section_of, self.sections = band_sections(
            [self.packets.tos[lo:hi] for lo, hi in zip(self.base[:-1], self.base[1:])])
        self.row_wire_bits = (self.packets.lengths + WIRE_OVERHEAD) * 8
        self.announce = announce_body(self.key, [
            TensorAnnouncement(t.tensor_id, f.size, n, s.vps, p, STAGES.index(stage))
            for t, f, n in zip(tensors, flats, self.counts)])
        self.need = [fin_threshold(n, p) for n in self.counts]
        self.first_sent = np.zeros(len(tensors))
        self.done = False
        self.queue: deque[_Chunk] = deque()
        self.last_marks: dict[int, PacketRows] = {}    # section -> its newest END_MARK batch
        self.received: dict[int, int] = {}
        self.seq = 0
        self.stops = 0
        self.retx_lists: dict[int, list] = {t.tensor_id: [] for t in tensors}
        self.sent_bits_window = 0
        self.window_start = 0.0
        self.next_t = 0.0

    def run(self) -> list[SendStats]:
        s = self.s
        t0 = time.monotonic()
        self.deadline = t0 + s.timeout_s
        self.announced = s.start_delay_s <= 0
        if self.announced:
            self._control(MSG_ANNOUNCE, self.announce)      # zero-RTT: data follows at once
        self.window_start = self.next_t = t0
        self.queue.extend(_Chunk(np.arange(self.base[first], self.base[first + count]), k)
                          for k, (first, count) in enumerate(self.sections))
        while True:
            self._send_queue(t0)
            if self.done:
                break
            if s.recovery == "timer":
                self._wait(time.monotonic() + s.rto_s)     # baseline: retransmit on timeout
                if self.done:
                    break
            # Out of data (every band's STATUS may already have come and been served):
            # END lets the receiver ask for whatever no band marker has covered.
            if s.recovery == "dlcp":
                self._repeat_end_marks()
            self.stops += 1
            self._control(MSG_END, END_BODY.pack(self.key, self.seq))
            self._wait(self.deadline, until_status=True)
            if self.done:
                break
        elapsed = time.monotonic() - t0
        return [self._stats(k, elapsed) for k in range(len(self.tensors))]

    def _stats(self, k: int, elapsed: float) -> SendStats:
        lo, hi = self.base[k], self.base[k + 1]
        pos = self.position[k]
        sends = self.row_sends[lo:hi][pos]
        total = int(sends.sum())
        rc = self.s.rc
        tid = self.tensors[k].tensor_id
        return SendStats(tid, self.counts[k], float(self.first_sent[k]), elapsed, total,
                         total - int((sends > 0).sum()), self.stops, len(self.retx_lists[tid]),
                         self.received.get(tid, 0), rc.halvings if rc else 0,
                         rc.rate_bps if rc else 0.0, self.first_tos[lo:hi][pos], sends,
                         self.retx_lists[tid], self.row_last_seq[lo:hi][pos])

    def _queue_retransmissions(self, entries: dict) -> None:
        """The rows a STATUS asked for, marked RETX (and ECT: asked for to meet the bound),
        queued ahead of everything not sent yet, one chunk per band section: they leave
        right after this STATUS, each section's followed by its END_MARK."""
        index = {t.tensor_id: k for k, t in enumerate(self.tensors)}
        by_section: dict[int, list] = {}
        for tid, (_, missing) in entries.items():
            if tid not in index or not len(missing):
                continue
            k = index[tid]
            missing = missing[missing < self.counts[k]]
            self.retx_lists[tid].append(missing.tolist())
            at = self.base[k] + np.sort(self.position[k][missing])   # in the round's send order
            if self.s.retx_extra is not None:
                # Only what the bound needs, plus a margin for a resend lost again.
                deficit = self.need[k] - self.received.get(tid, 0)
                at = at[:max(1, deficit + math.ceil(self.s.retx_extra * deficit))]
            by_section.setdefault(int(self.section_of[k]), []).append(at[~self.queued[at]])
        chunks = [_Chunk(np.concatenate(parts), sec) for sec, parts in sorted(by_section.items())]
        chunks = [c for c in chunks if len(c.rows)]
        if not chunks:
            return
        for c in chunks:
            self.queued[c.rows] = True
            self.packets.rows[c.rows, 14] = FLAG_RETX
            if self.s.retx_important:
                self.packets.tos[c.rows] = (self.packets.tos[c.rows] & 0xFC) | ECT0
        self.queue.extendleft(reversed(chunks))
        if self.s.rc is not None and self.s.reset_on_retx:
            self.s.rc.on_retransmission()

    def _control(self, msg_type: int, body: bytes) -> None:
        ctrl = self.s.ctrl
        ctrl.settimeout(10.0)
        try:
            ctrl.sendall(frame(msg_type, body))
        finally:
            ctrl.setblocking(False)

    def _send_queue(self, t0: float) -> None:
        """Send the queued chunks front first, a batch per sendmmsg, paced at the
        controller's rate; a STATUS read in between puts its resends at the front. A
        finished chunk is followed by its section's END_MARKs."""
        s = self.s
        while self.queue:
            self._poll()
            if self.done:
                return
            if not self.announced and time.monotonic() - t0 >= s.start_delay_s:
                self._control(MSG_ANNOUNCE, self.announce)   # test hook: ANNOUNCE after data
                self.announced = True
            chunk = self.queue[0]
            k = self._batch_size(chunk.rows[chunk.pos:chunk.pos + BATCH_MAX])
            if k == 0 or self.queue[0] is not chunk:
                continue
            batch = chunk.rows[chunk.pos:chunk.pos + k]
            seq = np.arange(self.seq, self.seq + k, dtype=np.uint64).astype(">u4")
            self.packets.rows[batch, 10:14] = seq.view(np.uint8).reshape(k, 4)
            self.io_send(batch)
            chunk.pos += k
            if chunk.pos == len(chunk.rows):
                self.queue.popleft()
                if s.recovery == "dlcp":
                    self._send_end_marks(chunk)
        if not self.announced:
            self._control(MSG_ANNOUNCE, self.announce)
            self.announced = True

    def io_send(self, batch: np.ndarray) -> None:
        self.s.io.send(self.packets, batch)
        new = self.row_sends[batch] == 0
        self.row_sends[batch] += 1
        self.row_last_seq[batch] = np.arange(self.seq, self.seq + len(batch))
        self.queued[batch] = False
        self.seq += len(batch)
        if new.any():
            tensor = np.searchsorted(self.base, batch[new], side="right") - 1
            fresh = self.first_sent[tensor] == 0
            self.first_sent[tensor[fresh]] = time.monotonic()
        self.sent_bits_window += int(self.row_wire_bits[batch].sum())

    def _batch_size(self, candidates: np.ndarray) -> int:
        """How many of the candidate rows may leave now (token bucket at the controller's
        rate, 0.5 ms of slack); when none may, wait for the first one (reading control)."""
        rc = self.s.rc
        if rc is None:
            return len(candidates)
        now = time.monotonic()
        self.next_t = max(self.next_t, now - self.s.pace_burst_s)
        start = self.next_t + np.concatenate(
            [[0.0], np.cumsum(self.row_wire_bits[candidates[:-1]])]) / rc.rate_bps
        k = int(np.searchsorted(start, now + 0.0005, side="right"))
        if k == 0:
            self._poll(start[0] - now)
            return 0
        self.next_t = start[k - 1] + self.row_wire_bits[candidates[k - 1]] / rc.rate_bps
        return k

    def _send_end_marks(self, chunk: "_Chunk") -> None:
        """An empty END_MARK behind the chunk's data in every band it used (ECT, the same
        FIFO as that data): offset and length name the section's tensors (first index,
        count), seq is the datagrams sent so far, reserved the number of markers."""
        bands = np.unique(self.packets.tos[chunk.rows] & 0xFC)
        first, count = self.sections[chunk.section]
        header = DATA_HEADER.pack(self.key, first, count, self.seq, FLAG_END_MARK, len(bands))
        rows = np.tile(np.frombuffer(header, np.uint8), (len(bands), 1))
        marks = PacketRows(rows, np.full(len(bands), DATA_HEADER_LEN), bands | ECT0)
        self.s.io.send(marks, np.arange(len(bands)))
        self.last_marks[chunk.section] = marks

    def _repeat_end_marks(self) -> None:
        """Every section's newest marker batch once more, behind everything sent: a batch
        lost to a full buffer then still brings its section's STATUS when the band has
        drained (a batch already answered is recognised by its seq and ignored)."""
        for marks in self.last_marks.values():
            self.s.io.send(marks, np.arange(len(marks.rows)))

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
            raise DlcpError(f"iteration {self.key}: control connection closed by receiver")
        for msg_type, body in self.s.reader.feed(data):
            self._on_control(msg_type, body)

    def _on_control(self, msg_type: int, body: bytes) -> None:
        key = ID_BODY.unpack_from(body)[0]
        if key != self.key:
            return          # a stale message of an earlier iteration (e.g. a late rate report)
        if msg_type == MSG_STATUS:
            _, done, entries = parse_status(body)
            self.received.update({tid: got for tid, (got, _) in entries.items()})
            if done:
                self.done = True
            else:
                self._queue_retransmissions(entries)
        elif msg_type == MSG_RATE:
            self._on_rate(*RATE_BODY.unpack(body)[1:])
        elif msg_type == MSG_ERROR:
            raise DlcpError(f"receiver refused iteration {key}: {body[4:].decode(errors='replace')}")

    def _on_rate(self, recv_bps: float, _window: float, ce_fraction: float) -> None:
        now = time.monotonic()
        elapsed = now - self.window_start
        rc = self.s.rc
        if rc is None or not self.s.rate_control or elapsed <= 0:
            return
        send_bps = self.sent_bits_window / elapsed
        self.sent_bits_window, self.window_start = 0, now
        rc.on_report(send_bps, recv_bps, ce_fraction)
        # (time, send, receive, CE share, new rate): the controller's trace, for evaluations
        self.s.rate_log.append((now, send_bps, recv_bps, ce_fraction, rc.rate_bps))

    def _wait(self, until: float, until_status: bool = False) -> None:
        """Process control messages until STATUS (done, or resends queued) or the time `until`."""
        while not self.done and not (until_status and self.queue):
            left = until - time.monotonic()
            if left <= 0:
                if until_status:
                    raise TimeoutError(f"iteration {self.key}: no STATUS within "
                                       f"{self.s.timeout_s} s of ANNOUNCE")
                return
            self._poll(min(left, 0.05))
