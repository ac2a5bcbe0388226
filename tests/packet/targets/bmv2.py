"""BMv2 (simple_switch_grpc running p4src/v1model) as a packet-suite target.

Set-up per start(): compile the P4 with p4c when the BMv2 JSON is missing or older than
the sources, create one veth pair per switch port (the switch end `tb<pid>s<port>` in
the root namespace, the test end in a private network namespace so nothing else talks
on it), start `simple_switch_grpc` (8 priority queues) on the switch ends
(dataplane.bmv2.switch: a switch that exits fails the start with its log), load the
pipeline and install the config with dataplane.bmv2.control, then inject and capture with raw
AF_PACKET sockets opened inside the namespace.

Paused ports (rate 0) are emulated with BMv2's rate limiter, whose rules are these
(behavioral-model `QueueingLogicPriRL`): each (port, priority) queue fixes a packet's
send time when it is enqueued, `max(now, last_sent + 1/rate)`, with `last_sent` starting
when the queue is first used; a rate change does not move packets already queued; the
dequeue takes the highest priority whose head is due. So a paused port gets no explicit
rate (every other port is made unlimited, and the default rate for queues not used yet
is PAUSE_RATE): its queues come into being with the burst's first packet, nothing leaves
for 1/PAUSE_RATE s while the burst arrives, then packet k of every queue is due k/PAUSE_RATE
s later. Two consequences, both documented BMv2 limits (p4src/v1model/README.md): the
drain serves packets in rounds (the k-th packet of every non-empty queue, by priority,
before any (k+1)-th), not strictly by priority across queues (`drain_order`), and one
start() allows one run() on a paused port (its queues' clocks do not restart).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import time

from dataplane.config import SwitchConfig
from dataplane.bmv2.switch import Bmv2Switch, compile_program, program_stale
from dataplane.bmv2.control import (BMV2_MAX_VALUES, BUILD_DIR, DEFAULT_BMV2_JSON, DEFAULT_P4INFO,
                            P4Controller, plan_switch)

from .base import Target

CLONE_NEWNET = 0x40000000
PACKET_OUTGOING = 4
PAUSE_RATE = 2                 # packets/s of a paused port's queues: the burst's budget is 1/rate
MIN_PORTS = 8
QUIET_S = 0.3                  # no frame for this long: the switch has emitted everything
DRAIN_SLACK_S = 1.0            # a paused queue's drain may lag its 1/PAUSE_RATE clock this much
LINK_MTU = 16000               # above the longest frame the suite sends (12000 bytes)


def available() -> tuple[bool, str]:
    if shutil.which("simple_switch_grpc") is None:
        return False, ("simple_switch_grpc is not on PATH (BMv2 is not packaged for this "
                       "environment; build p4lang/behavioral-model with --with-pi)")
    if program_stale() and shutil.which("p4c") is None:
        return False, f"p4c is not on PATH and {DEFAULT_BMV2_JSON} is missing or stale"
    if os.geteuid() != 0:
        return False, "needs root for veth pairs and a network namespace"
    try:
        import p4runtime_sh.shell  # noqa: F401
    except ImportError:
        return False, "p4runtime-shell is not installed (make venv)"
    return True, "simple_switch_grpc + P4Runtime"


class _InNamespace:
    """Run a block with this thread inside a network namespace (sockets made there stay)."""

    def __init__(self, name: str):
        self.path = f"/var/run/netns/{name}"
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _setns(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if self._libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns({path}) failed")
        finally:
            os.close(fd)

    def __enter__(self):
        self._home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        self._setns(self.path)
        return self

    def __exit__(self, *exc):
        try:
            if self._libc.setns(self._home_fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the root namespace failed")
        finally:
            os.close(self._home_fd)


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Bmv2Target(Target):
    name = "bmv2"
    max_values = BMV2_MAX_VALUES

    def __init__(self):
        tag = f"tb{os.getpid() % 100000}"
        self.netns = f"{tag}ns"
        self._tag = tag
        self._ports: list[int] = []
        self._sockets: dict[int, socket.socket] = {}
        self._switch: Bmv2Switch | None = None
        self._controller: P4Controller | None = None
        self._thrift_port = 0
        self._paused: list[int] = []
        self._rates: dict[int, float] = {}
        self._paused_runs = 0

    # -- set-up --
    def start(self, config: SwitchConfig, port_rates: dict[int, float] | None = None) -> None:
        plan_switch(config)            # refuses a bad config before anything is created
        compile_program()
        self._rates = {p: r for p, r in (port_rates or {}).items() if r is not None}
        if any(r < 0 for r in self._rates.values()):
            raise ValueError(f"service rates must be >= 0 packets/s, got {self._rates}")
        self._paused = [p for p, r in self._rates.items() if r == 0]
        ports = {m.port for j in config.jobs for m in j.members}
        ports |= {p for r in config.routes for p, _ in r.next_hops}
        ports |= set(self._rates)
        # every port up to the highest used (at least 8): scenarios also inject on
        # ports that no member owns (membership checks)
        self._ports = list(range(max(max(ports, default=0) + 1, MIN_PORTS)))
        try:
            self._make_links()
            self._start_switch()
            self._controller = P4Controller(f"127.0.0.1:{self._grpc_port}", timeout=20.0)
            self._controller.connect(DEFAULT_P4INFO, DEFAULT_BMV2_JSON)
            self._controller.install(config)
            self._configure_queues()
        except BaseException:
            self.stop()
            raise

    def _switch_if(self, port: int) -> str:
        return f"{self._tag}s{port}"

    def _host_if(self, port: int) -> str:
        return f"{self._tag}h{port}"

    def _make_links(self) -> None:
        _sh("ip", "netns", "add", self.netns)
        for port in self._ports:
            sw, host = self._switch_if(port), self._host_if(port)
            _sh("ip", "link", "add", sw, "type", "veth", "peer", "name", host)
            _sh("ip", "link", "set", host, "netns", self.netns)
            # no IPv6 chatter (router solicitations) that the switch would count as traffic
            _sh("sysctl", "-qw", f"net.ipv6.conf.{sw}.disable_ipv6=1", check=False)
            _sh("ip", "netns", "exec", self.netns, "sysctl", "-qw",
                f"net.ipv6.conf.{host}.disable_ipv6=1", check=False)
            # Frames over MAX_FRAME must reach the switch for it to count them
            # drop_oversize (protocol.md §4.1).
            _sh("ip", "link", "set", sw, "up", "mtu", str(LINK_MTU))
            _sh("ip", "netns", "exec", self.netns, "ip", "link", "set", host, "up", "mtu",
                str(LINK_MTU))
        with _InNamespace(self.netns):
            for port in self._ports:
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
                s.bind((self._host_if(port), 0))
                s.setblocking(False)
                self._sockets[port] = s

    def _start_switch(self) -> None:
        self._switch = Bmv2Switch({p: self._switch_if(p) for p in self._ports},
                                  BUILD_DIR / f"simple_switch_{self._tag}.log").start()
        self._grpc_port = self._switch.grpc_port
        self._thrift_port = self._switch.thrift_port

    def _configure_queues(self) -> None:
        """Queue depth everywhere; paused ports take the default rate of unused queues."""
        self._switch.set_queue_depth()
        self._paused_runs = 0
        if not self._paused:
            commands = [f"set_queue_rate {int(r)} {p}" for p, r in self._rates.items()]
        else:
            commands = [f"set_queue_rate {PAUSE_RATE}"]
            commands += [f"set_queue_rate {int(self._rates.get(p, 0))} {p}"
                         for p in self._ports if p not in self._paused]
        if commands:
            self._switch.cli(commands)

    drain_order = "rounds"             # see the module docstring: BMv2 rate-limiter drains

    # -- traffic --
    def run(self, frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        if self._switch is None:
            raise RuntimeError("run() before start()")
        if self._paused and self._paused_runs:
            raise RuntimeError("BMv2 target: a paused port allows one run() per start() "
                               "(its queues' send clocks do not restart; module docstring)")
        self._switch.check_alive("before run()")
        out: list[tuple[int, bytes]] = []
        for port, frame in frames:
            if port not in self._sockets:
                raise ValueError(f"port {port} is not a switch port of this config "
                                 f"(ports: {self._ports})")
            self._sockets[port].send(bytes(frame))
            out.extend(self._collect(0.0))
        if self._paused:
            self._paused_runs += 1
            early = [p for p, _ in out if p in self._paused]
            if early:
                raise RuntimeError(f"BMv2 target: paused port {early[0]} sent while the input "
                                   f"was still arriving (the burst took longer than "
                                   f"1/PAUSE_RATE = {1 / PAUSE_RATE} s); raise PAUSE_RATE's budget")
            out.extend(self._drain_paused())
        else:
            out.extend(self._collect(QUIET_S))
        return out

    def _drain_paused(self) -> list[tuple[int, bytes]]:
        """Wait until the paused ports' queues are empty. While any packet is queued, some
        packet of those queues passes the egress DLCP stage every 1/PAUSE_RATE s (sent or
        dropped there), so departures that stop growing for longer mean empty queues.
        Timed conservatively (a change counts from the end of the read that saw it, the
        silence up to the start of the read that still sees none) and with DRAIN_SLACK_S
        to spare: on a loaded machine BMv2's egress thread or a counter read can stall."""
        out, last_count, last_change = [], -1, time.monotonic()
        while True:
            out.extend(self._collect(0.0))
            asked = time.monotonic()
            count = sum(self._controller.port_departures(p) for p in self._paused)
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            elif asked - last_change > 1.0 / PAUSE_RATE + DRAIN_SLACK_S:
                return out + self._collect(QUIET_S)
            time.sleep(0.05)

    def _collect(self, quiet_s: float) -> list[tuple[int, bytes]]:
        """Read every frame the switch sent; wait until nothing came for quiet_s."""
        out, last = [], time.monotonic()
        while True:
            got = False
            for port, s in self._sockets.items():
                while True:
                    try:
                        frame, addr = s.recvfrom(65535)
                    except BlockingIOError:
                        break
                    if addr[2] == PACKET_OUTGOING:     # our own injected frame
                        continue
                    out.append((port, frame))
                    got = True
            if got:
                last = time.monotonic()
            elif time.monotonic() - last >= quiet_s:
                return out
            else:
                time.sleep(0.005)

    def counters(self) -> dict:
        if self._controller is None:
            raise RuntimeError("counters() before start()")
        return self._controller.counters()

    # -- tear-down --
    def stop(self) -> None:
        if self._controller is not None:
            try:
                self._controller.close()
            finally:
                self._controller = None
        for s in self._sockets.values():
            s.close()
        self._sockets.clear()
        if self._switch is not None:
            self._switch.stop()
            self._switch = None
        for port in self._ports:
            _sh("ip", "link", "del", self._switch_if(port), check=False)
        _sh("ip", "netns", "del", self.netns, check=False)


def make_target() -> Target:
    return Bmv2Target()
