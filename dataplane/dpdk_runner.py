"""Run the DPDK switch (dataplane/dpdk/build/thc_switch).

* `run_pcap`: the deterministic mode the packet suite, the tests and the benchmark
  use: one net_pcap virtual device per switch port (rx_pcap = what arrives on the
  port, tx_pcap = what leaves it), a schedule file fixing the cross-port arrival
  order, EAL without hugepages or PCI. Statistics come back as the switch's JSON.
* `LiveSwitch`: live ports (net_af_packet on veths, as the testbed uses it).
* `HostService`: behind a veth pair, so UDP sockets on this host are its workers
  (jumbo frames included); `TapService`: the same behind a kernel tap (DPDK 22.11's
  net_tap sends frames of at most 1522 bytes).

Live af_packet ports (`af_packet_vdevs`) use 10240-byte ring frames, so frames up to
the switch's 9216-byte limit arrive whole (the PMD's default 2048-byte frames cut
everything over 1981 bytes; the switch then drops and counts them, rx_oversize), and
the switch turns off the kernel's fragment reassembly on them (af_packet_sockets.c).

Every live switch refuses at set-up a job whose largest DATA or RESULT frame a member's
port cannot carry (`check_job_frames`, docs/protocol.md §8): the ring frame size of an
af_packet port, the MTU of its interface, net_tap's frame limit and its tap's MTU.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dataplane.config import ConfigError, SwitchConfig
from dataplane.dpdk_config import write_config
from dataplane.wire import (AGG_FRAME_OVERHEAD, AGG_PORT_BASE, ETH_LEN, TYPE_DATA, TYPE_RESULT,
                            payload_len)

DPDK_DIR = Path(__file__).resolve().parent / "dpdk"
SWITCH_BIN = DPDK_DIR / "build" / "thc_switch"

_PCAP_MAGIC = 0xA1B2C3D4
_PCAP_GLOBAL = struct.Struct("<IHHiIII")
_PCAP_RECORD = struct.Struct("<IIII")


class SwitchError(RuntimeError):
    """The switch refused its configuration or failed; the message is its own."""


# What a port can carry, as dataplane/dpdk/ports.c sets it (port_traits).
SWITCH_MAX_FRAME = 9216                # MAX_FRAME: the longest frame the switch takes or sends
AF_PACKET_PMD_FRAMESZ = 2048           # the af_packet PMD's ring frame without framesz=
AF_PACKET_RX_HEADROOM = 66             # a received frame starts this far into a ring frame
AF_PACKET_TX_HEADROOM = 32             # ... a sent one
TAP_MAX_FRAME = 1522                   # DPDK 22.11's net_tap: MTU 1500 + Ethernet, VLAN, CRC
TAP_MTU = 1500                         # the kernel side of that tap


@dataclass(frozen=True)
class FrameLimit:
    """The longest frame one direction of a port carries, what sets it and how to raise it."""
    size: int
    why: str
    remedy: str


@dataclass(frozen=True)
class PortLimits:
    """The longest frames a switch port receives whole (rx) and sends (tx)."""
    rx: FrameLimit
    tx: FrameLimit


def port_limits(vdev: str, link_mtu: int | None = None) -> PortLimits:
    """What the port of EAL --vdev string `vdev` carries. link_mtu: the MTU of its kernel
    interface (default: an af_packet port's `iface=` as the kernel reports it, 1500 for a
    tap; none for other drivers): what the kernel sends and takes there."""
    driver, _, args = vdev.partition(",")
    options = dict(a.split("=", 1) for a in args.split(",") if "=" in a)
    switch = FrameLimit(SWITCH_MAX_FRAME, f"the switch's {SWITCH_MAX_FRAME}-byte frame limit", "")
    rx = tx = switch
    if driver.startswith("net_af_packet"):
        framesz = int(options.get("framesz", AF_PACKET_PMD_FRAMESZ))
        ring = f"its af_packet ring frame size {framesz} (framesz=)"
        more = "or give the port larger ring frames (dataplane.dpdk_runner.af_packet_vdevs)"
        rx = min(rx, FrameLimit(framesz - AF_PACKET_RX_HEADROOM - 1, ring, more),
                 key=lambda lim: lim.size)
        tx = min(tx, FrameLimit(framesz - AF_PACKET_TX_HEADROOM, ring, more),
                 key=lambda lim: lim.size)
        iface = options.get("iface")
        mtu = link_mtu if link_mtu is not None else _iface_mtu(iface)
        link = (f"the MTU {mtu} of {iface}", f"or raise that MTU (ip link set {iface} mtu 9000)")
    elif driver.startswith("net_tap"):
        remedy = "or use HostService (a veth pair, MTU 9000)"
        tx = FrameLimit(TAP_MAX_FRAME, f"net_tap's limit of {TAP_MAX_FRAME}-byte frames (DPDK "
                        "22.11 cannot raise its MTU)", remedy)
        mtu = TAP_MTU if link_mtu is None else link_mtu
        link = (f"the tap's MTU {mtu}; net_tap sends frames of at most {TAP_MAX_FRAME} bytes",
                remedy)
    else:
        mtu, link = link_mtu, (f"the link MTU {link_mtu}", "or raise that MTU")
    if mtu:
        on_link = FrameLimit(mtu + ETH_LEN, *link)
        rx = min(rx, on_link, key=lambda lim: lim.size)
        tx = min(tx, on_link, key=lambda lim: lim.size)
    return PortLimits(rx, tx)


def _iface_mtu(iface: str | None) -> int | None:
    """The MTU of a network interface of this namespace (None if there is no such)."""
    try:
        return int(Path(f"/sys/class/net/{iface}/mtu").read_text())
    except (OSError, ValueError, TypeError):
        return None


def check_job_frames(config: SwitchConfig, vdevs: list[str],
                     link_mtus: dict[int, int] | None = None) -> None:
    """Refuse a job whose largest DATA (received on a member's port) or RESULT (sent out
    of it) frame that port cannot carry whole (docs/protocol.md §8); the message names the
    limit and the largest values_per_packet both fit. link_mtus: port -> MTU of its link,
    where port_limits cannot read it (an interface not made yet)."""
    for job in config.jobs:
        vpp = job.values_per_packet
        frames = (("DATA", AGG_FRAME_OVERHEAD + payload_len(TYPE_DATA, vpp), "rx"),
                  ("RESULT", AGG_FRAME_OVERHEAD + payload_len(TYPE_RESULT, vpp), "tx"))
        for port in sorted({m.port for m in job.members if m.port < len(vdevs)}):
            limits = port_limits(vdevs[port], (link_mtus or {}).get(port))
            fits = min(limits.tx.size - AGG_FRAME_OVERHEAD,
                       2 * (limits.rx.size - AGG_FRAME_OVERHEAD))
            for kind, size, direction in frames:
                limit = getattr(limits, direction)
                verb = "receives" if direction == "rx" else "sends"
                if size > limit.size:
                    raise SwitchError(
                        f"job {job.job}: values_per_packet {vpp} makes {size}-byte {kind} "
                        f"frames, but switch port {port} {verb} frames of at most "
                        f"{limit.size} bytes ({limit.why}): lower "
                        f"values_per_packet to at most {max(fits, 0)}"
                        + (f", {limit.remedy}" if limit.remedy else ""))


def write_pcap(path: Path, frames: list[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(_PCAP_GLOBAL.pack(_PCAP_MAGIC, 2, 4, 0, 0, 65535, 1))
        for i, frame in enumerate(frames):
            f.write(_PCAP_RECORD.pack(i // 1_000_000, i % 1_000_000, len(frame), len(frame)))
            f.write(frame)


def read_pcap(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    if len(data) < _PCAP_GLOBAL.size:
        return []
    magic = struct.unpack_from("<I", data)[0]
    endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    rec = struct.Struct(endian + "IIII")
    frames, pos = [], _PCAP_GLOBAL.size
    while pos + rec.size <= len(data):
        _, _, incl, _ = rec.unpack_from(data, pos)
        pos += rec.size
        frames.append(data[pos:pos + incl])
        pos += incl
    return frames


def build(quiet: bool = True) -> Path:
    """Build the switch if needed (make -C dataplane/dpdk) and return the binary."""
    res = subprocess.run(["make", "-C", str(DPDK_DIR)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SwitchError(f"building the DPDK switch failed:\n{res.stdout}\n{res.stderr}")
    return SWITCH_BIN


# Per-job drop counters of docs/protocol.md §4.1 that a frame reaching a job may end in.
JOB_DROPS = ("drop_bad_slot", "drop_not_member", "drop_bad_expected", "drop_unsatisfiable")
JOB_OUTCOMES = ("aggregated", "drop_duplicate", "results_reserved", "straggler_notices",
                "flushes")


def counter_balance(stats: dict) -> dict:
    """docs/protocol.md §4.5 on a switch process's statistics (counters()): frames in
    (port rx) against the sum of the outcome counters, and each job's rx against its
    outcomes."""
    frames_in = sum(p["rx"] for p in stats["ports"].values())
    counted = sum(v for k, v in stats["global"].items()
                  if k == "forwarded" or k.startswith("drop_"))
    jobs_ok = True
    for job in stats["jobs"].values():
        counted += job["rx"] + sum(job[k] for k in JOB_DROPS)
        jobs_ok &= job["rx"] == sum(job[k] for k in JOB_OUTCOMES)
    return {"frames_in": frames_in, "counted": counted,
            "balanced": frames_in == counted and jobs_ok}


def cannot_run() -> str | None:
    """Why the built switch cannot run here (None when it can): for callers that use the
    binary `make build` made, without building it themselves (available() builds)."""
    if not SWITCH_BIN.is_file():
        return f"{SWITCH_BIN} is not built: run `make build` (needs libdpdk-dev)"
    if os.geteuid() != 0:
        return "the DPDK switch needs root (EAL, and a veth pair for the workers)"
    return None


def available() -> tuple[bool, str]:
    """Whether the switch can run here, and why not."""
    if shutil.which("pkg-config") is None or subprocess.run(
            ["pkg-config", "--exists", "libdpdk"]).returncode != 0:
        return False, "DPDK not installed (Debian packages libdpdk-dev dpdk pkg-config)"
    try:
        build()
    except SwitchError as exc:
        return False, str(exc).splitlines()[0]
    if os.geteuid() != 0:
        return False, "the DPDK switch needs root for EAL (even with --no-huge)"
    return True, ""


def eal_args(vdevs: list[str]) -> list[str]:
    # One lcore, no hugepages, no PCI scan, private memory: several switches may
    # run side by side (tests, the testbed) without sharing /var/run/dpdk state.
    args = ["-l", "0", "--no-huge", "--no-pci", "-m", "256", "--no-shconf",
            "--no-telemetry", "--log-level", "*:error"]
    for v in vdevs:
        args += ["--vdev", v]
    return args


def num_ports_for(config: SwitchConfig, ingress_ports=()) -> int:
    ports = [m.port for j in config.jobs for m in j.members]
    ports += [port for r in config.routes for port, _ in r.next_hops] + list(ingress_ports)
    return max(ports, default=0) + 1


def run_pcap(config: SwitchConfig, batches: list[list[tuple[int, bytes]]],
             port_rates: dict[int, float] | None = None, num_ports: int | None = None,
             timeout: float = 60.0, workdir: str | Path | None = None,
             binary: Path = SWITCH_BIN) -> tuple[dict[int, list[bytes]], dict]:
    """Feed batches of (ingress port, frame) through one switch process.

    Between batches every queue drains (a paused port's input is exhausted at the
    end of each batch). Returns ({egress port: [frames in order]}, stats JSON).
    """
    frames = [pf for batch in batches for pf in batch]
    n_ports = num_ports or num_ports_for(config, [p for p, _ in frames])
    with tempfile.TemporaryDirectory(prefix="thc_dpdk_", dir=workdir) as tmp:
        tmp = Path(tmp)
        conf = write_config(config, tmp / "switch.conf")
        vdevs = []
        for p in range(n_ports):
            write_pcap(tmp / f"in{p}.pcap", [f for q, f in frames if q == p])
            vdevs.append(f"net_pcap{p},rx_pcap={tmp}/in{p}.pcap,tx_pcap={tmp}/out{p}.pcap")
        sched = []
        for batch in batches:
            sched += [str(p) for p, _ in batch] + ["drain"]
        (tmp / "schedule").write_text("\n".join(sched) + "\n")
        cmd = [str(binary), *eal_args(vdevs), "--", "--config", str(conf),
               "--stats", str(tmp / "stats.json"), "--schedule", str(tmp / "schedule")]
        for port, rate in (port_rates or {}).items():
            cmd += ["--rate", f"{port}:{float(rate)}"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise SwitchError(f"thc_switch exited with {res.returncode}: "
                              f"{res.stderr.strip() or res.stdout.strip()}")
        stats = json.loads((tmp / "stats.json").read_text())
        outputs = {p: read_pcap(tmp / f"out{p}.pcap") for p in range(n_ports)}
    return outputs, stats


# ---------------------------------------------------------------------------- live

def stats_seq(path: Path) -> int:
    """The sequence number of a statistics file (each write counts up), 0 if none."""
    try:
        return json.loads(path.read_text())["seq"]
    except FileNotFoundError:
        return 0


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (a switch writes its final statistics on it), SIGKILL after timeout seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request_stats(proc: subprocess.Popen, path: Path, timeout: float, name: str) -> dict:
    """SIGUSR1 to a switch process (thc_switch, thc_udp_service), then its statistics file
    once a write after the signal is there."""
    before = stats_seq(path)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stats_seq(path) > before:                # written whole: write-then-rename
            return json.loads(path.read_text())
        time.sleep(0.002)
    raise SwitchError(f"{name} wrote no statistics after SIGUSR1")


class LiveSwitch:
    """The switch on live ports (net_af_packet on veths, net_tap, NICs) until stop().

    `vdevs` are EAL --vdev strings, one per switch port in port order; `extra_args` more
    switch options (e.g. ["--busy-poll"]). start() returns once the poll loop runs (the
    switch prints "... running"); counters() asks for statistics with SIGUSR1; stop()
    sends SIGTERM and returns the final statistics. The switch's output goes to
    `log_path`, never to a pipe.
    """

    def __init__(self, config: SwitchConfig, vdevs: list[str],
                 port_rates: dict[int, float] | None = None, workdir: str | Path | None = None,
                 binary: Path = SWITCH_BIN, start_timeout: float = 30.0,
                 extra_args: list[str] = ()):
        self.config, self.vdevs, self.port_rates = config, list(vdevs), dict(port_rates or {})
        self.extra_args = list(extra_args)
        self.binary, self.start_timeout = binary, start_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="thc_dpdk_live_", dir=workdir)
        self.workdir = Path(self._tmp.name)
        self.stats_path = self.workdir / "stats.json"
        self.log_path = self.workdir / "switch.log"
        self.proc: subprocess.Popen | None = None
        self.link_mtus: dict[int, int] = {}        # check_job_frames: MTUs not yet readable

    def start(self) -> "LiveSwitch":
        try:
            check_job_frames(self.config, self.vdevs, self.link_mtus)
        except SwitchError:
            self._tmp.cleanup()
            raise
        conf = write_config(self.config, self.workdir / "switch.conf")
        cmd = [str(self.binary), *eal_args(self.vdevs), "--", "--config", str(conf),
               "--stats", str(self.stats_path)]
        for port, rate in self.port_rates.items():
            cmd += ["--rate", f"{port}:{float(rate)}"]
        cmd += self.extra_args
        # stdout and stderr both go to the log file: no pipe the switch could block on.
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if not self._wait_running(self.start_timeout):
            self.stop()
            raise SwitchError(f"thc_switch did not start: {self.log_path.read_text().strip()}")
        return self

    def _wait_running(self, timeout: float) -> bool:
        """Whether the switch printed its start-up line ("... running") in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "running" in self.log_path.read_text():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def counters(self, timeout: float = 10.0) -> dict:
        """Statistics now (SIGUSR1): {"global", "jobs", "ports", "seq"}."""
        return request_stats(self.proc, self.stats_path, timeout, "thc_switch")

    def _end_process(self) -> dict | None:
        """SIGTERM (SIGKILL after 20 s); the process's final statistics (None: it wrote none)."""
        if self.proc is not None:
            terminate(self.proc, 20)
        return json.loads(self.stats_path.read_text()) if self.stats_path.exists() else None

    def stop(self) -> dict | None:
        """SIGTERM; the final statistics (None when it never wrote any)."""
        stats = self._end_process()
        self._tmp.cleanup()
        self.proc = None
        return stats

    def stop_process(self) -> dict | None:
        """Stop the switch process (SIGTERM) but keep its ports and links (a HostService's
        veth pair): start_process() starts a fresh one there. Returns the stopped process's
        final statistics (None when it wrote none)."""
        stats = self._end_process()
        # A new process numbers its statistics from 1 again: counters() waits for a higher
        # number than the file holds, so the old file must go.
        self.stats_path.unlink(missing_ok=True)
        return stats

    def start_process(self) -> None:
        """A fresh switch process (empty slots, zeroed counters) on the existing ports."""
        LiveSwitch.start(self)              # the process only: a subclass's start makes links

    def restart(self, down_s: float = 0.0) -> dict | None:
        """stop_process(), down_s seconds without a switch, start_process(); returns the
        old process's final statistics."""
        stats = self.stop_process()
        time.sleep(down_s)
        self.start_process()
        return stats

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# Ring frames that hold a 9216-byte frame whole (the PMD puts it 66 bytes in), in
# blocks of two: the PMD indexes frames as if blocks were gapless, and the kernel gives
# each block a power-of-two number of pages.
AF_PACKET_FRAMESZ, AF_PACKET_BLOCKSZ = 10240, 20480
JUMBO_MTU = 9000


def af_packet_vdevs(ifaces: list[str], framecnt: int = 512,
                    qdisc_bypass: bool | None = None) -> list[str]:
    """One net_af_packet port per interface, port i = ifaces[i], jumbo-sized rings of
    `framecnt` frames (even; each costs 16 KiB of locked kernel memory per direction).
    qdisc_bypass=False sends through the interface's qdisc (e.g. a tbf shaping it)."""
    if framecnt < 2 or framecnt % 2:
        raise ValueError(f"framecnt {framecnt}: need an even number of ring frames >= 2")
    extra = "" if qdisc_bypass is None else f",qdisc_bypass={int(qdisc_bypass)}"
    return [f"net_af_packet{p},iface={iface},framesz={AF_PACKET_FRAMESZ},"
            f"blocksz={AF_PACKET_BLOCKSZ},framecnt={framecnt}{extra}"
            for p, iface in enumerate(ifaces)]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise SwitchError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def _service_address(config: SwitchConfig) -> tuple[str, str]:
    """The one (MAC, IPv4) every member of a host service shares, on switch port 0."""
    members = [m for j in config.jobs for m in j.members]
    addrs = {(m.port, m.mac.lower(), m.ip) for m in members}
    if len(addrs) != 1 or next(iter(addrs))[0] != 0:
        raise SwitchError("a host service needs every member on port 0 with one MAC and IPv4 "
                          f"address (the host interface's); got {sorted(addrs)}")
    _, mac, ip = next(iter(addrs))
    return mac, ip


class HostService(LiveSwitch):
    """The switch behind one veth pair: UDP sockets on this host are its workers (a
    loopback service, like dataplane.udp_service but through DPDK).

    Every member must be on switch port 0 with one MAC and IPv4 address: the host end
    `iface`'s. The switch's af_packet port is the other end (`iface` + "s"). Both ends
    get MTU 9000, the host end that MAC and address, a host route to the switch's IP
    and a static neighbour entry (the switch answers no ARP). Workers send AGG packets
    with UDP to (config.ip, 50000) from their member UDP port; results come back the
    same way.
    """

    def __init__(self, config: SwitchConfig, iface: str = "thchost0", mtu: int = JUMBO_MTU,
                 **kw):
        if len(iface) > 14:
            raise SwitchError(f"interface name {iface!r}: at most 14 characters (the switch "
                              "end adds one)")
        self.host_mac, self.host_ip = _service_address(config)
        self.iface, self.switch_iface, self.mtu = iface, iface + "s", mtu
        super().__init__(config, af_packet_vdevs([self.switch_iface]), **kw)
        self.link_mtus = {0: mtu}

    def start(self) -> "HostService":
        try:
            check_job_frames(self.config, self.vdevs, self.link_mtus)   # before any link
        except SwitchError:
            self._tmp.cleanup()
            raise
        _ip("link", "add", self.iface, "type", "veth", "peer", "name", self.switch_iface)
        try:
            for dev in (self.iface, self.switch_iface):
                subprocess.run(["sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                               capture_output=True)
                _ip("link", "set", dev, "mtu", str(self.mtu), "up")
            _configure_host_end(self.iface, self.host_mac, self.host_ip, self.config)
            super().start()
        except SwitchError:
            self.stop()
            raise
        return self

    def stop(self) -> dict | None:
        stats = super().stop()
        subprocess.run(["ip", "link", "del", self.iface], capture_output=True)
        return stats


def _configure_host_end(dev: str, mac: str, ip: str, config: SwitchConfig) -> None:
    _ip("link", "set", dev, "address", mac)
    _ip("addr", "replace", f"{ip}/32", "dev", dev)
    _ip("link", "set", dev, "up")
    _ip("route", "replace", f"{config.ip}/32", "dev", dev, "src", ip)
    _ip("neigh", "replace", config.ip, "lladdr", config.mac, "dev", dev, "nud", "permanent")


class TapService(LiveSwitch):
    """HostService behind a kernel tap (net_tap) instead of a veth pair.

    DPDK 22.11's net_tap sends at most MTU 1500 + 22 bytes (its ethdev MTU cannot be
    raised there), so results longer than 1522 bytes are dropped and counted
    (tx_oversize): use HostService for jumbo frames.
    """

    def __init__(self, config: SwitchConfig, tap: str = "thctap0", **kw):
        self.host_mac, self.host_ip = _service_address(config)
        self.tap = tap
        super().__init__(config, [f"net_tap0,iface={tap}"], **kw)

    def start(self) -> "TapService":
        super().start()
        try:
            subprocess.run(["sysctl", "-q", "-w", f"net.ipv6.conf.{self.tap}.disable_ipv6=1"],
                           capture_output=True)
            _configure_host_end(self.tap, self.host_mac, self.host_ip, self.config)
        except SwitchError:
            self.stop()
            raise
        return self


def _refuse_loopback_members(config: SwitchConfig) -> None:
    """The members' shared address goes on the host end of the link: a loopback one would
    take 127.0.0.1 away from lo's routes, so the CLI refuses it."""
    _, ip = _service_address(config)
    if ipaddress.IPv4Address(ip).is_loopback:
        raise SwitchError(f"the members' address {ip} is a loopback address: the DPDK switch "
                          "needs a non-loopback one for its host end (e.g. python -m "
                          "dataplane.config local --ip 10.0.0.1 ...); loopback workers use "
                          "python -m dataplane.udp_service instead")


def main(argv=None) -> int:
    """`python -m dataplane.dpdk_runner host --config job.json [--iface thchost0]` (or
    `tap ... [--tap thctap0]`): serve the job's UDP workers on this host through the
    DPDK switch until SIGINT/SIGTERM."""
    import argparse
    ap = argparse.ArgumentParser(description="Run the DPDK switch as a service on this host.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    host = sub.add_parser("host", help="the switch behind a veth pair (loopback service)")
    host.add_argument("--config", required=True, help="a SwitchConfig saved as JSON")
    host.add_argument("--iface", default="thchost0")
    tap = sub.add_parser("tap", help="the switch behind a tap interface (frames <= 1522 B)")
    tap.add_argument("--config", required=True, help="a SwitchConfig saved as JSON")
    tap.add_argument("--tap", default="thctap0")
    args = ap.parse_args(argv)
    try:
        config = SwitchConfig.load(args.config)
        _refuse_loopback_members(config)
        if args.cmd == "host":
            service, dev = HostService(config, iface=args.iface).start(), args.iface
        else:
            service, dev = TapService(config, tap=args.tap).start(), args.tap
    except (ConfigError, SwitchError, OSError, ValueError, KeyError, TypeError) as exc:
        # A one-line refusal (exit code 2), no traceback: the message says what to change.
        print(f"dpdk_runner {args.cmd}: cannot start: {exc}", file=sys.stderr)
        return 2
    print(f"serving at {config.ip}:{AGG_PORT_BASE} through {dev}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and service.proc.poll() is None:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    print(json.dumps(service.stop()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
