"""Worker transport: one worker's side of protocol v2 over a UDP socket.

A worker hands `AggregatorTransport.allreduce` the packed 4-bit indices of one tensor and
gets back the 8-bit lane sums of every worker's table values, plus the contributor count
of each packet. The aggregator is reached by address: the reference UDP service, the DPDK
switch, BMv2 or Tofino all look the same from here (docs/protocol.md).

How a tensor moves (docs/protocol.md §4.4, DESIGN.md §4):
* chunk c (values [c*vpp, (c+1)*vpp)) goes to slot c mod pool; the slot's round counter
  is kept across calls, +1 per use, identically on every worker (all workers call with the
  same tensor sizes in the same order, which the allreduce layer checks);
* a window: chunk c + pool is sent only once the result of chunk c is in;
* a chunk whose result is late is retransmitted with flag RETX after a timeout that follows
  the measured round trip (Jacobson/Karels srtt/rttvar, Karn's rule: no RTT sample from a
  retransmitted chunk, exponential backoff), bounded by rto_min/rto_max;
* duplicate, reordered and re-served results are accepted once; results of other jobs,
  tensors or rounds are ignored and counted;
* a STRAGGLER notice means the slot moved past this worker's round: by default a clear
  error (a synchronous job never sees one), or with on_straggler="skip" the chunk is given
  up (count 0, the caller falls back to its own values there);
* results are scattered in place into one uint8 array (host.packets.scatter_payloads).

Syscalls are batched: on Linux a window goes out in one sendmmsg(2) call (descriptors
built once per tensor with numpy; an IP_TOS control message per datagram only when the ToS
differs between packets, else setsockopt) and a non-blocking socket is drained with one
recvmmsg(2) into preallocated rows. Elsewhere, or with THC_NO_MMSG=1, the same happens
with loops of send/sendmsg and recv_into.
All header work is vectorized (host.packets.encode_data / decode_headers).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from dataplane.config import DEFAULT_VALUES_PER_PACKET
from host.packets import (FLAG_RETX, HEADER_DTYPE, HEADER_LEN, TYPE_FLUSH, TYPE_RESULT,
                          TYPE_STRAGGLER, VERSION, decode_headers, encode_data, encode_headers,
                          header_types, scatter_payloads)

MAX_VALUES = 8192              # the reference aggregator's and DPDK switch's MAX_VALUES
SOCKET_BUFFER_BYTES = 8 << 20  # room for a full window of results in the kernel
PROBE_NONE = -1                # no probe answer (yet) for a chunk


# --------------------------------------------------------------------------- batched syscalls
# Many datagrams per syscall: sendmmsg(2) / recvmmsg(2) through ctypes (Linux).
#
# Python's socket module sends or receives one datagram per call; at 16 MB a worker moves
# 16,384 packets each way per allreduce, and the per-call cost (Python dispatch + syscall
# entry) was a third of its time. These wrappers describe rows of a 2-D uint8 array with
# numpy-built `struct mmsghdr` / `struct iovec` arrays (no per-packet Python), and hand the
# kernel a whole window in one call. `mmsg_available()` is False off Linux/glibc; callers then
# fall back to send/recv_into loops.
#
# Layouts (x86-64 and aarch64 Linux, LP64): iovec {void *base; size_t len} = 16 B;
# msghdr {void *name; socklen_t namelen; struct iovec *iov; size_t iovlen; void *control;
# size_t controllen; int flags} = 56 B; mmsghdr {msghdr; unsigned msg_len} = 64 B;
# cmsghdr {size_t len; int level; int type} = 16 B + data (an int ToS: CMSG_SPACE = 24 B).

IOVEC_DTYPE = np.dtype({"names": ["base", "len"], "formats": [np.uint64, np.uint64],
                        "offsets": [0, 8], "itemsize": 16})
MMSGHDR_DTYPE = np.dtype({
    "names": ["name", "namelen", "iov", "iovlen", "control", "controllen", "flags", "msg_len"],
    "formats": [np.uint64, np.uint32, np.uint64, np.uint64, np.uint64, np.uint64, np.int32,
                np.uint32],
    "offsets": [0, 8, 16, 24, 32, 40, 48, 56], "itemsize": 64})
CMSG_TOS_DTYPE = np.dtype({"names": ["len", "level", "type", "tos"],
                           "formats": [np.uint64, np.int32, np.int32, np.int32],
                           "offsets": [0, 8, 12, 16], "itemsize": 24})
CMSG_TOS_LEN = 20                      # CMSG_LEN(sizeof(int))
MSG_DONTWAIT = 0x40


def _load_libc():
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        send, recv = libc.sendmmsg, libc.recvmmsg
    except (OSError, AttributeError):
        return None
    send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                     ctypes.c_void_p]
    send.restype = recv.restype = ctypes.c_int
    return send, recv


_LIBC = _load_libc()


def mmsg_available() -> bool:
    return _LIBC is not None and os.environ.get("THC_NO_MMSG", "") in ("", "0")


def _row_pointers(rows: np.ndarray) -> np.ndarray:
    if rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError("datagram rows must be a C-contiguous 2-D array")
    return rows.ctypes.data + np.arange(len(rows), dtype=np.uint64) * np.uint64(rows.strides[0])


class _MessageBatch:
    """The mmsghdr array describing every row of `rows` (lengths[i] bytes of row i).

    Keeps references to everything the kernel reads through the pointers. `tos`
    (optional uint8 per row) adds an IP_TOS control message to each datagram.
    """

    def __init__(self, rows: np.ndarray, lengths, tos=None):
        self.rows = rows
        n = len(rows)
        self.iov = np.zeros(n, IOVEC_DTYPE)
        self.iov["base"] = _row_pointers(rows)
        self.iov["len"] = np.asarray(lengths, np.uint64)
        self.msgs = np.zeros(n, MMSGHDR_DTYPE)
        self.msgs["iov"] = self.iov.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(16)
        self.msgs["iovlen"] = 1
        self.cmsg = None
        if tos is not None:
            self.cmsg = np.zeros(n, CMSG_TOS_DTYPE)
            self.cmsg["len"] = CMSG_TOS_LEN
            self.cmsg["level"] = socket.IPPROTO_IP
            self.cmsg["type"] = socket.IP_TOS
            self.cmsg["tos"] = np.asarray(tos, np.int32)
            self.msgs["control"] = self.cmsg.ctypes.data + \
                np.arange(n, dtype=np.uint64) * np.uint64(CMSG_TOS_DTYPE.itemsize)
            self.msgs["controllen"] = CMSG_TOS_DTYPE.itemsize


def _sendmmsg(fd: int, msgs: np.ndarray) -> int:
    """Send the datagrams of a contiguous mmsghdr array; the number the kernel took.

    0 when the socket would block; OSError (ECONNREFUSED, ...) as the kernel reports it.
    """
    n = _LIBC[0](fd, msgs.ctypes.data, len(msgs), 0)
    if n < 0:
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR):
            return 0
        raise OSError(err, os.strerror(err))
    return n


def _recvmmsg(fd: int, batch: "_MessageBatch", limit: int | None = None) -> int:
    """Receive up to `limit` datagrams into batch's rows without blocking; how many.

    Their lengths are batch.msgs["msg_len"][:n]. 0 when nothing is waiting.
    """
    count = len(batch.msgs) if limit is None else min(limit, len(batch.msgs))
    n = _LIBC[1](fd, batch.msgs.ctypes.data, count, MSG_DONTWAIT, None)
    if n < 0:
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            return 0
        raise OSError(err, os.strerror(err))
    return n


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
    rtt_samples: list = field(default_factory=list)

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
    at most the aggregator's MAX_VALUES; min_count: partial aggregation threshold carried
    in the headers (0 = all expected); timeout: seconds without any progress before
    AggregatorTimeout; local: (ip, port) to bind (the aggregator's membership table names
    it; default any address, an ephemeral port); policy: the DSCP/ECN hook (see
    default_policy); on_straggler: "raise" or "skip" (see the module docstring).
    """

    def __init__(self, aggregator, *, job: int, worker: int, expected: int, pool_size: int,
                 values_per_packet: int = DEFAULT_VALUES_PER_PACKET, min_count: int = 0,
                 timeout: float = 30.0, local=("0.0.0.0", 0), policy=default_policy,
                 timer: RetransmitTimer | None = None, on_straggler: str = "raise",
                 sock: socket.socket | None = None):
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
        self.aggregator = parse_address(aggregator)
        self.job, self.worker, self.expected = job, worker, expected
        self.pool_size, self.vpp, self.min_count = pool_size, values_per_packet, min_count
        self.timeout, self.policy, self.on_straggler = timeout, policy, on_straggler
        self.timer = timer or RetransmitTimer()
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
        self.sock.setblocking(False)
        self._tos = 0
        self._heard_from_aggregator = False
        self._rx = np.zeros((2 * pool_size if pool_size < 512 else 1024,
                             HEADER_LEN + values_per_packet), dtype=np.uint8)
        self._rx_views = [memoryview(row) for row in self._rx]
        self._rx_len = np.zeros(len(self._rx), dtype=np.int64)
        # sendmmsg/recvmmsg: a window per syscall (else one datagram per call).
        self._mmsg = mmsg_available()
        self._rx_batch = _MessageBatch(self._rx, np.full(len(self._rx), self._rx.shape[1])) \
            if self._mmsg else None
        self._tx_batch = None            # (bufs, tos, _MessageBatch) of the last tensor

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
        rows = encode_headers(hdr)
        lengths = np.full(len(rows), HEADER_LEN)
        for _ in range(repeats):
            self._send_rows(rows, lengths, np.arange(len(rows)), np.zeros(len(rows), np.uint8))
        self.slot_rounds[:] = 0

    # ----------------------------------------------------------------- allreduce

    def allreduce(self, packed: np.ndarray, num_values: int, tensor: int, *, values=None,
                  layer: int = 0, num_layers: int = 1) -> AllreduceResult:
        """Send the packed indices of one tensor; return the lane sums of all workers.

        packed: uint8[ceil(num_values/2)], two indices per byte (even value high nibble);
        tensor: tensor id carried in the headers; values: the rotated pre-quantization
        floats, handed to the DSCP/ECN policy (None: the policy sees None).
        """
        n_chunks = -(-num_values // self.vpp)
        chunks = np.arange(n_chunks)
        slots = chunks % self.pool_size
        rounds = self.slot_rounds[slots] + chunks // self.pool_size
        bufs, lengths = encode_data(packed, num_values, self.vpp, job=self.job,
                                    worker=self.worker, tensor=tensor, slots=slots,
                                    rounds=rounds.astype(np.uint32), expected=self.expected,
                                    min_count=self.min_count)
        dscp, ecn = self.policy(layer=layer, num_layers=num_layers, values=values,
                                values_per_packet=self.vpp, num_packets=n_chunks)
        tos = ((np.asarray(dscp, np.uint8) << 2) | (np.asarray(ecn, np.uint8) & 3)).astype(np.uint8)
        if tos.shape != (n_chunks,):
            raise ValueError(f"policy returned {tos.shape} marks for {n_chunks} packets")
        exchange = _Exchange(n_chunks, rounds, tensor, num_values, self.vpp, self.pool_size)
        try:
            self._run(exchange, bufs, lengths, tos)
        finally:
            self._tx_batch = None          # do not keep this tensor's packets alive
        # Every worker advanced each slot by the same number of uses.
        uses = np.bincount(slots, minlength=self.pool_size)
        self.slot_rounds += uses
        return AllreduceResult(exchange.sums, exchange.counts, exchange.contributors, self.vpp)

    def _run(self, ex: "_Exchange", bufs, lengths, tos) -> None:
        last_progress = time.monotonic()
        while not ex.all_done():
            now = time.monotonic()
            # Send what the window allows: chunk c once chunk c - pool is done.
            ready = ex.sendable()
            if len(ready):
                self._send_rows(bufs, lengths, ready, tos)
                ex.mark_sent(ready, now, self.timer.rto)
            # Retransmit chunks whose timer expired (Karn: they give no RTT sample).
            late = ex.expired(now, self.timer.rto)
            if len(late):
                bufs[late, 1] |= FLAG_RETX          # header byte 1 is `flags`
                self._send_rows(bufs, lengths, late, tos)
                ex.mark_retransmitted(late, now, self.timer)
                self.stats.retransmissions += len(late)
            wait = max(0.0, min(ex.next_deadline(now, self.timer.rto) - now,
                                last_progress + self.timeout - now))
            if self._wait_readable(wait):
                if self._receive(ex):
                    last_progress = time.monotonic()
            if time.monotonic() - last_progress > self.timeout and not ex.all_done():
                missing = self._probe_missing(ex) if self._heard_from_aggregator else None
                raise AggregatorTimeout(self._timeout_message(ex, missing))

    # ----------------------------------------------------------------- socket I/O

    def _send_rows(self, bufs, lengths, rows, tos) -> None:
        """Send bufs[rows] (batched; ToS via setsockopt when uniform, per-packet cmsg else)."""
        if self._mmsg and bufs.flags.c_contiguous:
            return self._send_rows_mmsg(bufs, lengths, rows, tos)
        row_tos = tos[rows]
        uniform = bool(np.all(row_tos == row_tos[0]))
        if uniform and int(row_tos[0]) != self._tos:
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(row_tos[0]))
            self._tos = int(row_tos[0])
        sent_bytes = 0
        for i, r in enumerate(rows.tolist()):
            view = memoryview(bufs[r, :lengths[r]])
            while True:
                try:
                    if uniform:
                        self.sock.send(view)
                    else:
                        self.sock.sendmsg([view], [(socket.IPPROTO_IP, socket.IP_TOS,
                                                    struct.pack("i", int(row_tos[i])))])
                    break
                except BlockingIOError:
                    select.select([], [self.sock], [], 0.05)   # send buffer full: wait
                except ConnectionRefusedError as exc:
                    raise self._unreachable(exc) from exc
            sent_bytes += int(lengths[r])
        self.stats.packets_sent += len(rows)
        self.stats.bytes_sent += sent_bytes

    def _send_rows_mmsg(self, bufs, lengths, rows, tos) -> None:
        """Send bufs[rows] with sendmmsg, as many per call as the socket buffer takes."""
        cached = self._tx_batch
        if cached is None or cached[0] is not bufs or cached[1] is not tos:
            # One descriptor array per tensor; ToS by cmsg only when it varies per packet.
            uniform = bool(np.all(tos == tos[0])) if len(tos) else True
            if uniform and len(tos) and int(tos[0]) != self._tos:
                self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(tos[0]))
                self._tos = int(tos[0])
            cached = (bufs, tos, _MessageBatch(bufs, lengths, None if uniform else tos))
            self._tx_batch = cached
        msgs = cached[2].msgs[rows]                    # contiguous copy of the descriptors
        fd, pos = self.sock.fileno(), 0
        while pos < len(msgs):
            try:
                sent = _sendmmsg(fd, msgs[pos:])
            except ConnectionRefusedError as exc:
                raise self._unreachable(exc) from exc
            if not sent:
                select.select([], [self.sock], [], 0.05)   # send buffer full: wait
            pos += sent
        self.stats.packets_sent += len(rows)
        self.stats.bytes_sent += int(lengths[rows].sum())

    def _unreachable(self, exc) -> AggregatorUnreachable:
        host, port = self.aggregator
        return AggregatorUnreachable(
            f"aggregator {host}:{port} refused the packets (ICMP port unreachable: nothing "
            f"listens there): start the aggregator or fix --aggregator ({exc})")

    def _wait_readable(self, wait: float) -> bool:
        try:
            readable, _, _ = select.select([self.sock], [], [], wait)
        except InterruptedError:
            return False
        return bool(readable)

    def _receive(self, ex: "_Exchange") -> bool:
        """Drain the socket into the rx rows; apply what arrived. True on progress."""
        n = 0
        if self._mmsg:
            try:
                n = _recvmmsg(self.sock.fileno(), self._rx_batch)
            except ConnectionRefusedError as exc:
                raise self._unreachable(exc) from exc
            self._rx_len[:n] = self._rx_batch.msgs["msg_len"][:n]
        while not self._mmsg and n < len(self._rx):
            try:
                self._rx_len[n] = self.sock.recv_into(self._rx_views[n])
            except BlockingIOError:
                break
            except ConnectionRefusedError as exc:
                raise self._unreachable(exc) from exc
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            n += 1
        if not n:
            return False
        self._heard_from_aggregator = True
        self.stats.packets_received += n
        self.stats.bytes_received += int(self._rx_len[:n].sum())
        rows, lens = self._rx[:n], self._rx_len[:n]
        ok = lens >= HEADER_LEN
        self.stats.ignored += int((~ok).sum())
        rows, lens = rows[ok], lens[ok]
        if not len(rows):
            return False
        hdr = decode_headers(rows, lens)
        return self._apply(ex, rows, lens, hdr)

    def _apply(self, ex: "_Exchange", rows, lens, hdr) -> bool:
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
                rtt = ex.complete(c, hdr["contributors"][fresh], hdr["count"][fresh],
                                  time.monotonic())
                if rtt is not None:
                    self.timer.sample(rtt)
                    self.stats.rtt_samples.append(rtt)
                self.stats.results_accepted += len(fresh)
                progress = True
        return progress

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
        self._send_rows(bufs, lengths, np.arange(len(stuck)), np.zeros(len(stuck), np.uint8))
        deadline = time.monotonic() + min(1.0, max(0.05, 4 * self.timer.rto))
        while time.monotonic() < deadline and not (ex.probed[stuck] != PROBE_NONE).any():
            if self._wait_readable(deadline - time.monotonic()):
                self._receive(ex)
        answered = ex.probed[stuck][ex.probed[stuck] != PROBE_NONE]
        if not len(answered):
            return None
        have = int(np.bitwise_and.reduce(answered.astype(np.uint64)))
        return [w for w in range(32) if (self.expected >> w) & 1 and not (have >> w) & 1]

    def _timeout_message(self, ex: "_Exchange", missing=None) -> str:
        waiting = np.flatnonzero(~ex.done)
        host, port = self.aggregator
        head = (f"worker {self.worker}: no progress for {self.timeout:.1f} s on tensor "
                f"{ex.tensor}: {len(waiting)} of {ex.n_chunks} chunks still wait for their "
                f"result from aggregator {host}:{port}")
        if not self._heard_from_aggregator:
            return head + (" and nothing was ever received from it: is it running, reachable, "
                           "and is this worker's address installed as a member of job "
                           f"{self.job}?")
        seen = int(np.bitwise_or.reduce(ex.contributors[ex.done])) if ex.done.any() else 0
        expected = [w for w in range(32) if (self.expected >> w) & 1]
        if missing:
            return head + (f"; the aggregator still waits for worker(s) {missing} (expected "
                           f"{expected}): they stopped contributing (crashed, killed, hung, or "
                           "calling allreduce with a different tensor sequence)")
        return head + (f"; expected workers {expected}; the aggregator answers, so a worker "
                       "stopped contributing (crashed, killed, or calling allreduce with a "
                       "different tensor sequence)" +
                       (f"; workers seen in completed chunks: "
                        f"{[w for w in range(32) if (seen >> w) & 1]}" if seen else ""))


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
        self._next_unsent = 0
        self._n_done = 0
        self.last_progress = time.monotonic()

    def all_done(self) -> bool:
        return self._n_done == self.n_chunks

    def chunk_values(self, chunk):
        return np.minimum(self.vpp, self.num_values - chunk * self.vpp)

    def sendable(self) -> np.ndarray:
        lo = self._next_unsent
        c = np.arange(lo, min(self.n_chunks, lo + self.pool))
        if not len(c):
            return c
        prev = c - self.pool
        ok = ~self.sent[c] & ((prev < 0) | self.done[np.maximum(prev, 0)])
        return c[ok]

    def mark_sent(self, chunks, now, rto) -> None:
        self.sent[chunks] = True
        self.sent_at[chunks] = now
        self.deadline[chunks] = now + rto
        while self._next_unsent < self.n_chunks and self.sent[self._next_unsent]:
            self._next_unsent += 1

    def expired(self, now, rto) -> np.ndarray:
        """Chunks to retransmit now: timer expired, and evidence of a loss.

        A result only comes once every worker contributed, so a late result usually means a
        slow worker, not a lost packet. While results flow, a chunk is retransmitted only
        when a chunk sent no earlier than it has completed (it was overtaken: a hole, as in
        TCP's fast retransmit); when nothing completed for an RTO, every expired chunk is.
        """
        candidates = ~self.done & self.sent & (self.deadline <= now)
        if not candidates.any():
            return np.flatnonzero(candidates)
        if now - self.last_progress >= rto:
            return np.flatnonzero(candidates)
        done_sent_at = np.where(self.done, self.sent_at, -np.inf)
        later = np.maximum.accumulate(done_sent_at[::-1])[::-1]     # max over chunks >= c
        later = np.append(later[1:], -np.inf)                        # ... over chunks > c
        return np.flatnonzero(candidates & (later >= self.sent_at))

    def mark_retransmitted(self, chunks, now, timer) -> None:
        self.retransmitted[chunks] = True
        self.sent_at[chunks] = now
        self.backoff[chunks] = np.minimum(self.backoff[chunks] * 2, 64)
        self.deadline[chunks] = now + np.minimum(timer.rto * self.backoff[chunks], timer.rto_max)

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
