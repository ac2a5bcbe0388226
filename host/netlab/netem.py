"""Network emulation for the host library: a lossy UDP relay and a netns/veth/bridge testbed.

* `LossyUdpRelay`: sits between workers and an aggregator on loopback and drops datagrams
  at random in both directions (seeded). Needs no privileges. Each worker's traffic leaves
  the relay from its own proxy socket, so the aggregator still tells members apart by
  address: install `relay.member_addresses[w]` as worker w's (ip, udp_port).
* `NetnsTestbed` (root): one network namespace per host plus a switch namespace with a
  Linux bridge; each host hangs off the bridge by a veth pair shaped in both directions
  with tc, so bytes on the wire cost time. The bridge itself has an address in the switch
  namespace: an aggregator bound there models in-network aggregation (its traffic crosses
  only the workers' links). `netem` (rate, delay, loss) is used when the kernel has it;
  otherwise `tbf` gives the rate and delay/loss are refused with a message (use the relay
  for loss).
"""
from __future__ import annotations

import select
import shutil
import socket
import subprocess
import threading
import uuid

import numpy as np

from host.packets import HEADER_LEN


# --------------------------------------------------------------------------- lossy relay

class LossyUdpRelay:
    """Drop `loss_up` of worker->aggregator and `loss_down` of aggregator->worker datagrams.

    aggregator: (ip, port) of the real aggregator; num_workers: worker ids 0..n-1 (read from
    the AGG header's worker byte). Workers send to `relay.address`.
    """

    def __init__(self, aggregator, num_workers: int, loss_up: float = 0.01,
                 loss_down: float | None = None, seed: int = 0, host: str = "127.0.0.1"):
        loss_down = loss_up if loss_down is None else loss_down
        for name, p in (("loss_up", loss_up), ("loss_down", loss_down)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} {p} must be in [0, 1)")
        self.aggregator = tuple(aggregator)
        self.loss_up, self.loss_down = loss_up, loss_down
        self._rng = np.random.default_rng(seed)
        self.front = self._socket(host)
        self.address = self.front.getsockname()
        self.proxies = [self._socket(host) for _ in range(num_workers)]
        self.member_addresses = [p.getsockname() for p in self.proxies]
        self._clients: dict[int, tuple] = {}
        self.counters = {"up": 0, "down": 0, "dropped_up": 0, "dropped_down": 0,
                         "unknown_worker": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-udp-relay", daemon=True)

    @staticmethod
    def _socket(host):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.bind((host, 0))
        return s

    def start(self) -> "LossyUdpRelay":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in [self.front, *self.proxies]:
            s.close()
        return dict(self.counters)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _run(self) -> None:
        index = {p.fileno(): w for w, p in enumerate(self.proxies)}
        sockets = [self.front, *self.proxies]
        while not self._stop.is_set():
            readable, _, _ = select.select(sockets, [], [], 0.05)
            for s in readable:
                try:
                    data, source = s.recvfrom(65536)
                except OSError:
                    continue
                if s is self.front:
                    self._up(data, source)
                else:
                    self._down(data, index[s.fileno()])

    def _up(self, data: bytes, source) -> None:
        worker = data[6] if len(data) >= HEADER_LEN else -1
        if not 0 <= worker < len(self.proxies):
            self.counters["unknown_worker"] += 1
            return
        self._clients[worker] = source
        if self._rng.random() < self.loss_up:
            self.counters["dropped_up"] += 1
            return
        self.proxies[worker].sendto(data, self.aggregator)
        self.counters["up"] += 1

    def _down(self, data: bytes, worker: int) -> None:
        client = self._clients.get(worker)
        if client is None:
            return
        if self._rng.random() < self.loss_down:
            self.counters["dropped_down"] += 1
            return
        try:
            self.front.sendto(data, client)
            self.counters["down"] += 1
        except OSError:
            pass                               # the worker is gone


# --------------------------------------------------------------------------- netns testbed

class NetemUnavailable(RuntimeError):
    """This kernel or user cannot emulate what was asked; the message says what to do."""


def _run(*argv, check=True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NetemUnavailable(f"`{' '.join(argv)}` failed: {res.stderr.strip()}")
    return res


class NetnsTestbed:
    """num_hosts namespaces on a bridge; every link shaped to rate_mbit (both directions).

    Host i has address `host_ip(i)` (10.77.x.(i+1)) and MAC `host_mac(i)`; the bridge
    (switch namespace) has `switch_ip`. Use `popen(i, argv)` / `popen_switch(argv)` to run
    programs inside.

    switch="ports": no bridge on the data links; host i's link ends bare as
    `switch_port(i)` in the switch namespace, for a data plane process to attach to (the
    DPDK switch with net_af_packet), still shaped both ways. Hosts reach `switch_ip` through
    a static neighbour entry (`switch_mac`), and talk to each other (process group, control)
    over an unshaped second network, `control_ip(i)` on each host's `ctl0`. A host's UDP
    GSO super-datagrams are cut into frames at its own end of the link (ethtool
    tx-udp-segmentation off), since a packet socket on the switch port would see them
    whole; `gso` is False where that failed (send without GSO there: THC_GSO=0).

    mtu: of every data link (9000: jumbo frames, for packets of up to 8192 values).
    """

    def __init__(self, num_hosts: int, rate_mbit: float, delay_ms: float = 0.0,
                 loss: float = 0.0, subnet: int = 77, switch: str = "bridge",
                 mtu: int = 1500):
        if not 1 <= num_hosts <= 200:
            raise ValueError("num_hosts must be in 1..200")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu {mtu} must be in 576..65535 (9000 for jumbo frames)")
        if rate_mbit <= 0:
            raise ValueError("rate_mbit must be positive")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise NetemUnavailable("iproute2 (ip, tc) is not installed: apt-get install iproute2")
        if switch not in ("bridge", "ports"):
            raise ValueError("switch must be 'bridge' (a Linux bridge) or 'ports' (bare switch "
                             "ports for a data plane process such as the DPDK switch)")
        self.switch = switch
        self.mtu = mtu
        self.gso = True        # ports mode: False when UDP GSO could not be cut at the host
        self.num_hosts, self.rate_mbit = num_hosts, rate_mbit
        self.delay_ms, self.loss = delay_ms, loss
        self.tag = uuid.uuid4().hex[:6]
        self.subnet = subnet
        self.switch_ns = f"thc{self.tag}sw"
        self.host_ns = [f"thc{self.tag}h{i}" for i in range(num_hosts)]
        self.switch_ip = f"10.{subnet}.0.254"
        self.switch_mac = "02:00:00:00:00:fe"   # ports mode: the data plane's MAC
        self.qdisc = None
        self._created: list[str] = []

    def host_ip(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    def host_mac(self, i: int) -> str:
        return f"02:00:00:{self.subnet:02x}:00:{i + 1:02x}"

    def control_ip(self, i: int) -> str:
        """ports mode: host i on the unshaped control network (process group, barriers)."""
        return f"10.{self.subnet + 1}.0.{i + 1}"

    def switch_port(self, i: int) -> str:
        """ports mode: the switch-namespace interface of host i's link (switch port i)."""
        return f"t{self.tag}s{i}"

    def __enter__(self):
        try:
            self._build()
        except Exception:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _ns(self, ns, *argv, check=True):
        return _run("ip", "netns", "exec", ns, *argv, check=check)

    def _build(self) -> None:
        sw = self.switch_ns
        _run("ip", "netns", "add", sw)
        self._created.append(sw)
        self._ns(sw, "ip", "link", "set", "lo", "up")
        # bridge: br0 joins the host links (the switch namespace owns switch_ip on it).
        # ports: the host links end bare in the switch namespace (a data plane process
        # attaches to them), and br0 is a separate unshaped control network instead.
        self._ns(sw, "ip", "link", "add", "br0", "type", "bridge")
        if self.switch == "bridge":
            self._ns(sw, "ip", "link", "set", "br0", "mtu", str(self.mtu))
        if self.switch == "bridge":
            self._ns(sw, "ip", "addr", "add", f"{self.switch_ip}/24", "dev", "br0")
        self._ns(sw, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.host_ns):
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            host_end, sw_end = f"t{self.tag}h{i}", self.switch_port(i)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", sw_end)
            _run("ip", "link", "set", host_end, "netns", ns)
            _run("ip", "link", "set", sw_end, "netns", sw)
            self._ns(ns, "ip", "link", "set", host_end, "name", "eth0")
            self._ns(ns, "ip", "link", "set", "eth0", "address", self.host_mac(i))
            self._ns(ns, "ip", "link", "set", "eth0", "mtu", str(self.mtu))
            self._ns(sw, "ip", "link", "set", sw_end, "mtu", str(self.mtu))
            self._ns(ns, "ip", "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0")
            self._ns(ns, "ip", "link", "set", "eth0", "up")
            self._ns(ns, "ip", "link", "set", "lo", "up")
            if self.switch == "bridge":
                self._ns(sw, "ip", "link", "set", sw_end, "master", "br0")
            else:
                self._ports_host(i, ns, sw_end)
            self._ns(sw, "ip", "link", "set", sw_end, "up")
            self._shape(ns, "eth0")            # host -> switch
            self._shape(sw, sw_end)            # switch -> host

    def _ports_host(self, i: int, ns: str, sw_end: str) -> None:
        sw = self.switch_ns
        # The switch port carries only the data plane's traffic: no IPv6 chatter, and a
        # static neighbour entry for the switch (a data plane answers no ARP).
        self._ns(sw, "sysctl", "-qw", f"net.ipv6.conf.{sw_end}.disable_ipv6=1")
        self._ns(ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        self._ns(ns, "ip", "neigh", "replace", self.switch_ip, "lladdr", self.switch_mac,
                 "dev", "eth0", "nud", "permanent")
        if shutil.which("ethtool") is None or self._ns(
                ns, "ethtool", "-K", "eth0", "tx-udp-segmentation", "off",
                check=False).returncode != 0:
            self.gso = False
        host_ctl, sw_ctl = f"t{self.tag}c{i}", f"t{self.tag}k{i}"
        _run("ip", "link", "add", host_ctl, "type", "veth", "peer", "name", sw_ctl)
        _run("ip", "link", "set", host_ctl, "netns", ns)
        _run("ip", "link", "set", sw_ctl, "netns", sw)
        self._ns(ns, "ip", "link", "set", host_ctl, "name", "ctl0")
        self._ns(ns, "ip", "addr", "add", f"{self.control_ip(i)}/24", "dev", "ctl0")
        self._ns(ns, "ip", "link", "set", "ctl0", "up")
        self._ns(sw, "ip", "link", "set", sw_ctl, "master", "br0")
        self._ns(sw, "ip", "link", "set", sw_ctl, "up")

    def _shape(self, ns: str, dev: str) -> None:
        rate = f"{self.rate_mbit}mbit"
        netem = ["tc", "qdisc", "add", "dev", dev, "root", "netem", "rate", rate,
                 "limit", "10000"]
        if self.delay_ms:
            netem += ["delay", f"{self.delay_ms}ms"]
        if self.loss:
            netem += ["loss", f"{100 * self.loss}%"]
        res = self._ns(ns, *netem, check=False)
        if res.returncode == 0:
            self.qdisc = "netem"
            return
        if "unknown" not in res.stderr.lower():
            raise NetemUnavailable(f"tc netem on {dev}: {res.stderr.strip()}")
        if self.delay_ms or self.loss:
            raise NetemUnavailable(
                "this kernel has no netem qdisc (sch_netem), so delay/loss cannot be emulated "
                "in a namespace; pass delay_ms=0, loss=0 (rate via tbf) and use "
                "host.netlab.netem.LossyUdpRelay for loss")
        # tbf: a token bucket at the link rate; burst >= one jiffy of traffic at that rate.
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = int(max(rate_bytes / 250, 64 * 1024))
        self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "50ms")
        self.qdisc = "tbf"

    def popen(self, i: int, argv, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.host_ns[i], *argv], **kwargs)

    def popen_switch(self, argv, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.switch_ns, *argv], **kwargs)

    def close(self) -> None:
        # Deleting a namespace destroys the veth ends inside it (and so their peers).
        for ns in reversed(self._created):
            _run("ip", "netns", "del", ns, check=False)
        self._created.clear()


def netns_available() -> str | None:
    """None when namespaces can be created here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "iproute2 is not installed"
    name = f"thcprobe{uuid.uuid4().hex[:6]}"
    res = _run("ip", "netns", "add", name, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()} (needs root)"
    _run("ip", "netns", "del", name, check=False)
    return None
