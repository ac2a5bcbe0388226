"""Batched UDP datagram I/O: the send/receive core the aggregator transport is built on.

Python's socket module moves one datagram per call; a 16 MB tensor is thousands of
datagrams each way, and per-call cost (Python dispatch + syscall entry) was a third of a
worker's exchange time. This module moves many per syscall and has no per-packet Python:

* `PacketRows`: the datagrams of one tensor as the rows of a 2-D uint8 array (row k is
  lengths[k] bytes: AGG header + payload), with a ToS byte per row. Descriptors for the
  kernel (`struct mmsghdr`/`iovec`, control messages) are built with numpy.
* `DatagramSocket`: a connected, non-blocking UDP socket that sends any subset of those
  rows and drains what arrived into preallocated receive rows:
  - sendmmsg(2): a window of datagrams per call; the ToS by setsockopt while it is the
    same for every row, else an IP_TOS control message per datagram;
  - UDP GSO (UDP_SEGMENT, Linux >= 4.18), on request (gso=True or THC_GSO=1): a run of
    consecutive full-length rows with one ToS leaves as one "super-datagram" that the
    kernel cuts into the same datagrams (the rows are contiguous in memory), so the UDP/IP
    stack runs once per run instead of once per datagram. A path that refuses it (no
    checksum offload on the device, EIO/EINVAL) turns GSO off for the socket and the rows
    go out one by one. Off by default: on a veth whose far end is a packet socket (a DPDK
    switch's af_packet port) the kernel hands the super-datagram over uncut unless the
    sending end cuts it (ethtool -K DEV tx-udp-segmentation off), which a sender cannot
    see; and with 8192-value packets it measured no faster (docs/perf.md);
  - recvmmsg(2) into the receive rows, without blocking; with rx_tos=True each
    datagram's ToS byte too (IP_RECVTOS: one IP_TOS control message per datagram).
  Off Linux/glibc, or with THC_NO_MMSG=1, the same happens with loops of
  send/sendmsg/recv_into (`batched=False`).

The aggregator transport (host.transport) drives it; it knows nothing of the protocol, so
any datagram protocol with row-shaped packets can use it (DLCP's transport, for one).

Layouts (x86-64 and aarch64 Linux, LP64): iovec {void *base; size_t len} = 16 B;
msghdr {void *name; socklen_t namelen; struct iovec *iov; size_t iovlen; void *control;
size_t controllen; int flags} = 56 B; mmsghdr {msghdr; unsigned msg_len} = 64 B;
cmsghdr {size_t len; int level; int type} = 16 B + data, padded to 8 (CMSG_SPACE).
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

import numpy as np

IOVEC_DTYPE = np.dtype({"names": ["base", "len"], "formats": [np.uint64, np.uint64],
                        "offsets": [0, 8], "itemsize": 16})
MMSGHDR_DTYPE = np.dtype({
    "names": ["name", "namelen", "iov", "iovlen", "control", "controllen", "flags", "msg_len"],
    "formats": [np.uint64, np.uint32, np.uint64, np.uint64, np.uint64, np.uint64, np.int32,
                np.uint32],
    "offsets": [0, 8, 16, 24, 32, 40, 48, 56], "itemsize": 64})
# Room for two control messages per datagram (UDP_SEGMENT and IP_TOS), each CMSG_SPACE = 24 B;
# an int (or the u16 segment size, little-endian) as each one's data.
CONTROL_DTYPE = np.dtype({
    "names": ["len0", "level0", "type0", "data0", "len1", "level1", "type1", "data1"],
    "formats": [np.uint64, np.int32, np.int32, np.int32, np.uint64, np.int32, np.int32, np.int32],
    "offsets": [0, 8, 12, 16, 24, 32, 36, 40], "itemsize": 48})
CMSG_SPACE_INT = 24
CMSG_LEN_INT = 20                      # CMSG_LEN(sizeof(int)): IP_TOS
CMSG_LEN_U16 = 18                      # CMSG_LEN(sizeof(uint16_t)): UDP_SEGMENT
MSG_DONTWAIT = 0x40
SOL_UDP = 17
UDP_SEGMENT = 103
IP_MTU = 14
IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13)
MSG_TRUNC = 0x20
CMSG_LEN_BYTE = 17                     # CMSG_LEN(1): the received IP_TOS carries one byte
GSO_MAX_SEGMENTS = 64                  # UDP_MAX_SEGMENTS of kernels before 6.x (later: 128)
GSO_MAX_BYTES = 65507 - 8              # one IPv4 UDP datagram's payload, less some slack
SOCKET_BUFFER_BYTES = 8 << 20          # room for a full window of datagrams in the kernel


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
    """sendmmsg/recvmmsg can be used here (Linux, glibc, 64-bit; THC_NO_MMSG unset)."""
    return _LIBC is not None and os.environ.get("THC_NO_MMSG", "") in ("", "0")


def gso_available() -> bool:
    """UDP GSO can be tried here (batched syscalls, little-endian Linux)."""
    return mmsg_available() and sys.byteorder == "little"


def gso_requested() -> bool:
    """THC_GSO=1: send with UDP GSO by default (see the module docstring)."""
    return os.environ.get("THC_GSO", "") not in ("", "0")


def row_pointers(rows: np.ndarray) -> np.ndarray:
    if rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError("datagram rows must be a C-contiguous 2-D array")
    return rows.ctypes.data + np.arange(len(rows), dtype=np.uint64) * np.uint64(rows.strides[0])


class MessageArray:
    """`struct mmsghdr`s (and their iovecs and control blocks) for a set of datagrams.

    bases/lengths: address and size of each datagram's bytes (the memory must outlive
    the array: `keep` holds it); tos: a ToS byte per datagram, or None (no IP_TOS
    message); segment: GSO segment size per datagram, 0 for none.
    """

    def __init__(self, bases, lengths, *, tos=None, segment=None, keep=None):
        n = len(bases)
        self.keep = keep
        self.iov = np.zeros(n, IOVEC_DTYPE)
        self.iov["base"] = bases
        self.iov["len"] = lengths
        self.msgs = np.zeros(n, MMSGHDR_DTYPE)
        self.msgs["iov"] = self.iov.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(16)
        self.msgs["iovlen"] = 1
        self.control = None
        if tos is None and segment is None:
            return
        # Slot 0: UDP_SEGMENT when segmenting, else IP_TOS; slot 1: IP_TOS after a segment.
        self.control = np.zeros(n, CONTROL_DTYPE)
        slots = []
        if segment is not None:
            slots.append((CMSG_LEN_U16, SOL_UDP, UDP_SEGMENT, segment))
        if tos is not None:
            slots.append((CMSG_LEN_INT, socket.IPPROTO_IP, socket.IP_TOS, tos))
        for i, (length, level, kind, data) in enumerate(slots):
            self.control[f"len{i}"] = length
            self.control[f"level{i}"] = level
            self.control[f"type{i}"] = kind
            self.control[f"data{i}"] = np.asarray(data, np.int32)
        self.msgs["control"] = self.control.ctypes.data + \
            np.arange(n, dtype=np.uint64) * np.uint64(CONTROL_DTYPE.itemsize)
        self.msgs["controllen"] = CMSG_SPACE_INT * len(slots)
        if segment is not None:
            # A datagram that is not cut carries no UDP_SEGMENT: its IP_TOS (if any) moves
            # to slot 0, or it has no control message at all.
            plain = np.asarray(segment) == 0
            if tos is not None:
                for field in ("len", "level", "type", "data"):
                    self.control[field + "0"][plain] = self.control[field + "1"][plain]
                self.msgs["controllen"][plain] = CMSG_SPACE_INT
            else:
                self.msgs["control"][plain] = 0
                self.msgs["controllen"][plain] = 0


class PacketRows:
    """The datagrams of one tensor: rows[k, :lengths[k]] with ToS tos[k].

    Every row but the last of a run may be sent as part of one GSO super-datagram when it
    is full (lengths[k] == the row width): rows are contiguous, so a run of full rows is one
    contiguous byte range.
    """

    def __init__(self, rows: np.ndarray, lengths, tos=None):
        if rows.ndim != 2 or rows.dtype != np.uint8 or not rows.flags.c_contiguous:
            raise ValueError("packet rows must be a C-contiguous 2-D uint8 array")
        self.rows = rows
        self.lengths = np.asarray(lengths, np.int64)
        self.tos = np.zeros(len(rows), np.uint8) if tos is None else np.asarray(tos, np.uint8)
        self.width = rows.shape[1]
        self._pointers = None

    def pointers(self) -> np.ndarray:
        if self._pointers is None:
            self._pointers = row_pointers(self.rows)
        return self._pointers


def _runs(rows: np.ndarray, lengths: np.ndarray, tos: np.ndarray, width: int,
          max_segments: int) -> np.ndarray:
    """Start positions (in `rows`) of GSO runs: consecutive row indices, one ToS, every row
    but a run's last full-width, at most max_segments rows."""
    n = len(rows)
    if n == 0:
        return np.zeros(0, np.int64)
    brk = np.ones(n, bool)
    brk[1:] = (np.diff(rows) != 1) | (tos[1:] != tos[:-1]) | (lengths[:-1] != width)
    starts = np.flatnonzero(brk)
    run_len = np.diff(np.append(starts, n))
    if (run_len > max_segments).any():
        # Cut long runs into pieces of max_segments.
        pieces = -(-run_len // max_segments)
        first = np.repeat(starts, pieces)
        step = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts = first + step * max_segments
    return starts


class DatagramSocket:
    """A connected non-blocking UDP socket that sends and receives batches of datagrams.

    rx_rows x rx_width: the receive rows (the largest datagram expected, and how many one
    drain takes). batched: sendmmsg/recvmmsg (default: where available); gso: try UDP GSO
    (default: only with THC_GSO=1, and where available). Errors from the kernel surface as OSError
    (ConnectionRefusedError for an ICMP port unreachable); a full send buffer waits.
    """

    def __init__(self, sock: socket.socket, *, rx_rows: int, rx_width: int,
                 batched: bool | None = None, gso: bool | None = None, rx_tos: bool = False):
        self.sock = sock
        self.sock.setblocking(False)
        self.batched = mmsg_available() if batched is None else bool(batched)
        self.gso = (gso_requested() if gso is None else bool(gso)) and self.batched \
            and gso_available()
        self.gso_segments = GSO_MAX_SEGMENTS
        self.tos = 0
        self.send_calls = 0              # syscalls
        self.send_messages = 0           # messages the kernel took (a GSO run is one)
        self.recv_calls = 0
        self.rx = np.zeros((rx_rows, rx_width), np.uint8)
        self.rx_len = np.zeros(rx_rows, np.int64)
        self._rx_views = [memoryview(row) for row in self.rx]
        self._rx_msgs = MessageArray(row_pointers(self.rx), np.full(rx_rows, rx_width),
                                     keep=self.rx)
        self.rx_tos = np.zeros(rx_rows, np.uint8)
        self.rx_truncated = 0            # datagrams longer than rx_width (cut, and so marked)
        self._rx_control = None
        if rx_tos:
            self.sock.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
            self._rx_control = np.zeros(rx_rows, CONTROL_DTYPE)
            self._rx_msgs.msgs["control"] = self._rx_control.ctypes.data + \
                np.arange(rx_rows, dtype=np.uint64) * np.uint64(CONTROL_DTYPE.itemsize)
            self._rx_msgs.msgs["controllen"] = CONTROL_DTYPE.itemsize

    def fileno(self) -> int:
        return self.sock.fileno()

    def path_mtu(self) -> int | None:
        """The MTU of the route to the connected peer (None where the kernel won't say)."""
        try:
            return self.sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
        except OSError:
            return None

    # ----------------------------------------------------------------- send

    def send(self, packets: PacketRows, rows) -> int:
        """Send packets.rows[rows] in order; returns the bytes sent (all of them)."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return 0
        tos = packets.tos[rows]
        uniform = bool((tos == tos[0]).all())
        if uniform and int(tos[0]) != self.tos:
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(tos[0]))
            self.tos = int(tos[0])
        lengths = packets.lengths[rows]
        if not self.batched:
            self._send_loop(packets, rows, lengths, None if uniform else tos)
        elif self.gso and len(rows) > 1:
            self._send_gso(packets, rows, lengths, tos, uniform)
        else:
            msgs = MessageArray(packets.pointers()[rows], lengths,
                                tos=None if uniform else tos, keep=packets.rows)
            self._sendmmsg_all(msgs)
        return int(lengths.sum())

    def _send_gso(self, packets, rows, lengths, tos, uniform) -> None:
        per_run = max(1, min(self.gso_segments, GSO_MAX_BYTES // packets.width))
        starts = _runs(rows, lengths, tos, packets.width, per_run)
        ends = np.append(starts[1:], len(rows))
        total = np.add.reduceat(lengths, starts)
        segment = np.where(ends - starts > 1, packets.width, 0)
        msgs = MessageArray(packets.pointers()[rows[starts]], total, segment=segment,
                            tos=None if uniform else tos[starts], keep=packets.rows)
        try:
            self._sendmmsg_all(msgs)
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOPROTOOPT,
                                 errno.EMSGSIZE) or isinstance(exc, ConnectionRefusedError):
                raise
            # This path cannot segment for us (no checksum offload, segment above the MTU,
            # an old kernel): send the rest one datagram each, and stop trying.
            self.gso = False
            done = int(msgs.sent_messages)
            rest = rows[starts[done]:] if done < len(starts) else rows[:0]
            msgs = MessageArray(packets.pointers()[rest], packets.lengths[rest],
                                tos=None if uniform else packets.tos[rest], keep=packets.rows)
            self._sendmmsg_all(msgs)

    def _sendmmsg_all(self, msgs: MessageArray) -> None:
        """sendmmsg until every message is out, waiting while the socket buffer is full.
        On an error, msgs.sent_messages says how many went out before it."""
        fd, pos, n = self.sock.fileno(), 0, len(msgs.msgs)
        msgs.sent_messages = 0
        while pos < n:
            self.send_calls += 1
            sent = _LIBC[0](fd, msgs.msgs[pos:].ctypes.data, n - pos, 0)
            if sent < 0:
                err = ctypes.get_errno()
                if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR):
                    self.wait_writable(0.05)
                    continue
                raise _os_error(err)
            pos += sent
            msgs.sent_messages = pos
            self.send_messages += sent

    def _send_loop(self, packets, rows, lengths, tos) -> None:
        for i, r in enumerate(rows.tolist()):
            view = memoryview(packets.rows[r, :lengths[i]])
            while True:
                try:
                    self.send_calls += 1
                    self.send_messages += 1
                    if tos is None:
                        self.sock.send(view)
                    else:
                        self.sock.sendmsg([view], [(socket.IPPROTO_IP, socket.IP_TOS,
                                                    struct.pack("i", int(tos[i])))])
                    break
                except (BlockingIOError, InterruptedError):
                    self.wait_writable(0.05)

    # ----------------------------------------------------------------- receive

    def receive(self) -> int:
        """Drain what is waiting (without blocking) into self.rx; how many datagrams.
        Their lengths are self.rx_len[:n] (and ToS bytes self.rx_tos[:n] with rx_tos)."""
        if self.batched:
            self.recv_calls += 1
            msgs = self._rx_msgs.msgs
            n = _LIBC[1](self.sock.fileno(), msgs.ctypes.data, len(self.rx),
                         MSG_DONTWAIT, None)
            if n < 0:
                err = ctypes.get_errno()
                if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                    return 0
                raise _os_error(err)
            self.rx_len[:n] = msgs["msg_len"][:n]
            self.rx_truncated += int(np.count_nonzero(msgs["flags"][:n] & MSG_TRUNC))
            if self._rx_control is not None:
                self._read_tos(n)
            return n
        n = 0
        cmsg_space = socket.CMSG_SPACE(4)
        while n < len(self.rx):
            try:
                self.recv_calls += 1
                if self._rx_control is None:
                    self.rx_len[n] = self.sock.recv_into(self._rx_views[n])
                else:
                    self.rx_len[n], anc, _, _ = self.sock.recvmsg_into([self._rx_views[n]],
                                                                       cmsg_space)
                    self.rx_tos[n] = anc[0][2][0] if anc and anc[0][2] else 0
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            n += 1
        return n

    def _read_tos(self, n: int) -> None:
        """The ToS byte of each of the n datagrams just received (0 where the kernel gave
        none), then room for the next call's control messages (the kernel shrinks it)."""
        msgs, ctl = self._rx_msgs.msgs, self._rx_control[:n]
        has = (msgs["controllen"][:n] >= CMSG_LEN_BYTE) & (ctl["level0"] == socket.IPPROTO_IP) \
            & (ctl["type0"] == socket.IP_TOS)
        first_byte = ctl.view(np.uint8).reshape(n, CONTROL_DTYPE.itemsize)[:, 16]
        self.rx_tos[:n] = np.where(has, first_byte, 0)
        msgs["controllen"][:n] = CONTROL_DTYPE.itemsize

    def wait_readable(self, timeout: float | None, also: int | None = None) -> bool:
        """Wait until a datagram is waiting (or `also`, another fd, is readable); None
        waits without a limit. True when the socket is readable."""
        fds = [self.sock] if also is None else [self.sock, also]
        try:
            readable, _, _ = select.select(fds, [], [], None if timeout is None
                                           else max(0.0, timeout))
        except InterruptedError:
            return False
        return self.sock in readable

    def wait_writable(self, timeout: float) -> None:
        try:
            select.select([], [self.sock], [], timeout)
        except InterruptedError:
            pass


def _os_error(err: int) -> OSError:
    """The OSError subclass Python would raise for errno `err`."""
    return OSError(err, os.strerror(err))
