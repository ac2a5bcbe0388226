"""Shared pieces for the DLCP tests: a real receiver and a hand-driven raw sender."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from host.dlcp.transport import (END_BODY, MSG_ANNOUNCE, MSG_END, MSG_STATUS, DlcpReceiver,
                                 FrameReader, TensorAnnouncement, announce_body, encode_segments,
                                 frame, parse_status, segment_count)


@pytest.fixture
def receiver():
    # stop_drain_s: the in-process Python relay can lag the control channel by ms
    with DlcpReceiver(report_period_s=0.001, stop_drain_s=0.05) as r:
        yield r


class RawSender:
    """Drives the receiver datagram by datagram over real sockets (for exact-arrival tests)."""

    def __init__(self, receiver: DlcpReceiver, vps: int = 10) -> None:
        self.receiver = receiver
        self.vps = vps
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.ctrl = socket.create_connection(receiver.tcp_addr, timeout=5)
        self.ctrl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # no Nagle hold-back
        self.reader = FrameReader()

    def close(self) -> None:
        self.udp.close()
        self.ctrl.close()

    def announce(self, tensors: list[tuple[int, int, float]], stage: int = 0) -> int:
        """ANNOUNCE an iteration of (tensor_id, num_values, p); returns its key."""
        entries = [TensorAnnouncement(tid, n, segment_count(n, self.vps), self.vps, p, stage)
                   for tid, n, p in tensors]
        self.ctrl.sendall(frame(MSG_ANNOUNCE, announce_body(tensors[0][0], entries)))
        self.settle()
        return tensors[0][0]

    def start(self, tensor_id: int, num_values: int, p: float, stage: int = 0) -> int:
        return self.announce([(tensor_id, num_values, p)], stage)

    def datagrams(self, tensor_id: int, values: np.ndarray) -> list[bytes]:
        rows = encode_segments(tensor_id, values, self.vps)
        lengths = [16 + 4 * min(self.vps, values.size - k * self.vps) for k in range(len(rows))]
        return [rows[k, :lengths[k]].tobytes() for k in range(len(rows))]

    def send(self, datagram: bytes) -> None:
        self.udp.sendto(datagram, self.receiver.udp_addr)

    def end(self, key: int, sent: int = 0) -> None:
        """END of a round; sent = 0 leaves the receiver to its drain clock."""
        self.ctrl.sendall(frame(MSG_END, END_BODY.pack(key, sent)))

    def settle(self, until_udp: int | None = None, timeout: float = 2.0) -> None:
        """Give the receiver thread time to process what was sent (no data is lost on loopback)."""
        deadline = time.monotonic() + timeout
        if until_udp is None:
            time.sleep(0.02)
            return
        r = self.receiver
        while r.data_packets + r.early_drops + r.late_packets < until_udp:
            if time.monotonic() > deadline:
                raise TimeoutError("receiver did not process the datagrams")
            time.sleep(0.002)

    def messages(self, wait: float = 0.1) -> list[tuple[bool, dict]]:
        """STATUS messages from the receiver as (done, {tensor: (received, missing)})."""
        out = []
        deadline = time.monotonic() + wait     # rate reports keep coming: bound the wait
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.ctrl.settimeout(left)
                data = self.ctrl.recv(65536)
                if not data:
                    break
                out += [parse_status(b)[1:] for t, b in self.reader.feed(data) if t == MSG_STATUS]
        except socket.timeout:
            pass
        return out


@pytest.fixture
def raw_sender(receiver):
    s = RawSender(receiver)
    yield s
    s.close()


def fin_count(msgs, tensor_id: int | None = None) -> list[int]:
    """Segments received, per STATUS(done), of tensor_id (default: the only one)."""
    out = []
    for done, entries in msgs:
        if done:
            tid = tensor_id if tensor_id is not None else next(iter(entries))
            out.append(entries[tid][0])
    return out


def retx_segments(msgs, tensor_id: int | None = None) -> list[list[int]]:
    """Missing segments asked for, per STATUS that is not done, of tensor_id (default: the
    only tensor that has any)."""
    out = []
    for done, entries in msgs:
        if done:
            continue
        asked = {tid: m.tolist() for tid, (_, m) in entries.items() if len(m)}
        out.append(asked.get(tensor_id, []) if tensor_id is not None
                   else next(iter(asked.values()), []))
    return out
