"""Worker transport: one worker's side of protocol v2 over a UDP socket.

A worker hands `AggregatorTransport.allreduce` the packed 4-bit indices of one tensor and
gets back the 8-bit lane sums of every worker's table values, plus the contributor count
of each packet. The aggregator is reached by address: the reference UDP service, the DPDK
switch, BMv2 or Tofino all look the same from here (docs/protocol.md).

How a tensor moves (docs/protocol.md §4.4):
* chunk c (values [c*vpp, (c+1)*vpp)) goes to slot c mod pool; the slot's round counter
  is kept across calls, +1 per use, identically on every worker (all workers call with the
  same tensor sizes in the same order, which the allreduce layer checks);
* a window: chunk c + pool is sent only once the result of chunk c is in;
* a chunk whose result is late is retransmitted with flag RETX after a timeout that follows
  the measured round trip (Jacobson/Karels srtt/rttvar, Karn's rule: no RTT sample from a
  retransmitted chunk, exponential backoff), bounded by rto_min/rto_max, once there is
  evidence of a loss: a chunk sent after it has its result, or nothing completed for an
  RTO (a stall; before the stream's first result only the oldest late chunk goes, the
  next stall with its backed-off timer, since there a stall is mostly a peer that has not
  sent yet; _Exchange.expired);
* duplicate, reordered and re-served results are accepted once; results of other jobs,
  tensors or rounds are ignored and counted;
* a STRAGGLER notice means the slot moved past this worker's round: by default a clear
  error (a synchronous job never sees one), or with on_straggler="skip" the chunk is given
  up (count 0, the caller falls back to its own values there);
* results are scattered in place into one uint8 array (host.packets.scatter_payloads).

A tensor can also be streamed (`open_stream`): its packed indices are submitted range by
range while earlier ranges are already on the wire, and the caller pumps the exchange
between its own work and reads each range's sums as soon as they are in (the pipelined
THC allreduce, host.allreduce). `allreduce` is a stream with one submission. When a
stream is finished is one predicate (`TensorStream.finish(until=...)`): all chunks by
default; a bounded-loss rule would finish at a fraction of them and give the rest up.

Datagrams go through host.datagram (sendmmsg/recvmmsg, UDP GSO on request, a
send/recv_into loop elsewhere); all header work is vectorized (host.packets). By default
the exchange loop itself (window, sends, receives, timers, scatter) runs in C, entered
once per stream operation without the GIL (host.native, `native=`): the same datagrams
and results; what it hands back to Python is listed in host/native/__init__.py.
"""
from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dataplane.config import CONTROL_DSCP, DEFAULT_VALUES_PER_PACKET
from host import native as native_datapath
from host.dlcp.marking import ECN_CE
from host.datagram import (SOCKET_BUFFER_BYTES, DatagramSocket, PacketRows,  # noqa: F401
                           gso_available, mmsg_available)
from host.packets import (FLAG_RETX, HEADER_DTYPE, HEADER_LEN, TYPE_FLUSH, TYPE_RESULT,
                          TYPE_STRAGGLER, VERSION, decode_headers, encode_data, encode_headers,
                          header_types, scatter_payloads)

MAX_VALUES = 8192              # the reference aggregator's and DPDK switch's MAX_VALUES
IP_UDP_HEADERS = 28            # IPv4 + UDP header bytes in front of the AGG header
PROBE_NONE = -1                # no probe answer (yet) for a chunk
PROBE_TENSOR = 0xFFFFFFFF      # tensor id of AggregatorTransport.probe's DATA
PROBE_WAIT = 0.25              # seconds a probe waits for the aggregator's answer
# FLUSH travels in DLCP's control class (docs/protocol.md §4.6): served before every data
# band, so a flush sent before a stream's DATA is not overtaken by it in a queue.
FLUSH_TOS = CONTROL_DSCP << 2
EVERY_ROUND = -1               # a background waiter's own predicate: look after every round
RTT_SAMPLES_KEPT = 4096        # TransportStats keeps the most recent RTT samples
RESULT_MODERATION_S = 250e-6   # the native loop's pause for RESULTs to gather (docs/perf.md)
CWND_MIN = 2.0                 # the CE window never closes below two chunks
MAX_BACKOFF = 64               # a chunk's timer doubles per resend up to this (datapath.c too)
# Socket errors that say the aggregator cannot be reached: nothing listens there (an ICMP
# port unreachable), or the way there is down (the link, the route, the host).
UNREACHABLE_ERRNOS = (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH,
                      errno.ENETDOWN, errno.EHOSTDOWN)


class TransportError(RuntimeError):
    """The aggregator exchange could not complete; the message says why and what to check."""


class AggregatorUnreachable(TransportError):
    pass


class AggregatorTimeout(TransportError):
    """No progress within the configured timeout (a worker died or never joined)."""


class StragglerNotice(TransportError):
    """The aggregator says this worker is behind the slot's round."""


# --------------------------------------------------------------------------- policy

def default_policy(*, layer, num_layers, values, values_per_packet, num_packets):
    """One band for everything, not ECN-capable: (DSCP 0, ECN 0) on every packet.

    The DLCP policy (host/dlcp/) replaces it: front layers in higher bands, important
    packets ECT. Signature: policy(*, layer, num_layers, values, values_per_packet,
    num_packets) -> (dscp uint8[num_packets], ecn uint8[num_packets]).
    """
    return (np.zeros(num_packets, dtype=np.uint8), np.zeros(num_packets, dtype=np.uint8))


def constant_policy(dscp: int = 0, ecn: int = 0):
    """A policy that puts every packet in one DSCP with one ECN codepoint."""
    if not 0 <= dscp < 64 or not 0 <= ecn < 4:
        raise ValueError(f"dscp must be in 0..63 and ecn in 0..3, got {dscp}, {ecn}")

    def policy(*, layer, num_layers, values, values_per_packet, num_packets):
        return (np.full(num_packets, dscp, dtype=np.uint8),
                np.full(num_packets, ecn, dtype=np.uint8))
    return policy


# --------------------------------------------------------------------------- RTT

@dataclass
class RetransmitTimer:
    """Jacobson/Karels retransmission timeout: rto = srtt + 4*rttvar, clamped."""
    rto_init: float = 0.2
    rto_min: float = 0.005
    rto_max: float = 2.0
    srtt: float | None = None
    rttvar: float = 0.0

    def __post_init__(self):
        if not 0 < self.rto_min <= self.rto_init <= self.rto_max:
            raise ValueError("need 0 < rto_min <= rto_init <= rto_max, got "
                             f"{self.rto_min}, {self.rto_init}, {self.rto_max}")

    @property
    def rto(self) -> float:
        if self.srtt is None:
            return self.rto_init
        return min(self.rto_max, max(self.rto_min, self.srtt + 4.0 * self.rttvar))

    def sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2.0
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt


# --------------------------------------------------------------------------- stats

@dataclass
class TransportStats:
    packets_sent: int = 0
    bytes_sent: int = 0            # AGG header + payload (add 28 B IPv4/UDP per packet on the wire)
    retransmissions: int = 0
    packets_received: int = 0
    bytes_received: int = 0
    results_accepted: int = 0
    duplicates: int = 0            # a result for a chunk already done
    ignored: int = 0               # other job/tensor/round, or malformed
    straggler_notices: int = 0
    send_calls: int = 0            # send syscalls (sendmmsg, or send/sendmsg per datagram)
    send_messages: int = 0         # messages those calls carried (one per GSO run)
    recv_calls: int = 0            # receive syscalls (recvmmsg, or recv_into per datagram)
    ce_results: int = 0            # accepted RESULTs that came back CE-marked
    window_cuts: int = 0           # times the CE window was halved
    # The most recent RTT samples only: a long run takes several per call, and a list of all
    # of them grew a worker by about 80 MB an hour (host.experiments.soak).
    rtt_samples: deque = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES_KEPT))

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("rtt_samples")
        return d


@dataclass
class AllreduceResult:
    sums: np.ndarray               # uint8[num_values] lane sums
    counts: np.ndarray             # int[n_chunks] contributors per chunk (0 = given up)
    contributors: np.ndarray       # uint32[n_chunks] bitmaps
    values_per_packet: int

    def counts_per_value(self, length: int | None = None) -> np.ndarray | int:
        """The contributor count of each value (a scalar when all chunks agree)."""
        if len(self.counts) and np.all(self.counts == self.counts[0]):
            return int(self.counts[0])
        per_value = np.repeat(self.counts, self.values_per_packet)[:len(self.sums)]
        if length is not None and length > len(per_value):
            per_value = np.concatenate([per_value, np.full(length - len(per_value),
                                                           per_value[-1] if len(per_value) else 0)])
        return per_value


# --------------------------------------------------------------------------- transport

def parse_address(addr) -> tuple[str, int]:
    """'host:port' or (host, port) -> (ip, port), refusing anything else clearly."""
    if isinstance(addr, str):
        host, sep, port = addr.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"aggregator address {addr!r} is not HOST:PORT")
        addr = (host, int(port))
    host, port = addr
    if not 0 < int(port) < 65536:
        raise ValueError(f"aggregator port {port} must be in 1..65535")
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        raise AggregatorUnreachable(f"cannot resolve aggregator host {host!r}: {exc}") from exc
    return ip, int(port)


class AggregatorTransport:
    """A worker's UDP endpoint to one aggregator for one job.

    job, worker, expected: header fields (expected = bitmap of the job's workers);
    pool_size: the job's slot pool (as installed on the aggregator); values_per_packet:
    the job's values_per_packet as installed (default: the job description's default),
    at most the aggregator's MAX_VALUES, and its datagrams must fit the path MTU;
    min_count: partial aggregation threshold carried
    in the headers (0 = all expected); timeout: seconds without any progress before
    AggregatorTimeout; local: (ip, port) to bind (the aggregator's membership table names
    it; default any address, an ephemeral port); policy: the DSCP/ECN hook (see
    default_policy); on_straggler: "raise" or "skip" (see the module docstring);
    batched / gso: force the datagram path's sendmmsg/recvmmsg and UDP GSO on or off
    (default: batched where this system has it, GSO only with THC_GSO=1; host.datagram);
    native: the exchange loop in C (host.native; True: required, False: the Python path,
    None: native where it is built and loads, else the Python path with a warning; either
    way only while batched and without GSO); moderation: seconds the native loop lets
    RESULTs gather before taking them in while at least half the window is in flight
    (one wake-up for several RESULTs instead of one each), at most a quarter of the
    smoothed RTT so the path stays busy; 0 = wake for every one; ce_window: react to
    RESULTs that come back CE-marked (a DLCP queue marked the contribution that completed
    them, docs/protocol.md §5, §6) by halving the chunks this worker keeps in flight, at
    most once per smoothed RTT, and open it again by `window_increase` chunks per window
    of unmarked RESULTs (default pool_size / 8), up to the pool. Without marks (no DLCP
    queue, or Not-ECT packets) the window stays the pool.
    """

    def __init__(self, aggregator, *, job: int, worker: int, expected: int, pool_size: int,
                 values_per_packet: int = DEFAULT_VALUES_PER_PACKET, min_count: int = 0,
                 timeout: float = 30.0, local=("0.0.0.0", 0), policy=default_policy,
                 timer: RetransmitTimer | None = None, on_straggler: str = "raise",
                 sock: socket.socket | None = None, batched: bool | None = None,
                 gso: bool | None = None, native: bool | None = None,
                 moderation: float = RESULT_MODERATION_S, ce_window: bool = True,
                 window_increase: float | None = None):
        if not 1 <= values_per_packet <= MAX_VALUES:
            raise ValueError(f"values_per_packet {values_per_packet} must be in 1..{MAX_VALUES} "
                             "(the aggregator's MAX_VALUES)")
        if not 1 <= pool_size <= 65536:
            raise ValueError(f"pool_size {pool_size} must be in 1..65536")
        if not 0 <= worker < 32 or not (expected >> worker) & 1:
            raise ValueError(f"worker {worker} must be in 0..31 and in the expected bitmap "
                             f"{expected:#x}")
        if not 0 <= min_count <= bin(expected).count("1"):
            # The aggregator would drop every packet as drop_unsatisfiable (protocol §4.1).
            raise ValueError(f"min_count {min_count} can never be reached: the expected "
                             f"bitmap {expected:#x} names {bin(expected).count('1')} workers; "
                             "lower min_count (0 = wait for all expected workers)")
        if on_straggler not in ("raise", "skip"):
            raise ValueError("on_straggler must be 'raise' or 'skip'")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if not 0 <= moderation < 0.1:
            raise ValueError(f"moderation {moderation} s must be in [0, 0.1): a pause that long "
                             "would hold the window shut")
        if window_increase is not None and not window_increase > 0:
            raise ValueError(f"window_increase {window_increase} must be > 0 chunks per window "
                             "(None: pool_size / 8)")
        if native and not native_datapath.available():
            raise TransportError(f"native=True, but the native data path is unavailable: "
                                 f"{native_datapath.reason()}; or pass native=None/False")
        if native is None and not native_datapath.available():
            native_datapath.warn_once()
        self.native = native_datapath.available() if native is None else bool(native)
        self.aggregator = parse_address(aggregator)
        self.job, self.worker, self.expected = job, worker, expected
        self.pool_size, self.vpp, self.min_count = pool_size, values_per_packet, min_count
        self.timeout, self.policy, self.on_straggler = timeout, policy, on_straggler
        self.moderation = moderation
        self.ce_window = bool(ce_window)
        self.cwnd = float(pool_size)           # chunks in flight the CE window allows
        self.cwnd_hold_until = 0.0             # no second halving before (monotonic s)
        self.window_increase = (max(1.0, pool_size / 8) if window_increase is None
                                else float(window_increase))
        self.timer = timer or RetransmitTimer()
        # One RTT estimate per layer (a DDP bucket, a DLCP band): under strict priority a
        # back band's packets wait behind the front's, and one shared estimate, kept short
        # by the front band, timed them out while they were only queued (docs/dlcp.md).
        self._layer_timers = {0: self.timer}
        self.stats = TransportStats()
        self.slot_rounds = np.zeros(pool_size, dtype=np.int64)   # next round of each slot
        self.sock = sock or socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if sock is None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            try:
                self.sock.bind(local)
            except OSError as exc:
                self.sock.close()
                raise TransportError(
                    f"worker {worker}: cannot bind its UDP address {local[0]}:{local[1]} "
                    f"({exc.strerror}): another process holds it, or the address is not on "
                    "this host; choose another worker port (base)") from exc
        # connect(): only the aggregator's packets reach us, and an ICMP port-unreachable
        # surfaces as ECONNREFUSED (a clear "nothing listens there") instead of silence.
        self.sock.connect(self.aggregator)
        self._heard_from_aggregator = False
        self._stream = None              # the TensorStream in flight (one at a time)
        self.probes = self.probes_answered = 0       # probe(): sent, answered
        rx_rows = 2 * pool_size if pool_size < 512 else 1024
        self.io = DatagramSocket(self.sock, rx_rows=rx_rows,
                                 rx_width=HEADER_LEN + values_per_packet,
                                 batched=batched, gso=gso, rx_tos=self.ce_window)
        self._check_mtu()

    def _check_mtu(self) -> None:
        """Refuse packets the path cannot carry whole (the data planes take no fragments)."""
        mtu = self.io.path_mtu()
        largest = IP_UDP_HEADERS + HEADER_LEN + self.vpp       # a RESULT: 8 bits per value
        if mtu is not None and largest > mtu:
            fits = mtu - IP_UDP_HEADERS - HEADER_LEN
            host, _ = self.aggregator
            self.sock.close()
            raise ValueError(
                f"values_per_packet {self.vpp} makes {largest}-byte RESULT datagrams, but the "
                f"path MTU to the aggregator {host} is {mtu}: use values_per_packet <= {fits}, "
                "or jumbo frames on this path (ip link set DEV mtu 9000)")

    @property
    def _mmsg(self) -> bool:
        """Whether datagrams move in batches (sendmmsg/recvmmsg); False: one per syscall."""
        return self.io.batched

    @_mmsg.setter
    def _mmsg(self, value: bool) -> None:
        self.io.batched = bool(value)
        self.io.gso = self.io.gso and self.io.batched

    @property
    def local_address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- control

    def flush(self, repeats: int = 3) -> None:
        """FLUSH every slot of the pool (both copies reset to round 0) and restart rounds.

        Call at job start on every worker, then barrier before the first allreduce, so no
        flush lands after a contribution. There is no reply; the batch is sent `repeats`
        times so a lossy path loses a flush only with negligible probability.
        """
        hdr = np.zeros(self.pool_size, dtype=HEADER_DTYPE)
        hdr["ver_type"] = (VERSION << 4) | TYPE_FLUSH
        hdr["job"] = self.job
        hdr["slot"] = np.arange(self.pool_size)
        hdr["worker"] = self.worker
        hdr["expected"] = self.expected
        packets = PacketRows(np.ascontiguousarray(encode_headers(hdr)),
                             np.full(self.pool_size, HEADER_LEN),
                             np.full(self.pool_size, FLUSH_TOS))
        for _ in range(repeats):
            self._send(packets, np.arange(self.pool_size))
        self.slot_rounds[:] = 0

    def probe(self, wait: float = PROBE_WAIT) -> bool:
        """Whether the aggregator answers now (call it with no stream in flight).

        FLUSH this worker's slot (worker mod pool), then send there a one-value DATA of
        round 0 that only this worker is expected in, of tensor PROBE_TENSOR: a live
        aggregator completes it at once and multicasts the RESULT (docs/protocol.md §4.2,
        §5.1; the other members' streams ignore that tensor). Answered: a RESULT or
        STRAGGLER of PROBE_TENSOR (this worker's probe or another's: any proves it alive)
        within `wait` seconds. The slot is left used: flush the job's slots before the
        next stream. Not counted in `stats` (bytes through the aggregator are gradients)."""
        self.probes += 1
        self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)   # an old ICMP error
        slot = self.worker % self.pool_size
        flush = np.zeros(1, dtype=HEADER_DTYPE)
        flush["ver_type"] = (VERSION << 4) | TYPE_FLUSH
        flush["job"], flush["slot"], flush["worker"] = self.job, slot, self.worker
        data, lengths = encode_data(np.zeros(1, np.uint8), 1, 1, job=self.job,
                                    worker=self.worker, tensor=PROBE_TENSOR, slots=slot,
                                    rounds=0, expected=1 << self.worker,
                                    first_offset=self.probes)
        rows = np.zeros((2, data.shape[1]), np.uint8)
        rows[0, :HEADER_LEN] = encode_headers(flush)[0]
        rows[1] = data[0]
        try:
            self.io.send(PacketRows(rows, np.array([HEADER_LEN, lengths[0]]),
                                    np.array([FLUSH_TOS, 0])), [0, 1])
            deadline = time.monotonic() + wait
            while self.io.wait_readable(deadline - time.monotonic()):
                n = self.io.receive()
                ok = self.io.rx_len[:n] >= HEADER_LEN
                hdr = decode_headers(self.io.rx[:n][ok], self.io.rx_len[:n][ok])
                types = header_types(hdr)
                if ((hdr["job"] == self.job) & (hdr["tensor"] == PROBE_TENSOR)
                        & (hdr["offset"] == self.probes)
                        & ((types == TYPE_RESULT) | (types == TYPE_STRAGGLER))).any():
                    self.probes_answered += 1
                    return True
        except OSError as exc:             # nothing listens there, or no way there
            if exc.errno not in UNREACHABLE_ERRNOS:
                raise
        return False

    # ----------------------------------------------------------------- allreduce

    def allreduce(self, packed: np.ndarray, num_values: int, tensor: int, *, values=None,
                  layer: int = 0, num_layers: int = 1) -> AllreduceResult:
        """Send the packed indices of one tensor; return the lane sums of all workers.

        packed: uint8[ceil(num_values/2)], two indices per byte (even value high nibble);
        tensor: tensor id carried in the headers; values: the rotated pre-quantization
        floats, handed to the DSCP/ECN policy (None: the policy sees None).
        """
        stream = self.open_stream(num_values, tensor, layer=layer, num_layers=num_layers)
        stream.submit(packed, num_values, values=values)
        return stream.finish()

    def open_stream(self, num_values: int, tensor: int, *, layer: int = 0,
                    num_layers: int = 1, background: bool = False) -> "TensorStream":
        """Start the exchange of one tensor whose packed indices come range by range.

        background=True: an I/O thread of the stream's own keeps the window full and takes
        in results while the caller does other work (codec work that releases the GIL);
        the caller only submits and waits. Else the caller drives it (pump, wait_values)."""
        if self._stream is not None and not self._stream.closed:
            raise TransportError(f"worker {self.worker}: tensor {self._stream.ex.tensor} is "
                                 "still in flight; finish its stream before the next one")
        self.timer = self._layer_timer(layer)
        self._stream = TensorStream(self, num_values, tensor, layer, num_layers, background)
        return self._stream

    def _layer_timer(self, layer: int) -> RetransmitTimer:
        """The retransmission timer of a layer's streams (a fresh one, with the first
        timer's bounds, for a layer not seen before)."""
        timer = self._layer_timers.get(layer)
        if timer is None:
            first = self._layer_timers[0]
            timer = self._layer_timers[layer] = RetransmitTimer(
                rto_init=first.rto_init, rto_min=first.rto_min, rto_max=first.rto_max)
        return timer

    # ----------------------------------------------------------------- the exchange loop

    def _drive(self, stream: "TensorStream", until, block: bool = True,
               target: int | None = None, at_least: int | None = None) -> None:
        """Send what the window allows, retransmit what is late, apply what arrived, until
        until() holds (block=False: one non-blocking round). target: until() means
        "chunks [0, target) are done", which the native loop checks itself (whole in C).
        at_least: until() cannot hold before that many chunks are done, so the native loop
        runs until then without Python between arrivals (a bounded-loss rule)."""
        ex = stream.ex
        if block and target is not None and self._native_for(stream):
            self._run_native(stream, block=True, target=target)
            return
        if block and self._native_hint(stream, at_least):
            self._run_native(stream, block=True, target=ex.available, at_least=at_least)
        while True:
            self._round(stream)
            if not block or until():
                return
            if ex.waiting_for_input():
                raise self._never_submitted(ex)
            self.io.wait_readable(self._wait_time(stream))
            self._check_timeout(stream, until)

    def _never_submitted(self, ex: "_Exchange") -> TransportError:
        return TransportError(f"worker {self.worker}: tensor {ex.tensor} waits for values "
                              "that were never submitted")

    def _native_for(self, stream: "TensorStream") -> bool:
        """Whether this stream's rounds run in C now (batched, no GSO: host.native)."""
        return stream.native is not None and self.io.batched and not self.io.gso

    def _native_hint(self, stream: "TensorStream", at_least: int | None) -> bool:
        """Whether a wait for at_least chunks can run in C first: every value submitted (so
        the C loop cannot stop for input) and fewer than at_least chunks done."""
        ex = stream.ex
        return (at_least is not None and self._native_for(stream)
                and ex.available == ex.n_chunks and ex._n_done < at_least)

    def _run_native(self, stream: "TensorStream", *, block: bool, target: int,
                    at_least: int | None = None) -> None:
        """Rounds in C until chunks [0, target) are done, or at_least chunks (block=False:
        one round); what the C loop hands back is finished here, as the Python path does."""
        while not self._native_outcome(
                stream, self._native_call(stream, block, target, at_least), target, at_least):
            pass

    def _native_outcome(self, stream: "TensorStream", status: int, target: int,
                        at_least: int | None = None) -> bool:
        """What a dp_run status asks of Python: True when the call's goal was reached (or
        it was woken), False when a STRAGGLER notice was applied or the stream is slow but
        within its timeout (call again); the errors of the Python path otherwise."""
        ex = stream.ex
        if status in (native_datapath.DONE, native_datapath.WOKEN, native_datapath.DEADLINE):
            return True
        if status == native_datapath.NOTICE:
            # A STRAGGLER notice: it and the datagrams after it go through _apply.
            state = stream.native.state
            if self._apply_received(ex, state.rx_next, state.rx_count):
                stream.last_progress = time.monotonic()
            return False
        if status == native_datapath.WAITING_INPUT:
            raise self._never_submitted(ex)
        if status == native_datapath.TIMEOUT:
            self._check_timeout(stream, lambda: ex.done_prefix() >= target or (
                at_least is not None and ex._n_done >= at_least))
            return False
        err = stream.native.state.err
        exc = OSError(err, os.strerror(err))     # ECONNREFUSED: ConnectionRefusedError
        if err in UNREACHABLE_ERRNOS:
            raise self._unreachable(exc) from exc
        raise exc

    def _native_call(self, stream: "TensorStream", block: bool, target: int,
                     at_least: int | None = None) -> int:
        """One dp_run call: the scalars of the stream, the timer and the socket go in, and
        come back with this call's counters."""
        self._native_enter(stream)
        try:
            return stream.native.run(block, target, at_least)
        finally:
            self._native_leave(stream)

    def _native_enter(self, stream: "TensorStream") -> None:
        """The scalars of the stream, the timer and the socket into the C state."""
        ex, timer, io, window = stream.ex, self.timer, self.io, stream.native
        s = window.state
        s.available, s.next_unsent, s.n_done = ex.available, ex._next_unsent, ex._n_done
        s.done_prefix, s.ex_last_progress = ex._done_prefix, ex.last_progress
        s.stream_last_progress, s.timeout = stream.last_progress, self.timeout
        s.have_srtt, s.srtt, s.rttvar = timer.srtt is not None, timer.srtt or 0.0, timer.rttvar
        s.rto_init, s.rto_min, s.rto_max = timer.rto_init, timer.rto_min, timer.rto_max
        s.sock_tos, s.heard = io.tos, self._heard_from_aggregator
        s.moderation = self.moderation
        s.until = stream.until
        s.ect_retx = bool(getattr(self.policy, "ect_retransmissions", False))
        s.ce_window, s.cwnd, s.cwnd_increase = self.ce_window, self.cwnd, self.window_increase
        s.cwnd_hold_until = self.cwnd_hold_until
        s.grace_at, s.grace_rtos = stream.grace_at, stream.grace_rtos
        s.stall_all = ex.stall_all

    def _native_leave(self, stream: "TensorStream") -> None:
        """The C state back into the stream, the timer and the statistics. A submission
        made while the call ran (background mode) may have moved last_progress on: the
        later of the two stays."""
        ex, timer, io, window = stream.ex, self.timer, self.io, stream.native
        s = window.state
        ex._next_unsent, ex._n_done, ex._done_prefix = s.next_unsent, s.n_done, s.done_prefix
        ex.last_progress, ex.stall_all = s.ex_last_progress, bool(s.stall_all)
        stream.last_progress = max(stream.last_progress, s.stream_last_progress)
        if s.have_srtt:
            timer.srtt, timer.rttvar = s.srtt, s.rttvar
        io.tos, self._heard_from_aggregator = s.sock_tos, bool(s.heard)
        self.cwnd, self.cwnd_hold_until = s.cwnd, s.cwnd_hold_until
        if s.grace_at == native_datapath.GRACE_STARTED:
            # The C loop started the grace period: its end is the wait's time limit now.
            # (Only then: a call entered before wait_grace armed it knows nothing of it.)
            stream.grace_at, stream.until = -1, min(stream.until, s.until)
        io.rx_truncated += s.rx_truncated
        stats = self.stats
        for name in native_datapath.COUNTERS:
            setattr(stats, name, getattr(stats, name) + getattr(s, name))
        stats.rtt_samples.extend(window.rtt_samples())

    def _round(self, stream: "TensorStream") -> None:
        """One non-blocking round: take in results, send what the window allows, retransmit."""
        if self._native_for(stream):
            self._run_native(stream, block=False, target=0)
            return
        ex = stream.ex
        # The caller may have been busy (codec work): first take in what arrived meanwhile,
        # so the chunks it completed neither count as late nor hold the window.
        if self._receive(ex):
            stream.last_progress = time.monotonic()
        now = time.monotonic()
        # Send what the window allows: chunk c once chunk c - pool is done.
        ready = ex.sendable()[:self._window_room(ex)]
        if len(ready):
            self._send(stream.packets, ready)
            ex.mark_sent(ready, now, self.timer.rto)
        # Retransmit chunks whose timer expired (Karn: they give no RTT sample).
        late = ex.expired(now, self.timer.rto, self.timer.rto_max)
        if len(late):
            stream.rows[late, 1] |= FLAG_RETX          # header byte 1 is `flags`
            if getattr(self.policy, "ect_retransmissions", False):
                # A chunk that was lost once goes out ECT: a DLCP queue marks it instead
                # of dropping it again (a second loss would cost a backed-off timeout).
                tos = stream.packets.tos
                tos[late] = np.where(tos[late] & 3 == 0, tos[late] | 2, tos[late])
            self._send(stream.packets, late)
            ex.mark_retransmitted(late, now, self.timer)
            self.stats.retransmissions += len(late)

    def _wait_time(self, stream: "TensorStream") -> float:
        """How long to wait for results before the next timer is due."""
        now = time.monotonic()
        return max(0.0, min(stream.ex.next_deadline(now, self.timer.rto) - now,
                            stream.last_progress + self.timeout - now, stream.until - now))

    def _check_timeout(self, stream: "TensorStream", until) -> None:
        if time.monotonic() - stream.last_progress > self.timeout and not until():
            ex = stream.ex
            missing = self._probe_missing(ex) if self._heard_from_aggregator else None
            raise AggregatorTimeout(self._timeout_message(ex, missing))

    # ----------------------------------------------------------------- socket I/O

    def _send(self, packets: PacketRows, rows) -> None:
        calls, messages = self.io.send_calls, self.io.send_messages
        try:
            sent = self.io.send(packets, rows)
        except OSError as exc:
            if exc.errno not in UNREACHABLE_ERRNOS:
                raise
            raise self._unreachable(exc) from exc
        finally:
            self.stats.send_calls += self.io.send_calls - calls
            self.stats.send_messages += self.io.send_messages - messages
        self.stats.packets_sent += len(rows)
        self.stats.bytes_sent += sent

    def _unreachable(self, exc) -> AggregatorUnreachable:
        host, port = self.aggregator
        if exc.errno != errno.ECONNREFUSED:
            return AggregatorUnreachable(
                f"aggregator {host}:{port} cannot be reached from worker {self.worker} "
                f"({exc}): is the link or route to it up?")
        return AggregatorUnreachable(
            f"aggregator {host}:{port} refused the packets (ICMP port unreachable: nothing "
            "listens there): start the aggregator, or pass its HOST:PORT as aggregator= "
            f"({exc})")

    def _receive(self, ex: "_Exchange") -> bool:
        """Drain the socket into the rx rows; apply what arrived. True on progress."""
        calls = self.io.recv_calls
        try:
            n = self.io.receive()
        except OSError as exc:
            if exc.errno not in UNREACHABLE_ERRNOS:
                raise
            raise self._unreachable(exc) from exc
        finally:
            self.stats.recv_calls += self.io.recv_calls - calls
        if not n:
            return False
        self._heard_from_aggregator = True
        self.stats.packets_received += n
        self.stats.bytes_received += int(self.io.rx_len[:n].sum())
        return self._apply_received(ex, 0, n)

    def _apply_received(self, ex: "_Exchange", lo: int, n: int) -> bool:
        """Apply the datagrams in receive rows [lo, n). True on progress."""
        rows, lens = self.io.rx[lo:n], self.io.rx_len[lo:n]
        ok = lens >= HEADER_LEN
        self.stats.ignored += int((~ok).sum())
        rows, lens, tos = rows[ok], lens[ok], self.io.rx_tos[lo:n][ok]
        if not len(rows):
            return False
        hdr = decode_headers(rows, lens)
        return self._apply(ex, rows, lens, hdr, tos)

    def _apply(self, ex: "_Exchange", rows, lens, hdr, tos=None) -> bool:
        ptype = header_types(hdr)
        ours = ((hdr["ver_type"] >> 4) == VERSION) & (hdr["job"] == self.job) \
            & (hdr["tensor"] == ex.tensor) & (hdr["offset"] % self.vpp == 0)
        chunk = (hdr["offset"] // self.vpp).astype(np.int64)
        ours &= chunk < ex.n_chunks
        chunk = np.where(ours, chunk, 0)
        ours &= hdr["slot"] == chunk % self.pool_size
        progress = False
        probe_reply = ours & (ptype == TYPE_STRAGGLER) & (hdr["round"] == ex.rounds[chunk])
        if probe_reply.any():
            ex.probed[chunk[probe_reply]] = hdr["contributors"][probe_reply]
        notice = ours & (ptype == TYPE_STRAGGLER) & (hdr["round"] > ex.rounds[chunk])
        if notice.any():
            self.stats.straggler_notices += int(notice.sum())
            progress |= self._straggler(ex, chunk[notice], hdr[notice])
        result = ours & (ptype == TYPE_RESULT) & (hdr["round"] == ex.rounds[chunk]) \
            & (hdr["num_values"] == ex.chunk_values(chunk)) \
            & (lens >= HEADER_LEN + hdr["num_values"].astype(np.int64))
        self.stats.ignored += int((~(result | notice | probe_reply)).sum())
        idx = np.flatnonzero(result)
        if len(idx):
            # Keep one result per chunk, and only for chunks not done yet.
            _, first = np.unique(chunk[idx], return_index=True)
            fresh = idx[first]
            fresh = fresh[~ex.done[chunk[fresh]]]
            self.stats.duplicates += len(idx) - len(fresh)
            if len(fresh):
                scatter_payloads(rows[fresh], lens[fresh], hdr[fresh], ex.sums)
                c = chunk[fresh]
                now = time.monotonic()
                rtt = ex.complete(c, hdr["contributors"][fresh], hdr["count"][fresh], now)
                if rtt is not None:
                    self.timer.sample(rtt)
                    self.stats.rtt_samples.append(rtt)
                self.stats.results_accepted += len(fresh)
                marked = 0 if tos is None else int(np.count_nonzero(tos[fresh] & 3 == ECN_CE))
                self._window_update(len(fresh) - marked, marked, now)
                progress = True
        return progress

    def _window_room(self, ex: "_Exchange") -> int:
        """How many more chunks the CE window lets out (the pool bounds the flight anyway,
        so an open window costs no count); datapath.c's window_room."""
        if not self.ce_window or self.cwnd >= self.pool_size:
            return self.pool_size
        return max(0, int(self.cwnd) - int(np.count_nonzero(ex.sent & ~ex.done)))

    def _window_update(self, clean: int, marked: int, now: float) -> None:
        """The CE response, as datapath.c's window_update: a batch with a CE-marked RESULT
        halves the window, at most once per smoothed RTT (the marks of one queue build-up
        arrive together); unmarked RESULTs open it by window_increase chunks per window of
        them, up to the pool."""
        if not self.ce_window:
            return
        self.stats.ce_results += marked
        if marked:
            if now >= self.cwnd_hold_until:
                self.cwnd = max(CWND_MIN, self.cwnd / 2)
                srtt = self.timer.srtt
                self.cwnd_hold_until = now + (self.timer.rto_init if srtt is None else srtt)
                self.stats.window_cuts += 1
            return
        self.cwnd = min(float(self.pool_size), self.cwnd + clean * self.window_increase / self.cwnd)

    def _straggler(self, ex: "_Exchange", chunks, hdr) -> bool:
        if self.on_straggler == "raise":
            c = int(chunks[0])
            raise StragglerNotice(
                f"worker {self.worker}: the aggregator's slot {int(hdr['slot'][0])} is at round "
                f"{int(hdr['round'][0])} but this worker sent round {int(ex.rounds[c])} "
                f"(tensor {ex.tensor}, chunk {c}): another worker ran ahead of this one. Were "
                "the slots flushed at job start, and do all workers call allreduce with the "
                "same tensors in the same order?")
        fresh = chunks[~ex.done[chunks]]
        ex.give_up(fresh)
        return len(fresh) > 0

    def _probe_missing(self, ex: "_Exchange", max_probes: int = 8) -> list[int] | None:
        """Ask the aggregator which workers a stuck round still lacks.

        A DATA for round r-2 of a slot whose copy (same parity) is at round r is obsolete:
        the aggregator changes nothing and answers a STRAGGLER notice carrying the copy's
        current contributor bitmap (docs/protocol.md §4.2, §5.3). Only for rounds >= 2.
        """
        stuck = np.flatnonzero(~ex.done & ex.sent & (ex.rounds >= 2))[:max_probes]
        if not len(stuck):
            return None
        bufs, lengths = encode_data(np.zeros(len(stuck), np.uint8), len(stuck), 1, job=self.job,
                                    worker=self.worker, tensor=ex.tensor,
                                    slots=stuck % self.pool_size,
                                    rounds=(ex.rounds[stuck] - 2).astype(np.uint32),
                                    expected=self.expected, min_count=self.min_count)
        hdr = decode_headers(bufs, lengths)
        hdr["offset"] = stuck * self.vpp        # so the reply maps back to the chunk
        bufs[:, :HEADER_LEN] = encode_headers(hdr)
        self._send(PacketRows(np.ascontiguousarray(bufs), lengths), np.arange(len(stuck)))
        deadline = time.monotonic() + min(1.0, max(0.05, 4 * self.timer.rto))
        while time.monotonic() < deadline and not (ex.probed[stuck] != PROBE_NONE).any():
            if self.io.wait_readable(deadline - time.monotonic()):
                self._receive(ex)
        answered = ex.probed[stuck][ex.probed[stuck] != PROBE_NONE]
        if not len(answered):
            return None
        have = int(np.bitwise_and.reduce(answered.astype(np.uint64)))
        return [w for w in range(32) if (self.expected >> w) & 1 and not (have >> w) & 1]

    def _timeout_message(self, ex: "_Exchange", missing=None) -> str:
        """What this worker knows: its bound address, the aggregator's, what it sent and
        what came back, the likely cause, and where the aggregator's counters are."""
        waiting = np.flatnonzero(~ex.done)
        host, port = self.aggregator
        slots = np.unique(waiting % ex.pool) if len(waiting) else waiting
        st = self.stats
        head = (f"worker {self.worker} of job {self.job} (bound to {self._bound_address()}): "
                f"no progress for {self.timeout:.1f} s on tensor {ex.tensor}: {len(waiting)} "
                f"of {ex.n_chunks} chunks" + (f" (chunks {waiting[0]}..{waiting[-1]}, slots "
                                              f"{slots[0]}..{slots[-1]} of pool "
                                              f"{self.pool_size})" if len(waiting) else "") +
                f" still wait for their result from aggregator {host}:{port}; this worker sent "
                f"{st.packets_sent} packets ({st.retransmissions} retransmissions, "
                f"{self.vpp} values per packet) and received {st.packets_received} "
                f"({st.results_accepted} results, {st.ignored} ignored, "
                f"{st.straggler_notices} straggler notices)")
        counters = ("; the aggregator's counters say what it dropped and why (drop_not_member: "
                    "this address is not the member's; drop_bad_length: values_per_packet "
                    "above the job's; drop_bad_slot: pool_size above the job's; "
                    "drop_unsatisfiable: more workers expected than the job has): "
                    "svc.counters() of dataplane.udp_service.serve (its CLI prints them at "
                    "exit and every --stats-interval s), or for the DPDK switch `kill -USR1 "
                    "<thc_switch pid>` and read its --stats file")
        if not self._heard_from_aggregator:
            return head + ("; nothing was ever received from it: is the aggregator running and "
                           "reachable, and does its job description make this address a "
                           f"member of job {self.job} with these settings?" + counters)
        seen = int(np.bitwise_or.reduce(ex.contributors[ex.done])) if ex.done.any() else 0
        expected = [w for w in range(32) if (self.expected >> w) & 1]
        if missing:
            return head + (f"; the aggregator still waits for worker(s) {missing} (expected "
                           f"{expected}): they stopped contributing (crashed, killed, hung, "
                           "calling allreduce with a different tensor sequence, or sending "
                           "what the aggregator drops)" + counters)
        return head + (f"; expected workers {expected}; the aggregator answered earlier in "
                       "this job and no answer now says which worker it lacks: it stopped or "
                       "restarted, its link went down, or a worker stopped contributing "
                       "(crashed, killed, calling allreduce with a different tensor sequence, "
                       "or sending what the aggregator drops)" +
                       (f"; workers seen in completed chunks: "
                        f"{[w for w in range(32) if (seen >> w) & 1]}" if seen else "") +
                       counters)

    def _bound_address(self) -> str:
        try:
            ip, port = self.sock.getsockname()[:2]
        except OSError:                      # closed meanwhile
            return "a closed socket"
        return f"{ip}:{port}"


class TensorStream:
    """The exchange of one tensor, fed range by range (AggregatorTransport.open_stream).

    submit() adds the packed indices of the next values (every submission but the last a
    multiple of values_per_packet) and sends what the window allows; pump() makes progress
    without blocking (call it between other work); wait_values(n) blocks until values
    [0, n) are in; finish() until the stream's completion predicate holds, and returns the
    AllreduceResult. The sums of completed values can be read from `sums` at any time.

    In background mode an I/O thread does the sending, retransmitting and receiving: it
    holds `lock` while it touches the stream, sleeps in select() on the socket and a wake-up
    pipe (written on submit), and hands an error to the next waiter.
    """

    def __init__(self, transport: AggregatorTransport, num_values: int, tensor: int,
                 layer: int, num_layers: int, background: bool = False):
        t = transport
        self.transport, self.layer, self.num_layers = t, layer, num_layers
        vpp = t.vpp
        n_chunks = -(-num_values // vpp)
        chunks = np.arange(n_chunks)
        self.slots = chunks % t.pool_size
        rounds = t.slot_rounds[self.slots] + chunks // t.pool_size
        self.ex = _Exchange(n_chunks, rounds, tensor, num_values, vpp, t.pool_size)
        counts = np.minimum(vpp, num_values - chunks * vpp)
        self.rows = np.zeros((n_chunks, HEADER_LEN + (vpp + 1) // 2), np.uint8)
        self.packets = PacketRows(self.rows, HEADER_LEN + (counts + 1) // 2)
        self.native = self._native_window() if t.native else None
        self.submitted = 0               # values submitted so far
        self.last_progress = time.monotonic()
        self.closed = False
        self.lock = threading.Lock()
        self._progress = threading.Condition(self.lock)
        self._error: BaseException | None = None
        self._wanted: int | None = None      # chunks a background-mode waiter waits for
        self._at_least: int | None = None    # and, for its own predicate, its hint (_wait)
        self._in_c = False                   # the I/O thread is inside a native call
        self.until = float("inf")            # a wait's time limit (wait_all), monotonic s
        self.grace_at, self.grace_rtos = -1, 0.0    # wait_grace's, while it waits
        self._thread = None
        if background:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            self._thread = threading.Thread(target=self._serve, name="thc-stream-io",
                                            daemon=True)
            self._thread.start()

    def _native_window(self) -> native_datapath.NativeWindow:
        """The C loop's view of this stream: its arrays, the socket, the receive rows."""
        t, ex = self.transport, self.ex
        return native_datapath.NativeWindow(
            fd=t.sock.fileno(), pool=t.pool_size, job=t.job, tensor=ex.tensor,
            num_values=ex.num_values, vpp=t.vpp, rows=self.rows, lengths=self.packets.lengths,
            tos=self.packets.tos, rounds=ex.rounds, sent=ex.sent, done=ex.done,
            retransmitted=ex.retransmitted, sent_at=ex.sent_at, deadline=ex.deadline,
            backoff=ex.backoff, sums=ex.sums, counts=ex.counts, contributors=ex.contributors,
            probed=ex.probed, rx=t.io.rx, rx_len=t.io.rx_len,
            rx_tos=t.io.rx_tos if t.ce_window else None)

    @property
    def num_values(self) -> int:
        return self.ex.num_values

    @property
    def sums(self) -> np.ndarray:
        return self.ex.sums

    def submit(self, packed, num_values: int, *, values=None, partition_norms=None,
               partition_sizes=None, send: bool = True) -> None:
        """The packed indices (two per byte) of values [submitted, submitted+num_values);
        values: their rotated floats, for the DSCP/ECN policy; partition_norms /
        partition_sizes: the RHT partitions these values make up (their agreed L2 norms and
        padded sizes), for a policy that marks per partition (`marks_partitions`).
        send=False (foreground mode): not sent now, but by the next pump or wait (a caller
        that waits next saves a round)."""
        self._check_open()
        t, ex, vpp = self.transport, self.ex, self.transport.vpp
        lo, hi = self.submitted, self.submitted + num_values
        if num_values <= 0 or hi > ex.num_values or (hi < ex.num_values and hi % vpp):
            raise ValueError(f"submit: values [{lo}, {hi}) of {ex.num_values}: every range but "
                             f"the last must end on a packet boundary (a multiple of {vpp})")
        c0, c1 = lo // vpp, -(-hi // vpp)
        # Straight into the stream's rows: the I/O thread reads only rows below
        # `available`, which moves on (under the lock) after they are written.
        encode_data(packed, num_values, vpp, job=t.job, worker=t.worker, tensor=ex.tensor,
                    slots=self.slots[c0:c1], rounds=ex.rounds[c0:c1].astype(np.uint32),
                    expected=t.expected, min_count=t.min_count, first_offset=lo,
                    out=self.rows[c0:c1])
        per_partition = {}
        if partition_norms is not None and getattr(t.policy, "marks_partitions", False):
            per_partition = {"partition_norms": partition_norms,
                             "partition_sizes": partition_sizes}
        dscp, ecn = t.policy(layer=self.layer, num_layers=self.num_layers, values=values,
                             values_per_packet=vpp, num_packets=c1 - c0, **per_partition)
        tos = ((np.asarray(dscp, np.uint8) << 2) | (np.asarray(ecn, np.uint8) & 3))
        if tos.shape != (c1 - c0,):
            raise ValueError(f"policy returned {tos.shape} marks for {c1 - c0} packets")
        with self.lock:
            self.packets.tos[c0:c1] = tos
            self.submitted = hi
            ex.available = c1
            self.last_progress = time.monotonic()      # new work counts as progress
        if self._thread is not None:
            os.write(self._wake_w, b"s")
        elif send:
            self.pump()

    def pump(self) -> None:
        """Send, retransmit and take in what arrived, without blocking (background mode:
        the I/O thread does it; nothing to do)."""
        self._check_open()
        if self._thread is None:
            self._drive(None, block=False)

    def values_done(self) -> int:
        """How many leading values have their sums in (or were given up). While the I/O
        thread is inside a native call, the call's own count so far (it publishes it in its
        state): a hint for polling (ready); wait_values is the one that synchronises with
        the call before its sums are read."""
        with self.lock:
            ex = self.ex
            chunks = max(ex._done_prefix, self.native.state.done_prefix) if self._in_c \
                else ex.done_prefix()
            return min(ex.num_values, chunks * self.transport.vpp)

    def wait_values(self, num_values: int) -> None:
        """Block until the sums of values [0, num_values) are in."""
        self._check_open()
        chunks = -(-num_values // self.transport.vpp)
        self._drive(lambda: self.ex.done_prefix() >= chunks, target=chunks)

    def wait_until(self, until, at_least: int | None = None) -> None:
        """Block until until() holds (it runs with the stream's state locked, so it may
        read and adjust `ex`): a completion rule of the caller's, e.g. bounded loss.
        at_least: a number of done chunks until() needs before it can hold; the native
        loop waits for them in C, without Python between arrivals."""
        self._check_open()
        self._drive(until, at_least=at_least)

    def wait_all(self, until: float) -> None:
        """Block until every chunk is done or the monotonic clock reaches `until`, whichever
        comes first: on the native path in C, without Python between arrivals (a
        bounded-loss rule's grace period, once enough chunks are in)."""
        self._check_open()
        ex = self.ex
        self.until = until
        try:
            self._drive(lambda: ex.all_done() or time.monotonic() >= until,
                        target=ex.n_chunks)
        finally:
            self.until = float("inf")

    def wait_grace(self, at_least: int, grace_rtos: float) -> None:
        """Block until every chunk is done, or until grace_rtos retransmission timeouts
        after at_least chunks are done, whichever comes first (a bounded-loss rule: wait
        for the chunks it needs, then give the rest a grace period; 0: none). The chunks
        overdue when the grace period starts go out again at once, as after a stall, and
        every pending chunk's timer fires within one RTO. On the native path the whole wait
        is one C call (start_grace): no hand-off to Python between the two parts."""
        self._check_open()
        ex, t = self.ex, self.transport
        if not t._native_for(self):
            grace = {}

            def enough() -> bool:
                if ex.all_done():
                    return True
                if ex._n_done < at_least:
                    return False
                now, rto = time.monotonic(), t.timer.rto
                if grace_rtos:
                    ex.start_grace(now, rto)
                grace["end"] = now + grace_rtos * rto
                return True
            self.wait_until(enough)
            if self._thread is not None:
                os.write(self._wake_w, b"g")     # its sleep was timed by the old deadlines
            if grace_rtos and not ex.all_done():
                self.wait_all(grace["end"])
            return
        self.grace_at, self.grace_rtos = at_least, grace_rtos
        try:
            self._drive(lambda: ex.all_done() or time.monotonic() >= self.until,
                        target=ex.n_chunks)
        finally:
            self.grace_at, self.until = -1, float("inf")

    def give_up_rest(self) -> np.ndarray:
        """Give up every chunk not done yet (a bounded-loss rule, once its wait is over);
        returns them. With an I/O thread, first out of its native call and kept out while
        the chunks change: a call running meanwhile would write back its own count of the
        done chunks over the given-up ones, and the stream would never end."""
        if self.ex.all_done():           # (a call running meanwhile cannot undo a chunk)
            return np.flatnonzero(~self.ex.done)
        with self._progress:
            while self._in_c:
                os.write(self._wake_w, b"w")
                self._progress.wait(0.05)
            rest = np.flatnonzero(~self.ex.done)
            self.ex.give_up(rest)
            self._progress.notify_all()
        return rest

    def counts(self, lo: int, hi: int):
        """Contributor count of values [lo, hi): an int when every chunk agrees, else one
        per value (0 where a chunk was given up)."""
        vpp = self.transport.vpp
        per_chunk = self.ex.counts[lo // vpp: -(-hi // vpp)]
        if len(per_chunk) and (per_chunk == per_chunk[0]).all():
            return int(per_chunk[0])
        return np.repeat(per_chunk, vpp)[lo % vpp: lo % vpp + hi - lo]

    def finish(self, until=None) -> AllreduceResult:
        """Block until until() holds (default: every chunk done), close the stream and
        advance the slot rounds; the result holds every chunk's sums and counts.

        A bounded-loss rule would pass its own predicate (e.g. a fraction of the chunks
        done) and give the rest up (`ex.give_up`) before the result is built."""
        self._check_open()
        ex = self.ex
        if self.submitted < ex.num_values:
            raise TransportError(f"finish: only {self.submitted} of {ex.num_values} values of "
                                 f"tensor {ex.tensor} were submitted")
        self._drive(until or ex.all_done, target=None if until else ex.n_chunks)
        self.close()
        # Every worker advanced each slot by the same number of uses.
        t = self.transport
        t.slot_rounds += np.bincount(self.slots, minlength=t.pool_size)
        return AllreduceResult(ex.sums, ex.counts, ex.contributors, t.vpp)

    def _drive(self, until, block: bool = True, target: int | None = None,
               at_least: int | None = None) -> None:
        if block and self._thread is None and self.ex.all_done() and until():
            return                   # nothing left to send or take in: no round (a C entry)
        try:
            if self._thread is None:
                self.transport._drive(self, until, block=block, target=target,
                                      at_least=at_least)
            elif block:
                self._wait(until, target, at_least)
        except BaseException:
            self.close()             # a failed exchange frees the transport for the next
            raise

    def _wait(self, until, target: int | None = None, at_least: int | None = None) -> None:
        """Background mode: sleep until the I/O thread made until() true, or failed.
        target: until() means chunks [0, target) are done; the I/O thread is told (a
        native call in progress ends, so it stops as soon as those chunks are in).
        at_least: for a predicate of the caller's, the done chunks it needs first (the
        I/O thread waits for them in one native call)."""
        with self._progress:
            # A predicate of the caller's (target None) is checked after every round. While
            # the I/O thread is inside a native call, the stream's arrays are the call's:
            # nothing here looks at them until it is out (it is woken to take the new goal).
            self._wanted = EVERY_ROUND if target is None else target
            self._at_least = at_least if target is None else None
            if self._in_c:
                os.write(self._wake_w, b"w")
            try:
                while self._in_c or not until():
                    if self._error is not None:
                        raise self._error
                    if not self._thread.is_alive():
                        raise TransportError(f"the I/O thread of tensor {self.ex.tensor} "
                                             "ended before its results were in")
                    self._progress.wait(min(0.5, max(self.until - time.monotonic(), 1e-3)))
            finally:
                self._wanted = self._at_least = None

    def _io_target(self) -> int | None:
        """The chunks the I/O thread's next native call brings in: every chunk submitted,
        or fewer while a waiter wants fewer; None when all submitted chunks are done."""
        ex = self.ex
        done = ex.done_prefix()
        if done >= ex.available:
            return None
        if self._wanted not in (None, EVERY_ROUND) and self._wanted > done:
            return min(ex.available, self._wanted)
        return ex.available

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _serve(self) -> None:
        """The I/O thread: rounds of receive/send/retransmit until every chunk is done."""
        if self.transport._native_for(self):
            return self._serve_native()
        t, ex = self.transport, self.ex
        try:
            while True:
                with self.lock:
                    if self.closed:
                        return
                    t._round(self)
                    self._progress.notify_all()
                    if ex.all_done():
                        return
                    idle = ex.waiting_for_input()      # nothing in flight: wait for submit
                    if not idle:
                        t._check_timeout(self, ex.all_done)
                    wait = None if idle else t._wait_time(self)
                t.io.wait_readable(wait, also=self._wake_r)
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
        except BaseException as exc:         # handed to the waiter
            with self.lock:
                self._error = exc
                self._progress.notify_all()

    def _serve_native(self) -> None:
        """The I/O thread, native: one blocking C call per batch of submitted chunks (the
        GIL and the stream's lock released while it runs); a submission, a new waiter or
        close() writes to the wake-up pipe, which ends the call. C reads and writes only
        chunks [0, available) of the stream's arrays, which submit() leaves alone."""
        t, ex, window = self.transport, self.ex, self.native
        try:
            while True:
                self._drain_wake()
                with self.lock:
                    if self.closed:
                        return
                    if ex.all_done():
                        self._progress.notify_all()
                        return
                    target = self._io_target()
                    # a waiter's own predicate goes round by round, once the chunks it
                    # needs first (its hint) are in: those come in one native call
                    at_least = (self._at_least if self._wanted == EVERY_ROUND
                                and t._native_hint(self, self._at_least) else None)
                    # past a wait_all's time limit the call would end at once: stay out
                    # of C so the waiter, which needs the I/O thread outside it, can leave
                    in_c = (target is not None and time.monotonic() < self.until
                            and (self._wanted != EVERY_ROUND or at_least is not None))
                    if in_c:
                        t._native_enter(self)
                        window.state.wake_fd = self._wake_r
                        self._in_c = True
                    else:
                        # Idle (take in strays, then wait for a submit: no timeout), or a
                        # waiter's own predicate: one round, then the waiter looks.
                        t._run_native(self, block=False, target=0)
                        self._progress.notify_all()
                        wait = None
                        if target is not None:
                            t._check_timeout(self, ex.all_done)
                            wait = t._wait_time(self)
                if not in_c:
                    t.io.wait_readable(wait, also=self._wake_r)
                    continue
                status = window.run(True, target, at_least)
                with self.lock:
                    self._in_c = False
                    window.state.wake_fd = -1
                    t._native_leave(self)
                    try:
                        t._native_outcome(self, status, target, at_least)
                    finally:
                        self._progress.notify_all()
        except BaseException as exc:         # handed to the waiter
            with self.lock:
                self._error = exc
                self._progress.notify_all()

    def close(self) -> None:
        """Stop using this stream (its packets are not kept alive; its I/O thread ends)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        if self._thread is not None:
            os.write(self._wake_w, b"c")
            if self._thread is not threading.current_thread():
                self._thread.join()
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.packets = None

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError(f"the stream of tensor {self.ex.tensor} is closed")


class _Exchange:
    """The window state of one tensor: per-chunk sent/done/timers, the result arrays."""

    def __init__(self, n_chunks, rounds, tensor, num_values, vpp, pool):
        self.n_chunks, self.rounds, self.tensor, self.pool = n_chunks, rounds, tensor, pool
        self.num_values, self.vpp = num_values, vpp
        self.sent = np.zeros(n_chunks, bool)
        self.done = np.zeros(n_chunks, bool)
        self.retransmitted = np.zeros(n_chunks, bool)
        self.sent_at = np.zeros(n_chunks)
        self.deadline = np.full(n_chunks, np.inf)
        self.backoff = np.ones(n_chunks)
        self.sums = np.zeros(num_values, np.uint8)
        self.counts = np.zeros(n_chunks, np.int64)
        self.contributors = np.zeros(n_chunks, np.uint32)
        self.probed = np.full(n_chunks, PROBE_NONE, np.int64)   # bitmaps from probe replies
        self.available = 0             # chunks [0, available) have been submitted
        self._next_unsent = 0
        self._n_done = 0
        self._done_prefix = 0
        self.last_progress = time.monotonic()
        self.stall_all = False         # a stall re-sends every expired chunk (grace period)

    def all_done(self) -> bool:
        return self._n_done == self.n_chunks

    def done_prefix(self) -> int:
        """How many leading chunks are done (results in, or given up)."""
        while self._done_prefix < self.n_chunks and self.done[self._done_prefix]:
            self._done_prefix += 1
        return self._done_prefix

    def waiting_for_input(self) -> bool:
        """Every submitted chunk is done, and some were never submitted."""
        return self.available < self.n_chunks and self.done_prefix() >= self.available

    def chunk_values(self, chunk):
        return np.minimum(self.vpp, self.num_values - chunk * self.vpp)

    def sendable(self) -> np.ndarray:
        lo = self._next_unsent
        c = np.arange(lo, min(self.available, lo + self.pool))
        if not len(c):
            return c
        prev = c - self.pool
        ok = ~self.sent[c] & ((prev < 0) | self.done[np.maximum(prev, 0)])
        return c[ok]

    def mark_sent(self, chunks, now, rto) -> None:
        self.sent[chunks] = True
        self.sent_at[chunks] = now
        self.deadline[chunks] = now + rto
        while self._next_unsent < self.available and self.sent[self._next_unsent]:
            self._next_unsent += 1

    def expired(self, now, rto, rto_max) -> np.ndarray:
        """Chunks to retransmit now: timer expired, and evidence of a loss.

        A result only comes once every worker contributed, so a late result usually means a
        slow worker, not a lost packet. While results flow, a chunk is retransmitted only
        when a chunk sent no earlier than it has completed (it was overtaken: a hole, as in
        TCP's fast retransmit); when nothing completed for an RTO (a stall), every expired
        chunk is.

        Except before the stream's first result: there a stall is most often peers that
        have not sent yet (every worker's first window of a call waits for the last worker
        to start), and re-sending the whole window only crowds the bottleneck. So only the
        oldest expired chunk goes again, and the next stall comes when its backed-off timer
        runs out, as TCP's timeout re-sends one segment and doubles; if the window was
        lost, that chunk's result, sent after the others, is the evidence that sends the
        rest. Once results came, a stall is left to the old rule: with losses at several
        workers each one's oldest chunk is a different one, and probing one at a time made
        a congested incast with selective drops 4x slower
        (tests/dlcp/test_innetwork_incast.py). In a grace period (start_grace) a stall
        re-sends every expired chunk at once."""
        candidates = ~self.done & self.sent & (self.deadline <= now)
        if not candidates.any():
            return np.flatnonzero(candidates)
        if now - self.last_progress >= rto:
            late = np.flatnonzero(candidates)
            if self.stall_all or self._n_done:
                return late
            oldest = late[0]
            # the stall clock: the next stall is due with the oldest's new deadline
            # (mark_retransmitted's), unless a result comes first
            backoff = min(self.backoff[oldest] * 2, MAX_BACKOFF)
            self.last_progress = now + min(rto * backoff, rto_max) - rto
            return late[:1]
        done_sent_at = np.where(self.done, self.sent_at, -np.inf)
        later = np.maximum.accumulate(done_sent_at[::-1])[::-1]     # max over chunks >= c
        later = np.append(later[1:], -np.inf)                        # ... over chunks > c
        return np.flatnonzero(candidates & (later >= self.sent_at))

    def mark_retransmitted(self, chunks, now, timer) -> None:
        self.retransmitted[chunks] = True
        self.sent_at[chunks] = now
        self.backoff[chunks] = np.minimum(self.backoff[chunks] * 2, MAX_BACKOFF)
        self.deadline[chunks] = now + np.minimum(timer.rto * self.backoff[chunks], timer.rto_max)

    def start_grace(self, now, rto) -> None:
        """A bounded-loss grace period starts (TensorStream.wait_grace): a stall now, after
        which every overdue chunk goes out at once, no further loss evidence needed
        (expired, stall_all), and every pending chunk's timer is re-armed to at most one
        RTO from now (armed with an older, larger RTO it would not fire inside the grace
        period)."""
        self.last_progress = min(self.last_progress, now - rto)
        self.stall_all = True
        pending = ~self.done & self.sent
        self.deadline[pending] = np.minimum(self.deadline[pending], now + rto)

    def next_deadline(self, now, rto) -> float:
        """When the next retransmission may be due (held-back chunks: at a stall)."""
        pending = self.deadline[~self.done & self.sent]
        if not len(pending):
            return np.inf
        future = pending[pending > now]
        upcoming = float(future.min()) if len(future) else np.inf
        if len(future) < len(pending):             # expired but held back (see expired)
            upcoming = min(upcoming, self.last_progress + rto)
        return upcoming

    def complete(self, chunks, contributors, counts, now):
        """Record results; return an RTT sample from chunks sent once (Karn), or None."""
        self.done[chunks] = True
        self._n_done += len(chunks)
        self.last_progress = now
        self.contributors[chunks] = contributors
        self.counts[chunks] = counts
        clean = chunks[~self.retransmitted[chunks]]
        if not len(clean):
            return None
        # The latest completion of the batch: conservative, one sample per batch.
        return float(now - self.sent_at[clean].min())

    def give_up(self, chunks) -> None:
        self.done[chunks] = True
        self._n_done += len(chunks)
        self.counts[chunks] = 0
