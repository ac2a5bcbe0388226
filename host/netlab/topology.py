"""One network topology on namespaces and veth links, in three layouts (root).

Every host is a network namespace whose interface `eth0` is one end of a veth pair; the
other end (`Host.switch_if`) is what the switch sees:

* "bridge": the switch ends join a Linux bridge in a switch namespace, which owns
  `switch_ip` (an aggregator bound there models in-network aggregation: its traffic
  crosses only the hosts' links). Host i is 10.<subnet>.0.(i+1).
* "ports": the switch ends stay bare in the switch namespace, switch port i = host i's
  link, for a data plane process to attach to (the DPDK switch with net_af_packet).
  Hosts reach `switch_ip` through a static neighbour entry (`switch_mac`); they talk to
  each other (process group, barriers) over an unshaped control network, `control_ip(i)`
  on each host's `ctl0`. UDP GSO super-datagrams are cut at the host's own end (`gso` is
  False where that failed: send without GSO there).
* "routed": the switch ends are in the root namespace (a live switch there, DPDK or
  host.dlcp.switchbox, routes IPv4); host i has its own /24 (10.<subnet>.<net>.2, the
  last host, `receiver`, on net 9), a static neighbour entry for its gateway (.1) at
  `switch_mac`, and a route to 10.<subnet>.0.0/16 through it (with rto_min_ms if given).
  `switch_config(dlcp)` routes each /24 to its host's port.

rate_mbit shapes every data link in both directions (netem, or tbf where the kernel has
no netem; host.netlab.links.shape); None leaves links unshaped. rate_mbit and delay_ms may
also be lists, one entry per host (heterogeneous links: host i's link gets rate_mbit[i],
delay_ms[i]); `set_rate(i, mbit)` re-shapes host i's link while the topology is up (load
that changes during a run). offloads=False gives plain frames with full checksums on both
ends (a packet-socket switch takes no super-frames).
Every link is quiet (no IPv6, host.netlab.links). `up()` (or `with`) builds it; `down()`
removes every namespace and link it made, also on an error while building, at exit,
and on SIGTERM (a handler is installed while a topology is up in the main thread).
"""
from __future__ import annotations

import atexit
import re
import shutil
import signal
import subprocess
import threading
import uuid
from dataclasses import dataclass
from typing import Sequence

from dataplane.config import Dlcp, Route, SwitchConfig
from host.netlab.links import (NetnsError, add_bridge, add_netns, add_veth, cut_udp_gso,
                               del_link, del_netns, disable_offloads, netns_argv, sh, shape,
                               static_neighbour)

LAYOUTS = ("bridge", "ports", "routed")
SWITCH_MAC = "02:00:00:00:00:fe"
RECEIVER_NET = 9               # routed: the receiver's /24 is 10.<subnet>.9.0
TAG_RE = re.compile(r"^[a-z0-9]{1,8}$")


@dataclass(frozen=True)
class Host:
    index: int
    ns: str                    # its network namespace
    ip: str
    mac: str
    switch_if: str             # the other end of its link: a bridge member or a switch port
    port: int                  # switch port of switch_if (= index)
    host_if: str = "eth0"      # its end of the link, inside ns
    gateway: str | None = None         # routed: next hop, resolved statically to switch_mac
    control_ip: str | None = None      # ports: address on the unshaped control network

    @property
    def prefix(self) -> str:
        return self.ip.rsplit(".", 1)[0] + ".0/24"


class Topology:
    """num_hosts host namespaces linked to a switch in one of LAYOUTS (see the module doc)."""

    def __init__(self, num_hosts: int, rate_mbit: float | Sequence[float] | None = None, *,
                 layout: str = "bridge", delay_ms: float | Sequence[float] = 0.0,
                 loss: float = 0.0,
                 mtu: int = 1500, subnet: int = 77, tag: str | None = None,
                 offloads: bool = True, rto_min_ms: float | None = None):
        self._check(num_hosts, rate_mbit, layout, delay_ms, loss, mtu, subnet, tag)
        self.num_hosts, self.rate_mbit, self.layout = num_hosts, rate_mbit, layout
        self.delay_ms, self.loss, self.mtu, self.subnet = delay_ms, loss, mtu, subnet
        self.offloads, self.rto_min_ms = offloads, rto_min_ms
        self.rates = _per_host(rate_mbit, num_hosts)     # host i's link rate (None: unshaped)
        self.delays = _per_host(delay_ms, num_hosts)
        self.tag = tag or uuid.uuid4().hex[:6]
        self.switch_mac = SWITCH_MAC
        self.switch_ns = None if layout == "routed" else f"nl{self.tag}sw"
        self.switch_ip = None if layout == "routed" else f"10.{subnet}.0.254"
        self.qdisc = None      # the shaping qdisc in use ("netem" or "tbf"), once up
        self.gso = True        # ports: False when UDP GSO could not be cut at a host
        self.hosts = [self._plan(i) for i in range(num_hosts)]
        self._namespaces: list[str] = []
        self._root_links: list[str] = []

    @staticmethod
    def _check(num_hosts, rate_mbit, layout, delay_ms, loss, mtu, subnet, tag) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: choose 'bridge' (a Linux bridge), 'ports' "
                             "(bare switch ports for a data plane process) or 'routed' "
                             "(switch ports in the root namespace, one /24 per host)")
        lowest = 2 if layout == "routed" else 1
        if not lowest <= num_hosts <= 200:
            raise ValueError(f"num_hosts {num_hosts} must be in {lowest}..200"
                             + (" (senders and one receiver)" if layout == "routed" else ""))
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu {mtu} must be in 576..65535 (9000 for jumbo frames)")
        rates, delays = _per_host(rate_mbit, num_hosts), _per_host(delay_ms, num_hosts)
        if rate_mbit is not None and not all(r is not None and r > 0 for r in rates):
            raise ValueError("rate_mbit must be positive (None: unshaped links)")
        if rate_mbit is None and (any(delays) or loss):
            raise ValueError("delay_ms and loss shape the links: give rate_mbit too")
        if any(d is None or d < 0 for d in delays):
            raise ValueError("delay_ms must be >= 0")
        if not 0 <= subnet <= 254:
            raise ValueError(f"subnet {subnet} must be in 0..254 (10.<subnet>.x.y)")
        if tag is not None and not TAG_RE.match(tag):
            raise ValueError(f"tag {tag!r}: 1..8 lower-case letters or digits (interface "
                             "names are at most 15 characters)")
        if shutil.which("ip") is None:
            raise NetnsError("iproute2 (ip, tc) is not installed: apt-get install iproute2")

    def _plan(self, i: int) -> Host:
        ns, switch_if = f"nl{self.tag}h{i}", f"nl{self.tag}p{i}"
        if self.layout == "routed":
            net = RECEIVER_NET if i == self.num_hosts - 1 and i < RECEIVER_NET else i + 1
            return Host(i, ns, f"10.{self.subnet}.{net}.2", f"02:dd:00:00:{net:02x}:02",
                        switch_if, i, gateway=f"10.{self.subnet}.{net}.1")
        return Host(i, ns, f"10.{self.subnet}.0.{i + 1}",
                    f"02:00:00:{self.subnet:02x}:00:{i + 1:02x}", switch_if, i,
                    control_ip=(f"10.{self.subnet + 1}.0.{i + 1}"
                                if self.layout == "ports" else None))

    # ----------------------------------------------------------------- addresses
    def host_ip(self, i: int) -> str:
        return self.hosts[i].ip

    def host_mac(self, i: int) -> str:
        return self.hosts[i].mac

    def control_ip(self, i: int) -> str:
        """ports: host i on the unshaped control network (process group, barriers)."""
        if self.layout != "ports":
            raise ValueError(f"the {self.layout} layout has no control network (use host_ip)")
        return self.hosts[i].control_ip

    def link_rate(self, i: int) -> float | None:
        """Host i's link rate in Mbit/s now (None: unshaped)."""
        return self.rates[i]

    def switch_port(self, i: int) -> str:
        """The interface the switch sees of host i's link (switch port i)."""
        return self.hosts[i].switch_if

    @property
    def host_ns(self) -> list[str]:
        return [h.ns for h in self.hosts]

    @property
    def senders(self) -> list[Host]:
        """routed: every host but the last."""
        return self.hosts[:-1]

    @property
    def receiver(self) -> Host:
        """routed: the last host."""
        return self.hosts[-1]

    def switch_config(self, dlcp: Dlcp) -> SwitchConfig:
        """routed: a switch configuration routing each host's /24 to its port."""
        routes = tuple(Route(h.prefix, h.port, h.mac) for h in self.hosts)
        return SwitchConfig(mac=self.switch_mac, routes=routes, dlcp=dlcp).validate()

    # ----------------------------------------------------------------- processes
    def popen(self, i: int, argv, **kwargs) -> subprocess.Popen:
        """argv run in host i's namespace."""
        return subprocess.Popen(netns_argv(self.hosts[i].ns, argv), **kwargs)

    def popen_switch(self, argv, **kwargs) -> subprocess.Popen:
        """argv run where the switch ends are (the root namespace in the routed layout)."""
        return subprocess.Popen(netns_argv(self.switch_ns, argv), **kwargs)

    # ----------------------------------------------------------------- life cycle
    def __enter__(self) -> "Topology":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "Topology":
        _track(self)                     # from here on, SIGTERM and exit tear it down
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove everything `up` made; safe to call twice."""
        for dev in reversed(self._root_links):
            del_link(dev)
        for ns in reversed(self._namespaces):
            del_netns(ns)
        self._root_links.clear()
        self._namespaces.clear()
        _untrack(self)

    def _build(self) -> None:
        if self.switch_ns:
            add_netns(self.switch_ns)
            self._namespaces.append(self.switch_ns)
            # bridge: br0 joins the host links; ports: br0 is the control network only
            add_bridge("br0", self.switch_ns, self.mtu if self.layout == "bridge" else None)
            if self.layout == "bridge":
                sh("ip", "addr", "add", f"{self.switch_ip}/24", "dev", "br0", ns=self.switch_ns)
        for h in self.hosts:
            self._add_host(h)

    def _add_host(self, h: Host) -> None:
        sw = self.switch_ns
        add_netns(h.ns)
        self._namespaces.append(h.ns)
        add_veth(f"nl{self.tag}h{h.index}", h.switch_if, ns_a=h.ns, ns_b=sw,
                 name_a=h.host_if, mac_a=h.mac, mtu=self.mtu)
        if sw is None:
            self._root_links.append(h.switch_if)   # deleted first: a held namespace lingers
        sh("ip", "addr", "add", f"{h.ip}/24", "dev", h.host_if, ns=h.ns)
        if self.layout == "bridge":
            sh("ip", "link", "set", h.switch_if, "master", "br0", ns=sw)
        elif self.layout == "ports":
            self._ports_host(h)
        else:
            self._routed_host(h)
        if not self.offloads:
            disable_offloads(h.host_if, h.ns)
            disable_offloads(h.switch_if, sw)
        if self.rates[h.index] is not None:
            self._shape_link(h)

    def _shape_link(self, h: Host) -> None:
        for dev, ns in ((h.host_if, h.ns), (h.switch_if, self.switch_ns)):   # both directions
            self.qdisc = shape(dev, self.rates[h.index], ns, self.delays[h.index], self.loss)

    def set_rate(self, i: int, rate_mbit: float) -> None:
        """Re-shape host i's link to rate_mbit in both directions (its delay and the loss
        stay), while the topology is up: background load that changes during a run."""
        if rate_mbit <= 0:
            raise ValueError("rate_mbit must be positive")
        if self.rates[i] is None:
            raise ValueError("set_rate re-shapes a shaped link: build the topology with "
                             "rate_mbit")
        h = self.hosts[i]
        # delete and add again (links.shape adds): the link is unshaped for the few
        # microseconds in between, which a rate change between measurements does not see
        for dev, ns in ((h.host_if, h.ns), (h.switch_if, self.switch_ns)):
            sh("tc", "qdisc", "del", "dev", dev, "root", ns=ns)
        self.rates[i] = rate_mbit
        self._shape_link(h)

    def _ports_host(self, h: Host) -> None:
        static_neighbour(self.switch_ip, self.switch_mac, h.host_if, h.ns)
        self.gso = cut_udp_gso(h.host_if, h.ns) and self.gso
        add_veth(f"nl{self.tag}c{h.index}", f"nl{self.tag}k{h.index}", ns_a=h.ns,
                 ns_b=self.switch_ns, name_a="ctl0")
        sh("ip", "addr", "add", f"{h.control_ip}/24", "dev", "ctl0", ns=h.ns)
        sh("ip", "link", "set", f"nl{self.tag}k{h.index}", "master", "br0", ns=self.switch_ns)

    def _routed_host(self, h: Host) -> None:
        static_neighbour(h.gateway, self.switch_mac, h.host_if, h.ns)
        route = ["ip", "route", "add", f"10.{self.subnet}.0.0/16", "via", h.gateway,
                 "dev", h.host_if]
        if self.rto_min_ms is not None:
            route += ["rto_min", f"{self.rto_min_ms:g}ms"]
        sh(*route, ns=h.ns)


def _per_host(value, num_hosts: int) -> list:
    """One value per host: a scalar (or None) for all, or a list with one entry per host."""
    if value is None or isinstance(value, (int, float)):
        return [value] * num_hosts
    values = list(value)
    if len(values) != num_hosts:
        raise ValueError(f"{len(values)} per-host values for {num_hosts} hosts: give one "
                         "per host, or one number for all")
    return values


# --------------------------------------------------------------------------- clean-up
_live: list[Topology] = []
_lock = threading.RLock()       # the SIGTERM handler may run while main holds it
_previous_sigterm = None         # the handler ours replaced, while ours is installed


def _track(topology: Topology) -> None:
    global _previous_sigterm
    with _lock:
        if topology in _live:
            return
        _live.append(topology)
        if _previous_sigterm is not None or threading.current_thread() is not \
                threading.main_thread():
            return                      # installed already, or only possible in main
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return                      # this process ignores SIGTERM: nothing to do then
        _previous_sigterm = previous
        signal.signal(signal.SIGTERM, _on_sigterm)


def _untrack(topology: Topology) -> None:
    global _previous_sigterm
    with _lock:
        if topology in _live:
            _live.remove(topology)
        if _live or _previous_sigterm is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _previous_sigterm)
            _previous_sigterm = None


def _down_all() -> None:
    for topology in list(_live):
        topology.down()


def _on_sigterm(signum, frame):
    previous = _previous_sigterm
    _down_all()                         # first: whatever the unwinding below does
    if callable(previous):
        previous(signum, frame)
    else:
        raise SystemExit(128 + signum)


atexit.register(_down_all)
