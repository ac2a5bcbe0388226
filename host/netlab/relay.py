"""A lossy UDP relay: forwards DLCP data datagrams to a receiver, dropping some of them.

Used by the tests (loss below/above the bound, drops of chosen segments) and by anyone
who wants loss on loopback without a network namespace. The drop decision sees the
parsed DLCP header, so tests can drop exact segments or only first transmissions.
"""
from __future__ import annotations

import socket
import struct
import threading
from typing import Callable

import numpy as np

from host.dlcp.transport import DATA_HEADER, DATA_HEADER_LEN, FLAG_RETX

# drop(tensor_id, offset, length, seq, flags) -> True to drop
DropRule = Callable[[int, int, int, int, int], bool]


def random_loss(rate: float, seed: int = 0, first_only: bool = False) -> DropRule:
    """Drop each datagram with probability `rate` (only first transmissions if first_only)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"loss rate {rate} must be in [0, 1]")
    rng = np.random.default_rng(seed)

    def rule(tid, offset, length, seq, flags):
        if first_only and flags & FLAG_RETX:
            return False
        return bool(rng.random() < rate)
    return rule


class LossyRelay:
    def __init__(self, target: tuple[str, int], drop: DropRule, host: str = "127.0.0.1") -> None:
        self.target = target
        self.drop = drop
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_RECVTOS", 13), 1)
        self.sock.bind((host, 0))
        self.sock.settimeout(0.05)
        self.addr = self.sock.getsockname()
        self.forwarded = 0
        self.dropped: list[tuple[int, int, int]] = []   # (tensor_id, offset, flags)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-relay", daemon=True)

    def __enter__(self) -> "LossyRelay":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def _run(self) -> None:
        out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        while not self._stop.is_set():
            try:
                data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(4))
            except socket.timeout:
                continue
            tos = anc[0][2][0] if anc else 0        # forwarded with the ToS it came with
            if len(data) >= DATA_HEADER_LEN:
                tid, offset, length, seq, flags, _ = DATA_HEADER.unpack_from(data, 0)
                if self.drop(tid, offset, length, seq, flags):
                    self.dropped.append((tid, offset, flags))
                    continue
            out.sendmsg([data], [(socket.IPPROTO_IP, socket.IP_TOS, struct.pack("i", tos))],
                        0, self.target)
            self.forwarded += 1
        out.close()
