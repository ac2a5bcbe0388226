"""Namespaces, veth links and their shaping: the building blocks of host.netlab.topology.

Every link made here is quiet: IPv6 is off on both of its ends before they come up, so
no neighbour discovery, router solicitation or MLD frame reaches a switch under test (a
data plane counts such a frame as `drop_not_routable`, docs/protocol.md §4.1). Every
namespace made here has IPv6 off as a whole for the same reason.

All commands go through `sh`, which raises `NetnsError` with the command and its error.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import uuid

CLONE_NEWNET = 0x40000000
IFNAMSIZ = 15                   # longest interface name Linux takes
IPV6_SYSCTLS = "/proc/sys/net/ipv6"

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class NetnsError(RuntimeError):
    """Making or changing a namespace, link or qdisc failed; the message says what to do."""


def netns_argv(ns: str | None, argv) -> list[str]:
    """argv run inside network namespace `ns` (None: this process's namespace)."""
    return list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]


def sh(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (in `ns`); with check, a failure raises NetnsError with its stderr."""
    res = subprocess.run(netns_argv(ns, argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        where = f" in namespace {ns}" if ns else ""
        raise NetnsError(f"`{' '.join(argv)}`{where} failed: "
                         f"{res.stderr.strip() or f'exit status {res.returncode}'}")
    return res


# --------------------------------------------------------------------------- namespaces

def add_netns(name: str) -> None:
    """A network namespace with its loopback up and IPv6 off (existing and future links)."""
    sh("ip", "netns", "add", name)
    sh("ip", "link", "set", "lo", "up", ns=name)
    if os.path.isdir(IPV6_SYSCTLS):
        sh("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
           "net.ipv6.conf.default.disable_ipv6=1", ns=name)


def del_netns(name: str) -> None:
    """Delete a namespace (and the link ends in it, with their peers); absent is fine."""
    sh("ip", "netns", "del", name, check=False)


def netns_available() -> str | None:
    """None when namespaces can be created here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "iproute2 is not installed (apt-get install iproute2)"
    name = f"thcprobe{uuid.uuid4().hex[:6]}"
    res = sh("ip", "netns", "add", name, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()} (needs root)"
    del_netns(name)
    return None


def enter_netns(name: str) -> None:
    """setns(CLONE_NEWNET) for the calling thread: call it in a process's main thread
    before it creates threads or sockets (they are then created in the namespace)."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(ns: str, fn, *args):
    """fn(*args) run in network namespace `ns`; sockets it opens stay in that namespace.

    setns moves only the calling thread, so a short-lived thread does it and this
    process's other threads keep their namespace.
    """
    box: dict = {}

    def run():
        try:
            enter_netns(ns)
            box["value"] = fn(*args)
        except BaseException as exc:        # handed to the caller below
            box["error"] = exc
    t = threading.Thread(target=run, name=f"in-netns-{ns}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# --------------------------------------------------------------------------- links

def check_ifname(name: str) -> str:
    if not 1 <= len(name) <= IFNAMSIZ:
        raise NetnsError(f"interface name {name!r} has {len(name)} characters: Linux takes "
                         f"1..{IFNAMSIZ}; use a shorter tag")
    return name


def quiet_ipv6(dev: str, ns: str | None = None) -> None:
    """IPv6 off on one interface: it sends no neighbour discovery or router solicitation."""
    if os.path.isdir(IPV6_SYSCTLS):
        sh("sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1", ns=ns)


def add_veth(end_a: str, end_b: str, *, ns_a: str | None = None, ns_b: str | None = None,
             name_a: str | None = None, mac_a: str | None = None, mac_b: str | None = None,
             mtu: int | None = None) -> str:
    """A quiet veth pair, up: end_a in ns_a (renamed name_a there), end_b in ns_b.

    Both ends are created in their namespaces directly (each name must be free in its
    namespace); IPv6 goes off on each end before it comes up. Returns end_a's final name."""
    cmd = ["ip", "link", "add", check_ifname(end_a)]
    cmd += ["netns", ns_a] if ns_a else []
    cmd += ["type", "veth", "peer", "name", check_ifname(end_b)]
    cmd += ["netns", ns_b] if ns_b else []
    sh(*cmd)
    if name_a:
        sh("ip", "link", "set", end_a, "name", check_ifname(name_a), ns=ns_a)
    for dev, ns, mac in ((name_a or end_a, ns_a, mac_a), (end_b, ns_b, mac_b)):
        quiet_ipv6(dev, ns)
        if mac:
            sh("ip", "link", "set", dev, "address", mac, ns=ns)
        if mtu:
            sh("ip", "link", "set", dev, "mtu", str(mtu), ns=ns)
        sh("ip", "link", "set", dev, "up", ns=ns)
    return name_a or end_a


def del_link(dev: str, ns: str | None = None) -> None:
    """Delete a link (a veth end takes its peer with it); absent is fine."""
    sh("ip", "link", "del", dev, ns=ns, check=False)


def add_bridge(name: str, ns: str | None = None, mtu: int | None = None) -> None:
    """A quiet Linux bridge, up (its members are added with `ip link set DEV master`)."""
    sh("ip", "link", "add", check_ifname(name), "type", "bridge", ns=ns)
    quiet_ipv6(name, ns)
    if mtu:
        sh("ip", "link", "set", name, "mtu", str(mtu), ns=ns)
    sh("ip", "link", "set", name, "up", ns=ns)


def static_neighbour(ip: str, mac: str, dev: str, ns: str | None = None) -> None:
    """A permanent neighbour entry: a data plane answers no ARP."""
    sh("ip", "neigh", "replace", ip, "lladdr", mac, "dev", dev, "nud", "permanent", ns=ns)


def disable_offloads(dev: str, ns: str | None = None) -> None:
    """Plain MTU-sized frames with full checksums on `dev` (a packet socket on the far end
    takes no TSO/GSO/GRO super-frames). Best effort: ethtool may be missing."""
    if shutil.which("ethtool") is not None:
        sh("ethtool", "-K", dev, "tx", "off", "rx", "off", "tso", "off", "gso", "off",
           "gro", "off", ns=ns, check=False)


def cut_udp_gso(dev: str, ns: str | None = None) -> bool:
    """UDP GSO super-datagrams cut into frames at `dev` itself (a packet socket on the far
    end would see them whole); False when that failed (send without GSO there)."""
    return shutil.which("ethtool") is not None and sh(
        "ethtool", "-K", dev, "tx-udp-segmentation", "off", ns=ns, check=False).returncode == 0


# --------------------------------------------------------------------------- shaping

def shape(dev: str, rate_mbit: float, ns: str | None = None, delay_ms: float = 0.0,
          loss: float = 0.0) -> str:
    """Shape `dev`'s output to rate_mbit; the qdisc used: "netem" (rate, delay, loss) where
    the kernel has it, else "tbf" (rate only; delay or loss are refused)."""
    rate = f"{rate_mbit}mbit"
    netem = ["tc", "qdisc", "add", "dev", dev, "root", "netem", "rate", rate, "limit", "10000"]
    if delay_ms:
        netem += ["delay", f"{delay_ms}ms"]
    if loss:
        netem += ["loss", f"{100 * loss}%"]
    res = sh(*netem, ns=ns, check=False)
    if res.returncode == 0:
        return "netem"
    if "unknown" not in res.stderr.lower():
        raise NetnsError(f"tc netem on {dev}: {res.stderr.strip()}")
    if delay_ms or loss:
        raise NetnsError(
            "this kernel has no netem qdisc (sch_netem), so delay/loss cannot be emulated "
            "in a namespace; pass delay_ms=0, loss=0 (rate via tbf) and use "
            "host.netlab.relay.LossyRelay for loss")
    # tbf: a token bucket at the link rate; burst >= one jiffy of traffic at that rate.
    burst = int(max(rate_mbit * 1e6 / 8 / 250, 64 * 1024))
    sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
       "latency", "50ms", ns=ns)
    return "tbf"


def netem_available() -> bool:
    """sch_netem is a kernel module some kernels (containers) lack; delay/loss need it."""
    name = f"nq{os.getpid() % 100000}"
    if sh("ip", "link", "add", name, "type", "dummy", check=False).returncode != 0:
        return False
    try:
        return sh("tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms",
                  check=False).returncode == 0
    finally:
        del_link(name)
