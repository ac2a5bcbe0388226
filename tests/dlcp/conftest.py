"""Shared pieces for the DLCP tests: a real receiver and a hand-driven raw sender."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from host.dlcp.transport import (FIN_BODY, ID_BODY, MSG_FIN, MSG_FIN_CONFIRM, MSG_RETX_REQ,
                                 MSG_START, MSG_STOP, START_BODY, STOP_BODY, DlcpReceiver,
                                 FrameReader, encode_segments, frame, segment_count)


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
        self.pending: list[tuple[int, bytes]] = []

    def close(self) -> None:
        self.udp.close()
        self.ctrl.close()

    def start(self, tensor_id: int, num_values: int, p: float, stage: int = 0) -> None:
        n = segment_count(num_values, self.vps)
        self.ctrl.sendall(frame(MSG_START, START_BODY.pack(tensor_id, num_values, n, self.vps, p, stage)))
        self.settle()

    def datagrams(self, tensor_id: int, values: np.ndarray) -> list[bytes]:
        rows = encode_segments(tensor_id, values, self.vps)
        lengths = [16 + 4 * min(self.vps, values.size - k * self.vps) for k in range(len(rows))]
        return [rows[k, :lengths[k]].tobytes() for k in range(len(rows))]

    def send(self, datagram: bytes) -> None:
        self.udp.sendto(datagram, self.receiver.udp_addr)

    def stop(self, tensor_id: int) -> None:
        self.ctrl.sendall(frame(MSG_STOP, STOP_BODY.pack(tensor_id, 0)))

    def fin_confirm(self, tensor_id: int) -> None:
        self.ctrl.sendall(frame(MSG_FIN_CONFIRM, ID_BODY.pack(tensor_id)))

    def settle(self, until_udp: int | None = None, timeout: float = 2.0) -> None:
        """Give the receiver thread time to process what was sent (no data is lost on loopback)."""
        deadline = time.monotonic() + timeout
        if until_udp is None:
            time.sleep(0.02)
            return
        while self.receiver.data_packets + self.receiver.early_drops < until_udp:
            if time.monotonic() > deadline:
                raise TimeoutError("receiver did not process the datagrams")
            time.sleep(0.002)

    def messages(self, wait: float = 0.1) -> list[tuple[int, bytes]]:
        """Control messages from the receiver (rate reports filtered out)."""
        out = []
        deadline = time.monotonic() + wait     # rate reports keep coming: bound the wait
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.ctrl.settimeout(left)
                data = self.ctrl.recv(65536)
                if not data:
                    break
                out += [m for m in self.reader.feed(data) if m[0] in (MSG_FIN, MSG_RETX_REQ)]
        except socket.timeout:
            pass
        return out


@pytest.fixture
def raw_sender(receiver):
    s = RawSender(receiver)
    yield s
    s.close()


def fin_count(msgs) -> list[int]:
    return [FIN_BODY.unpack(b)[1] for t, b in msgs if t == MSG_FIN]


def retx_segments(msgs) -> list[list[int]]:
    return [np.frombuffer(b, ">u4", offset=4).tolist() for t, b in msgs if t == MSG_RETX_REQ]
