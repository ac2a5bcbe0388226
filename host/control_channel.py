"""THC's control exchanges over direct TCP connections: a MAX all_reduce of small tensors.

Every THC call starts with a control exchange (chunk 0's norms and the agreement fields),
and a long tensor's later chunks exchange their norms in groups: small MAX all_reduces on
THC's own process group, one to four per call. On gloo each is a chain of thread hand-offs
(the caller queues the work for gloo's worker thread, whose messages go through its TCP
loop thread). Four workers sharing two cores pay 5.8 ms and 2.2 ms of CPU per worker for
a MAX of 64 floats that way; here it costs 0.5 ms and 0.2 ms (docs/perf.md, "Control
exchanges without gloo").

`ControlChannel` connects every pair of the group's workers once, at THC's start. An
exchange is the calling thread sending its bytes to every peer and reducing what the peers
sent (numpy). TCP keeps each pair's messages in order and loses none, so an exchange is
matched by its sequence number alone, and a peer whose process exits closes its
connections: the wait fails at once, naming it, instead of running into the group's
timeout.

Only exchanges of at most MAX_BYTES on the CPU take this path; the caller keeps gloo for
anything else (`fits`). Both sides decide that from the tensor's size, which every worker
shares, so each exchange takes the same path on every worker.
"""
from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import select
import socket
import struct
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

MAX_BYTES = 1 << 16            # larger exchanges stay on gloo, made for them
SETUP_TIMEOUT = 30.0           # seconds to connect every pair, else gloo stays the channel
_MAGIC = 0x54484343            # "THCC"
_HEADER = struct.Struct("!IIQ")    # magic, sequence number (mod 2^32), payload bytes
_HELLO = struct.Struct("!QI")      # the set-up's token, the connecting worker's group rank
_DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32, torch.uint8)
_SIOCGIFADDR = 0x8915


class ControlChannelError(RuntimeError):
    """A control exchange failed: a peer closed its connection, sent what this worker did
    not expect (the workers' calls went out of step), or did not answer in time."""


class ControlWork:
    """One exchange in flight (the Work of an async all_reduce): wait() reduces into the
    tensor given to all_reduce_max."""

    def __init__(self, channel: "ControlChannel", seq: int, tensor: torch.Tensor):
        self._channel, self._seq, self._tensor = channel, seq, tensor
        self._done = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done:
            seconds = None if timeout is None else timeout.total_seconds()
            self._channel._complete(self._seq, self._tensor, seconds)
            self._done = True
        return True

    def done_within(self, seconds: float) -> bool:
        """Wait up to `seconds`: True once the exchange completed (as wait()), False if the
        peers have not all answered yet (wait again later; nothing is lost)."""
        if not self._done:
            if not self._channel._complete(self._seq, self._tensor, seconds, quiet=True):
                return False
            self._done = True
        return True


class ControlChannel:
    """MAX all_reduce of small CPU tensors among a process group's workers (module doc)."""

    def __init__(self, peers: dict[int, socket.socket], timeout: float):
        self.timeout = float(timeout)
        self.exchanges = 0
        self._peers = peers                         # group rank -> connected socket
        self._rank_of = {s.fileno(): r for r, s in peers.items()}
        self._buffers = {r: bytearray() for r in peers}
        self._next_from = dict.fromkeys(peers, 0)   # the sequence number each peer sends next
        self._inbox: dict[int, dict[int, bytes]] = {}   # seq -> peer -> payload
        self._sent = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._poll = select.poll()
        for s in peers.values():
            self._poll.register(s, select.POLLIN)

    # ------------------------------------------------------------------ set-up

    @classmethod
    def connect(cls, group=None, timeout: float = SETUP_TIMEOUT) -> "ControlChannel | None":
        """Collective: every worker of `group` calls it. Returns the channel, or None where
        it cannot serve every worker (not gloo, no TCP store to meet through, a pair that
        could not connect within `timeout` s): then every worker gets None and keeps gloo."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        exchange_timeout = _group_timeout(group)
        if world == 1:
            return cls({}, exchange_timeout)
        if dist.get_backend(group) != "gloo":
            return None
        store = dist.distributed_c10d._get_default_store()
        token = torch.randint(1, 1 << 62, (1,), dtype=torch.int64) if rank == 0 \
            else torch.zeros(1, dtype=torch.int64)
        dist.broadcast(token, src=dist.get_global_rank(group, 0) if group is not None else 0,
                       group=group)
        token = int(token.item())
        peers, failure = {}, None
        try:
            peers = _connect_pairs(dist.PrefixStore(f"thc-control/{token}/", store), token,
                                   rank, world, timeout)
        except (OSError, RuntimeError, ValueError) as exc:
            failure = exc
        ok = torch.tensor([0 if failure else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not ok.item():
            for s in peers.values():
                s.close()
            why = f"{type(failure).__name__}: {failure}" if failure else "on another worker"
            warnings.warn(f"THC: the control exchanges stay on gloo (slower): the workers "
                          f"could not connect to each other directly ({why}); set "
                          "GLOO_SOCKET_IFNAME to the interface the workers reach each "
                          "other on", RuntimeWarning, stacklevel=2)
            return None
        for s in peers.values():
            s.setblocking(False)     # a send that would block reads meanwhile (_send)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(peers, exchange_timeout)

    def close(self) -> None:
        for s in self._peers.values():
            try:
                s.close()
            except OSError:
                pass
        self._peers = {}

    # ---------------------------------------------------------------- exchanges

    @staticmethod
    def fits(tensor: torch.Tensor) -> bool:
        """Whether this exchange goes over the channel (the same answer on every worker,
        which holds a tensor of the same size and dtype)."""
        return (tensor.device.type == "cpu" and tensor.dtype in _DTYPES
                and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() <= MAX_BYTES)

    def all_reduce_max(self, tensor: torch.Tensor) -> ControlWork:
        """Send the tensor's values to every peer now; wait() on the result makes the
        tensor the elementwise MAX over every worker (NaN wins, as in numpy)."""
        if not self.fits(tensor):
            raise ValueError(f"ControlChannel: a contiguous CPU tensor of at most {MAX_BYTES} "
                             f"bytes of {[str(d) for d in _DTYPES]} expected, got "
                             f"{tensor.dtype} x {tensor.numel()} on {tensor.device}")
        payload = tensor.numpy().tobytes()
        with self._send_lock:
            seq = self._sent
            self._sent += 1
            message = _HEADER.pack(_MAGIC, seq & 0xFFFFFFFF, len(payload)) + payload
            for r in self._peers:
                self._send(r, memoryview(message))
        self.exchanges += 1
        return ControlWork(self, seq, tensor)

    def _send(self, r: int, message: memoryview) -> None:
        """All of message to peer r. Where its socket is full, read what the peers sent in
        the meantime: two workers sending each other more than their buffers hold, neither
        reading, would otherwise wait for each other for ever."""
        s = self._peers[r]
        deadline = time.monotonic() + self.timeout
        while message:
            try:
                message = message[s.send(message):]
                continue
            except BlockingIOError:
                pass
            except OSError as exc:
                raise _closed(r, exc) from exc
            if time.monotonic() > deadline:
                raise ControlChannelError(f"THC control exchange: worker {r} took nothing "
                                          f"for {self.timeout:.0f} s")
            if self._recv_lock.acquire(blocking=False):
                try:
                    self._drain(s, wait_ms=100)
                finally:
                    self._recv_lock.release()
            else:                    # another thread is reading: wait for room alone
                select.select([], [s], [], 0.1)

    def _complete(self, seq: int, tensor: torch.Tensor, timeout: float | None,
                  quiet: bool = False) -> bool:
        """Reduce exchange seq into tensor once every peer's part is in: True. Past the
        timeout, False when quiet, else a ControlChannelError."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._recv_lock:
            while True:
                got = self._inbox.get(seq, {})
                missing = [r for r in self._peers if r not in got]
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0 and quiet:
                    return False
                if left <= 0:
                    raise ControlChannelError(
                        f"THC control exchange {seq}: no answer from worker(s) {missing} "
                        f"within {self.timeout if timeout is None else timeout:g} s")
                self._drain(None, wait_ms=max(1, int(left * 1000)))
            got = self._inbox.pop(seq, {})
        out = tensor.numpy()
        for r in sorted(got):
            payload = got[r]
            if len(payload) != out.nbytes:
                raise ControlChannelError(
                    f"THC control exchange {seq}: worker {r} sent {len(payload)} bytes where "
                    f"this worker has {out.nbytes}: the workers' calls are out of step (every "
                    "worker must make the same THC calls in the same order)")
            np.maximum(out, np.frombuffer(payload, dtype=out.dtype).reshape(out.shape), out=out)
        return True

    def _drain(self, writable: socket.socket | None, wait_ms: int) -> None:
        """Wait up to wait_ms for data from any peer (or room in `writable`) and read what
        came. The caller holds the receive lock."""
        poll = self._poll
        if writable is not None:
            poll.modify(writable, select.POLLIN | select.POLLOUT)
        try:
            for fd, events in poll.poll(wait_ms):
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._read(self._rank_of[fd])
        finally:
            if writable is not None:
                poll.modify(writable, select.POLLIN)

    def _read(self, r: int) -> None:
        """What peer r sent, cut into its messages (kept by sequence number)."""
        try:
            data = self._peers[r].recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:       # a reset: it closed with data of ours unread
            raise _closed(r, exc) from exc
        if not data:
            raise _closed(r, None)
        buf = self._buffers[r]
        buf += data
        while len(buf) >= _HEADER.size:
            magic, seq, size = _HEADER.unpack_from(buf)
            expected = self._next_from[r]
            if magic != _MAGIC or seq != expected & 0xFFFFFFFF:
                raise ControlChannelError(
                    f"THC control exchange: worker {r} sent exchange {seq} where {expected} "
                    "was due: the workers' calls are out of step")
            if len(buf) < _HEADER.size + size:
                break
            self._inbox.setdefault(expected, {})[r] = bytes(buf[_HEADER.size:_HEADER.size + size])
            del buf[:_HEADER.size + size]
            self._next_from[r] = expected + 1


def _closed(r: int, exc: OSError | None) -> ControlChannelError:
    how = "" if exc is None else f" ({exc})"
    return ControlChannelError(f"THC control exchange: worker {r} closed its connection{how}: "
                               "its process has exited or closed THC")


def _connect_pairs(store, token: int, rank: int, world: int,
                   timeout: float) -> dict[int, socket.socket]:
    """One TCP connection per pair: each worker connects to the lower ranks and accepts
    the higher ones, which say who they are (and the set-up's token) first."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    peers: dict[int, socket.socket] = {}
    try:
        listener.bind(("0.0.0.0", 0))
        listener.listen(world)
        store.set(str(rank), f"{_advertised_address()}:{listener.getsockname()[1]}")
        store.wait([str(r) for r in range(rank)], datetime.timedelta(seconds=timeout))
        for r in range(rank):
            host, port = store.get(str(r)).decode().rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=timeout)
            peers[r] = s
            s.sendall(_HELLO.pack(token, rank))
        listener.settimeout(timeout)
        while len(peers) < world - 1:
            s, _ = listener.accept()
            s.settimeout(timeout)
            their_token, r = _HELLO.unpack(_recv_exactly(s, _HELLO.size))
            if their_token != token or not rank < r < world or r in peers:
                s.close()
                continue             # a stray connection, not one of this set-up's
            peers[r] = s
        return peers
    except BaseException:
        for s in peers.values():
            s.close()
        raise
    finally:
        listener.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = s.recv(n - len(data))
        if not more:
            raise OSError("the peer closed the connection during set-up")
        data += more
    return data


def _advertised_address() -> str:
    """The IPv4 address the other workers reach this one on: that of GLOO_SOCKET_IFNAME
    where set (the interface gloo uses too), else the source address of the route to the
    process group's TCP store, else the host name's."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("256s", ifname.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24])
    host = _store_host()
    if host is not None:
        address = socket.gethostbyname(host)
        if ipaddress.ip_address(address).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


def _store_host() -> str | None:
    store = dist.distributed_c10d._get_default_store()
    store = getattr(store, "_underlying_non_prefix_store", store)
    return getattr(store, "host", None)


def _group_timeout(group) -> float:
    """The process group's collective timeout in seconds (gloo's default: 30 min)."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 1800.0
