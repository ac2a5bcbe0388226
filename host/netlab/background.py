"""Background load on the lab's links: paced UDP from a host namespace, for experiments
that measure a collective while other traffic shares its links."""
from __future__ import annotations

import socket
import time

from .links import enter_netns

DISCARD_PORT = 47400           # nothing listens: the datagrams only load the links and queues
BATCH_S = 0.001                # paced in 1 ms batches


def send_paced(ns: str, dst: str, pps: float, size: int, tos: int = 0,
               port: int = DISCARD_PORT) -> None:
    """Send pps datagrams/s of `size` bytes from namespace ns to dst with this IP TOS, until
    killed (run it as a process of its own: it enters the namespace)."""
    if pps <= 0 or size <= 0:
        raise ValueError(f"send_paced needs pps > 0 and size > 0, got {pps} and {size}")
    enter_netns(ns)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    payload = bytes(size)
    sent, t0 = 0, time.monotonic()
    while True:
        due = int((time.monotonic() - t0) * pps)
        for _ in range(due - sent):
            try:
                sock.sendto(payload, (dst, port))
            except OSError:           # a full socket buffer or an ICMP error: keep pacing
                pass
        sent = max(sent, due)
        time.sleep(BATCH_S)


def mbit_to_pps(mbit: float, size: int) -> float:
    """Datagrams/s of `size` UDP payload bytes that make mbit Mbit/s on the wire (IPv4 +
    UDP + Ethernet headers counted)."""
    return mbit * 1e6 / 8 / (size + 20 + 8 + 14)
