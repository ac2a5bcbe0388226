"""BMv2 (simple_switch_grpc running p4src/v1model) as a packet-suite target.

Set-up per start(): compile the P4 with p4c when the BMv2 JSON is missing or older than
the sources, create one veth pair per switch port (the switch end `tb<pid>s<port>` in
the root namespace, the test end in a private network namespace so nothing else talks
on it), start `simple_switch_grpc` (8 priority queues) on the switch ends
(host.bmv2_switch: a switch that exits fails the start with its log), load the
pipeline and install the config with host.p4control, then inject and capture with raw
AF_PACKET sockets opened inside the namespace.

Paused ports (rate 0) are emulated with BMv2 queue rates: 1 packet/s on the port while
the input arrives, then a high rate to drain in strict priority order. BMv2 lets the
first packet of an idle queue leave at once, so on paused ports one packet per queue can
leave before the rest of the input arrived (README of p4src/v1model, "Deviations").
"""
from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import time

from dataplane.config import SwitchConfig
from host.bmv2_switch import Bmv2Switch, compile_program, program_stale
from host.p4control import (BMV2_MAX_VALUES, BUILD_DIR, DEFAULT_BMV2_JSON, DEFAULT_P4INFO,
                            P4Controller, plan_switch)

from .base import Target

CLONE_NEWNET = 0x40000000
PACKET_OUTGOING = 4
QUEUE_DEPTH = 1024             # at least; always above the DLCP capacity (see _configure_queues)
DRAIN_RATE = 100000            # packets/s once a paused port is released
MIN_PORTS = 8
QUIET_S = 0.3                  # no frame for this long: the switch has emitted everything


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
        self._queue_depth = QUEUE_DEPTH

    # -- set-up --
    def start(self, config: SwitchConfig, port_rates: dict[int, float] | None = None) -> None:
        plan_switch(config)            # refuses a bad config before anything is created
        compile_program()
        # above the DLCP capacity, so BMv2 never tail-drops what the DLCP stage admitted
        self._queue_depth = max(QUEUE_DEPTH, config.dlcp.capacity + 1)
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
            _sh("ip", "link", "set", sw, "up", "mtu", "9000")
            _sh("ip", "netns", "exec", self.netns, "ip", "link", "set", host, "up", "mtu", "9000")
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

    def _cli(self, commands: list[str]) -> None:
        proc = subprocess.run(["simple_switch_CLI", "--thrift-port", str(self._thrift_port)],
                              input="\n".join(commands) + "\n", capture_output=True, text=True)
        if proc.returncode != 0 or "Error" in proc.stdout:
            raise RuntimeError(f"simple_switch_CLI failed: {proc.stdout}{proc.stderr}")

    def _configure_queues(self) -> None:
        commands = [f"set_queue_depth {self._queue_depth}"]
        for port, rate in self._rates.items():
            commands.append(f"set_queue_rate {1 if rate == 0 else int(rate)} {port}")
        self._cli(commands)

    # -- traffic --
    def run(self, frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        if self._switch is None:
            raise RuntimeError("run() before start()")
        out: list[tuple[int, bytes]] = []
        for port, frame in frames:
            if port not in self._sockets:
                raise ValueError(f"port {port} is not a switch port of this config "
                                 f"(ports: {self._ports})")
            self._sockets[port].send(bytes(frame))
            out.extend(self._collect(0.0))
        out.extend(self._collect(QUIET_S))
        if self._paused:
            self._cli([f"set_queue_rate {DRAIN_RATE} {p}" for p in self._paused])
            out.extend(self._collect(QUIET_S))
            self._cli([f"set_queue_rate 1 {p}" for p in self._paused])
        return out

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
