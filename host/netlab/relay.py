"""A lossy UDP relay with drop rules, between clients and one target (an aggregator, a
DLCP receiver). Needs no privileges: it runs on loopback or inside a namespace.

Clients send to `relay.address`. Each datagram from a client leaves the relay from the
proxy socket of its member (`member_of(datagram)`; by default everything is member 0),
so the target still tells members apart by address: give the target
`relay.member_addresses[m]` as member m's (ip, udp_port). A reply to a proxy goes back to
the client that last sent through it. Every datagram keeps its ToS byte (DSCP and ECN
marks survive the relay).

A drop rule sees each datagram (`Datagram`: direction UP from client to target or DOWN
back, member, bytes) and returns True to drop it:

* `random_loss(up, down, seed)`: seeded random loss in both directions;
* `dlcp_loss(rate, seed, first_only)` and `dlcp_rule(fn)`: drops of DLCP DATA datagrams
  (host.dlcp.transport), chosen at random or by their header fields;
* `any_of(rule, ...)`: the first rule that drops wins (later ones are not asked);
* `agg_worker(data)`, `agg_chunk(data, ptype, vpp, tensor=None)`: the member and the
  chunk of an AGG datagram, for rules on the THC path.
"""
from __future__ import annotations

import select
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from host.dlcp.transport import DATA_HEADER, DATA_HEADER_LEN, FLAG_RETX
from host.packets import HEADER_LEN, decode_headers, header_types

UP, DOWN = "up", "down"
IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13)
AGG_WORKER_BYTE = 6            # the AGG header's worker field (docs/protocol.md §2)


@dataclass(frozen=True)
class Datagram:
    direction: str             # UP: client -> target; DOWN: target -> client
    member: int
    data: bytes


DropRule = Callable[[Datagram], bool]


def _check_rate(name: str, rate: float) -> float:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{name} {rate} must be in [0, 1]")
    return rate


def random_loss(up: float, down: float | None = None, seed: int = 0) -> DropRule:
    """Drop each datagram with probability `up` (UP) or `down` (DOWN, default: up); one
    seeded generator draws for both directions, in arrival order."""
    down = up if down is None else down
    rates = {UP: _check_rate("up loss", up), DOWN: _check_rate("down loss", down)}
    rng = np.random.default_rng(seed)
    return lambda d: bool(rng.random() < rates[d.direction])


def dlcp_rule(fn: Callable[[int, int, int, int, int], bool]) -> DropRule:
    """fn(tensor_id, offset, length, seq, flags) -> True to drop, asked for every DLCP
    DATA datagram going UP; nothing else is dropped."""
    def rule(d: Datagram) -> bool:
        if d.direction != UP or len(d.data) < DATA_HEADER_LEN:
            return False
        tid, offset, length, seq, flags, _ = DATA_HEADER.unpack_from(d.data, 0)
        return bool(fn(tid, offset, length, seq, flags))
    return rule


def dlcp_loss(rate: float, seed: int = 0, first_only: bool = False) -> DropRule:
    """Drop each DLCP DATA datagram with probability `rate` (only first transmissions if
    first_only)."""
    _check_rate("loss rate", rate)
    rng = np.random.default_rng(seed)

    def fn(tid, offset, length, seq, flags):
        if first_only and flags & FLAG_RETX:
            return False
        return rng.random() < rate
    return dlcp_rule(fn)


def dlcp_header(d: Datagram) -> tuple[int, int, int]:
    """(tensor_id, offset, flags) of a DLCP DATA datagram (one the relay dropped, say)."""
    tid, offset, _length, _seq, flags, _ = DATA_HEADER.unpack_from(d.data, 0)
    return tid, offset, flags


def any_of(*rules: DropRule) -> DropRule:
    return lambda d: any(rule(d) for rule in rules)


def agg_worker(data: bytes) -> int | None:
    """The member of an AGG datagram: its worker byte (None when too short)."""
    return data[AGG_WORKER_BYTE] if len(data) >= HEADER_LEN else None


def agg_chunk(data: bytes, ptype: int, values_per_packet: int,
              tensor: int | None = None) -> int | None:
    """The chunk of an AGG datagram of type `ptype` (and of `tensor`, when given): its
    offset over the values per packet; None for any other datagram."""
    if len(data) < HEADER_LEN:
        return None
    hdr = decode_headers([data])
    if header_types(hdr)[0] != ptype:
        return None
    if tensor is not None and int(hdr[0]["tensor"]) != tensor:
        return None
    return int(hdr[0]["offset"]) // values_per_packet


class LossyRelay:
    """target: (ip, port) the clients' datagrams go to (may be set later, `relay.target`);
    drop: a DropRule (None: drop nothing); members: how many proxy sockets; member_of:
    datagram -> member in 0..members-1 (None or out of range: counted and dropped)."""

    def __init__(self, target, drop: DropRule | None = None, *, members: int = 1,
                 member_of: Callable[[bytes], int | None] = lambda data: 0,
                 host: str = "127.0.0.1"):
        if members < 1:
            raise ValueError(f"members {members} must be at least 1")
        self.target = tuple(target)
        self.drop = drop or (lambda d: False)
        self.member_of = member_of
        self.front = self._socket(host)
        self.address = self.front.getsockname()
        self.proxies = [self._socket(host) for _ in range(members)]
        self.member_addresses = [p.getsockname() for p in self.proxies]
        self.dropped: list[Datagram] = []
        self.counters = {"up": 0, "down": 0, "dropped_up": 0, "dropped_down": 0,
                         "unknown_member": 0}
        self._clients: dict[int, tuple] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-relay", daemon=True)

    @staticmethod
    def _socket(host: str) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
        s.bind((host, 0))
        return s

    def start(self) -> "LossyRelay":
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop relaying and close the sockets; returns the counters."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for s in [self.front, *self.proxies]:
            s.close()
        return dict(self.counters)

    def __enter__(self) -> "LossyRelay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        member = {p.fileno(): m for m, p in enumerate(self.proxies)}
        sockets = [self.front, *self.proxies]
        while not self._stop.is_set():
            readable, _, _ = select.select(sockets, [], [], 0.05)
            for s in readable:
                try:
                    data, anc, _, source = s.recvmsg(65536, socket.CMSG_SPACE(4))
                except OSError:
                    continue
                tos = anc[0][2][0] if anc else 0
                if s is self.front:
                    self._up(data, tos, source)
                else:
                    self._down(data, tos, member[s.fileno()])

    def _up(self, data: bytes, tos: int, source) -> None:
        m = self.member_of(data)
        if m is None or not 0 <= m < len(self.proxies):
            self.counters["unknown_member"] += 1
            return
        self._clients[m] = source
        if self._dropped(Datagram(UP, m, data)):
            return
        self._send(self.proxies[m], data, tos, self.target)
        self.counters["up"] += 1

    def _down(self, data: bytes, tos: int, m: int) -> None:
        client = self._clients.get(m)
        if client is None or self._dropped(Datagram(DOWN, m, data)):
            return
        try:
            self._send(self.front, data, tos, client)
            self.counters["down"] += 1
        except OSError:
            pass                               # the client is gone

    def _dropped(self, d: Datagram) -> bool:
        if not self.drop(d):
            return False
        self.dropped.append(d)
        self.counters[f"dropped_{d.direction}"] += 1
        return True

    @staticmethod
    def _send(sock: socket.socket, data: bytes, tos: int, to) -> None:
        sock.sendmsg([data], [(socket.IPPROTO_IP, socket.IP_TOS, struct.pack("i", tos))], 0, to)
