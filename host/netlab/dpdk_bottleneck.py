"""A live DLCP bottleneck on network namespaces, for the DPDK switch or the reference model.

Topology: one namespace per host (senders and one receiver), each joined to the root
namespace by a veth pair. The switch (``dataplane.dpdk_runner.LiveSwitch`` with
net_af_packet, or ``host.dlcp.switchbox``) owns the root-side ends; it answers no ARP,
so every host has a static neighbour entry for its gateway pointing at the switch MAC,
and the switch routes each host's /24 to that host's port (plain IPv4 forwarding, which
goes through the same DLCP egress stage as aggregation traffic, docs/protocol.md §6).

Probe traffic is plain UDP sent with a per-packet ToS byte (IP_TOS), so the senders are
the kernel's real UDP stack; the receiver captures whole frames with an AF_PACKET socket
to see the ToS byte and IPv4 checksum exactly as the switch left them.

``expected_paused`` is the §6 admission rule for a paused egress port (nothing leaves
until the input is in, then strict priority), the oracle the tests compare switches with.
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field

from dataplane.config import Dlcp, Route, SwitchConfig

CLONE_NEWNET = 0x40000000
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

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


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


class NetnsError(RuntimeError):
    """Setting up the namespaces failed; the message has the command and its error."""


def sh(*args: str) -> None:
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {res.stderr.strip() or res.returncode}")


def in_netns(ns: str, fn, *args):
    """fn(*args) run in network namespace `ns`; sockets it opens stay in that namespace.

    setns(CLONE_NEWNET) moves only the calling thread, so a short-lived thread does it
    and this process's other threads keep the root namespace.
    """
    box: dict = {}

    def run():
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = fn(*args)
        except BaseException as exc:        # handed to the caller below
            box["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass(frozen=True)
class Host:
    ns: str              # namespace name
    root_if: str         # veth end in the root namespace (a switch port)
    host_if: str         # veth end inside the namespace
    ip: str
    mac: str
    gateway: str         # next hop the host sends to: resolved statically to the switch MAC
    port: int            # switch port of root_if

    @property
    def prefix(self) -> str:
        return self.ip.rsplit(".", 1)[0] + ".0/24"


@dataclass
class NetnsTestbed:
    """num_senders sender namespaces and one receiver, switch ports 0..num_senders."""
    num_senders: int = 3
    switch_mac: str = "02:00:00:00:00:fe"
    tag: str = field(default_factory=lambda: f"dq{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)

    @property
    def senders(self) -> list[Host]:
        return self.hosts[:-1]

    @property
    def receiver(self) -> Host:
        return self.hosts[-1]

    def up(self) -> "NetnsTestbed":
        try:
            for port in range(self.num_senders + 1):
                self._add_host(port, 9 if port == self.num_senders else port + 1)
        except NetnsError:
            self.down()
            raise
        return self

    def _add_host(self, port: int, subnet: int) -> None:
        h = Host(ns=f"{self.tag}h{port}", root_if=f"{self.tag}p{port}", host_if=f"{self.tag}h{port}",
                 ip=f"10.77.{subnet}.2", mac=f"02:dd:00:00:{subnet:02x}:02",
                 gateway=f"10.77.{subnet}.1", port=port)
        self.hosts.append(h)
        sh("ip", "netns", "add", h.ns)
        sh("ip", "link", "add", h.root_if, "type", "veth", "peer", "name", h.host_if, "netns", h.ns)
        # No IPv6 anywhere: no router solicitations or DAD probes on the switch ports.
        sh("sysctl", "-q", "-w", f"net.ipv6.conf.{h.root_if}.disable_ipv6=1")
        ns = ("ip", "netns", "exec", h.ns)
        sh(*ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
        sh(*ns, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1")
        sh(*ns, "ip", "link", "set", h.host_if, "address", h.mac)
        sh(*ns, "ip", "addr", "add", f"{h.ip}/24", "dev", h.host_if)
        sh(*ns, "ip", "link", "set", "lo", "up")
        sh(*ns, "ip", "link", "set", h.host_if, "up")
        sh("ip", "link", "set", h.root_if, "up")
        sh(*ns, "ip", "neigh", "replace", h.gateway, "lladdr", self.switch_mac, "dev", h.host_if,
           "nud", "permanent")
        sh(*ns, "ip", "route", "add", "10.77.0.0/16", "via", h.gateway, "dev", h.host_if)

    def down(self) -> None:
        for h in self.hosts:
            subprocess.run(["ip", "link", "del", h.root_if], capture_output=True)
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
        self.hosts = []

    def switch_config(self, dlcp: Dlcp) -> SwitchConfig:
        routes = tuple(Route(h.prefix, h.port, h.mac) for h in self.hosts)
        return SwitchConfig(mac=self.switch_mac, routes=routes, dlcp=dlcp).validate()

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()


# ---------------------------------------------------------------------------- traffic

@dataclass(frozen=True)
class Probe:
    sender: int          # index into NetnsTestbed.senders
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
    if len(frame) < 42 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
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
