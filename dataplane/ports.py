"""Free ports for a job's members, its store and its rendezvous, on one machine.

A port is picked below the kernel's ephemeral range and checked free for both TCP and UDP.
A port the kernel hands out for bind(0) lies inside that range, so any outgoing connection
(a store client, gloo's pairs, the control channel) may take it between the check and the
moment its user binds it: the rendezvous then fails with EADDRINUSE. Below the range only an
explicit bind can take it.
"""
from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000
_handed_out: set[int] = set()
_rng = random.SystemRandom()      # forked processes must not draw the same sequence


def _ephemeral_low() -> int:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                        # Linux's default


def _is_free(host: str, port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _kernel_pick(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port free for TCP and UDP on `host` now, not handed out before by this process, and
    outside the ephemeral range where the machine leaves room for that (else the kernel's)."""
    low = _ephemeral_low()
    if low - LOWEST_PORT >= 1000:
        for _ in range(tries):
            port = _rng.randrange(LOWEST_PORT, low)
            if port not in _handed_out and _is_free(host, port):
                _handed_out.add(port)
                return port
    for _ in range(tries):
        port = _kernel_pick(host)
        if port not in _handed_out and _is_free(host, port):
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host} after {2 * tries} tries")
