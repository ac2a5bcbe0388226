"""Probe traffic for a live DLCP bottleneck: senders, a capture, and the §6 oracle.

The bottleneck itself is a `host.netlab.topology.Topology` in the "routed" layout: one
namespace per host (senders and one receiver), each joined to the root namespace by a
veth pair whose root end is a port of the switch (``dataplane.dpdk_runner.LiveSwitch``
with net_af_packet, or ``host.dlcp.switchbox``), which routes each host's /24 to its
port (plain IPv4 forwarding, which goes through the same DLCP egress stage as
aggregation traffic, docs/protocol.md §6).

Probe traffic is plain UDP sent with a per-packet ToS byte (IP_TOS), so the senders are
the kernel's real UDP stack; the receiver captures whole frames with an AF_PACKET socket
to see the ToS byte and IPv4 checksum exactly as the switch left them.

``expected_paused`` is the §6 admission rule for a paused egress port (nothing leaves
until the input is in, then strict priority), the oracle the tests compare switches with.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass

from dataplane.wire import L2L4_LEN
from dataplane.config import Dlcp
from host.netlab.links import in_netns
from host.netlab.topology import Host

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
PROBE_MAGIC = b"DLQP"
# magic | sender u8 | seq u32 | tos u8 (as sent), then padding
PROBE_HEADER = struct.Struct("!4sBIB")
PROBE_PORT = 47000
ECN_CE = 0x03
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
TIMESPEC = struct.Struct("@qq")
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)   # root may exceed rmem_max


def live_switch_skip_reason() -> str | None:
    """Why the live DPDK-switch tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, AF_PACKET, DPDK EAL)"
    try:
        from dataplane import dpdk_runner
    except ImportError as exc:
        return f"dataplane.dpdk_runner not importable: {exc}"
    if not dpdk_runner.SWITCH_BIN.exists():
        ok, why = dpdk_runner.available()          # builds it when DPDK is installed
        if not ok:
            return f"DPDK switch not built ({dpdk_runner.SWITCH_BIN}): {why}"
    return None


# ---------------------------------------------------------------------------- traffic

@dataclass(frozen=True)
class Probe:
    sender: int          # index into Topology.senders
    seq: int             # unique over the whole offered sequence
    dscp: int
    ecn: int

    @property
    def tos(self) -> int:
        return (self.dscp << 2) | self.ecn


def probe_payload(p: Probe, size: int = 200) -> bytes:
    head = PROBE_HEADER.pack(PROBE_MAGIC, p.sender, p.seq, p.tos)
    return head + bytes(size - len(head))


def open_sender(host: Host) -> socket.socket:
    def make():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((host.ip, PROBE_PORT))
        return s
    return in_netns(host.ns, make)


def send_probes(sock: socket.socket, dst_ip: str, probes: list[Probe]) -> None:
    """One datagram per probe, in order, each with its own ToS byte (the kernel keeps
    the ECN bits of IP_TOS on UDP sockets)."""
    for p in probes:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, p.tos)
        sock.sendto(probe_payload(p), (dst_ip, PROBE_PORT))


@dataclass(frozen=True)
class Received:
    sender: int
    seq: int
    sent_tos: int
    tos: int             # as it arrived
    checksum_ok: bool    # IPv4 header checksum of the arrived frame
    stamp: float = 0.0   # kernel receive time (CLOCK_REALTIME), seconds


def ipv4_checksum_ok(header: bytes) -> bool:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total == 0xFFFF


def parse_probe(frame: bytes, stamp: float = 0.0) -> Received | None:
    if len(frame) < L2L4_LEN or frame[12:14] != b"\x08\x00" or frame[23] != 17:
        return None
    ihl = (frame[14] & 0x0F) * 4
    udp = 14 + ihl
    if int.from_bytes(frame[udp + 2:udp + 4], "big") != PROBE_PORT:
        return None
    payload = frame[udp + 8:udp + 8 + PROBE_HEADER.size]
    if len(payload) < PROBE_HEADER.size:
        return None
    magic, sender, seq, sent_tos = PROBE_HEADER.unpack(payload)
    if magic != PROBE_MAGIC:
        return None
    return Received(sender, seq, sent_tos, frame[15], ipv4_checksum_ok(frame[14:14 + ihl]), stamp)


def _kernel_stamp(ancillary) -> float:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = TIMESPEC.unpack(data[:TIMESPEC.size])
            return sec + nsec * 1e-9
    return time.time()


class Capture:
    """Every probe frame arriving on the receiver's interface, in arrival order."""

    def __init__(self, host: Host):
        def make():
            raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            raw.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
            raw.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            raw.bind((host.host_if, 0))
            # A bound UDP socket, so the kernel answers no ICMP port unreachable.
            sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sink.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
            sink.bind((host.ip, PROBE_PORT))
            return raw, sink
        self.raw, self.sink = in_netns(host.ns, make)
        self.raw.settimeout(0.05)
        self.received: list[Received] = []

    def collect(self, count: int, timeout: float, quiet_s: float = 0.3) -> list[Received]:
        """Until `count` probes are in (then quiet_s more, to catch extras) or timeout."""
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < deadline:
            if len(self.received) >= count and time.monotonic() - last > quiet_s:
                break
            try:
                frame, anc, _flags, addr = self.raw.recvmsg(65535, socket.CMSG_SPACE(TIMESPEC.size))
            except socket.timeout:
                continue
            if addr[2] == PACKET_OUTGOING:
                continue
            probe = parse_probe(frame, _kernel_stamp(anc))
            if probe is not None:
                self.received.append(probe)
                last = time.monotonic()
        return self.received

    def close(self) -> None:
        self.raw.close()
        self.sink.close()


# ---------------------------------------------------------------------------- oracle

@dataclass(frozen=True)
class Outcome:
    probe: Probe
    queue: int
    occupancy: int       # packets already in its (port, queue) when it arrived
    verdict: str         # "pass", "ce" (marked), "ect_above" (already CE), "selective", "buffer"

    @property
    def delivered(self) -> bool:
        return self.verdict in ("pass", "ce", "ect_above")


def expected_paused(offered: list[Probe], dlcp: Dlcp) -> tuple[list[Outcome], list[Outcome]]:
    """§6 admission at a paused port: (outcome of every probe in arrival order,
    the delivered ones in departure order: queue 7 first, FIFO within a queue)."""
    depth = [0] * len(dlcp.thresholds)
    outcomes, queues = [], [[] for _ in dlcp.thresholds]
    for p in offered:
        queue, is_data = dlcp.classify(p.dscp)
        occ = depth[queue]
        if occ >= dlcp.capacity:
            verdict = "buffer"
        elif is_data and occ > dlcp.thresholds[queue]:
            verdict = "selective" if p.ecn == 0 else ("ect_above" if p.ecn == ECN_CE else "ce")
        else:
            verdict = "pass"
        o = Outcome(p, queue, occ, verdict)
        outcomes.append(o)
        if o.delivered:
            depth[queue] += 1
            queues[queue].append(o)
    departures = [o for q in reversed(queues) for o in q]
    return outcomes, departures


def verdict_counts(outcomes: list[Outcome]) -> dict[str, int]:
    """The switch counters these outcomes should produce (names as in §4.5)."""
    return {"dlcp_selective_drop": sum(o.verdict == "selective" for o in outcomes),
            "dlcp_ce_marked": sum(o.verdict == "ce" for o in outcomes),
            "dlcp_buffer_drop": sum(o.verdict == "buffer" for o in outcomes)}
