"""A Mininet testbed: N worker hosts, one switch, TCLink bandwidth/delay/loss.

The switch is, by preference (`--switch auto`):

* `bmv2`: simple_switch_grpc running p4src/v1model on the switch's interfaces,
  configured through dataplane.bmv2.control (needs simple_switch_grpc and a compiled JSON);
* `dpdk`: dataplane/dpdk/build/thc_switch with one net_af_packet port per interface;
* `reference`: the reference aggregator as a UDP service (`dataplane.udp_service`)
  on an aggregator host behind a plain Linux bridge (always possible).

For bmv2 and dpdk the workers reach the aggregator's IPv4 address through a static
ARP entry (the switch answers no ARP); for the reference the aggregator host owns it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dataplane.wire import AGG_PORT_BASE
from dataplane.config import ConfigError, Job, Member, SwitchConfig
from dataplane.dpdk_runner import SWITCH_BIN
from host.netlab import aggregators
from host.netlab.links import netem_available, quiet_ipv6
from host.netlab.testbed.mininet_loader import load_mininet

REPO_ROOT = aggregators.REPO_ROOT
SWITCH_KINDS = ("bmv2", "dpdk", "reference")
AGG_UDP_PORT = AGG_PORT_BASE
WORKER_UDP_BASE = 40000
JOB_ID = 1
HTB_R2Q = 10                   # the kernel's default rate-to-quantum divisor
HTB_QUANTUM_RANGE = (1000, 200_000)   # quanta the kernel takes without a warning


class TestbedError(RuntimeError):
    """The testbed could not be set up; the message says what to change."""


@dataclass
class TestbedOptions:
    hosts: int = 3
    bw: float = 100.0                  # Mbit/s per host link, 0 = no limit
    delay: str | None = None           # e.g. "1ms" (needs the sch_netem kernel module)
    loss: float = 0.0                  # percent (needs sch_netem)
    switch: str = "auto"
    values: int = 4096
    values_per_packet: int = 64
    pool_size: int = 16
    seed: int = 7
    timeout: float = 60.0
    command: str | None = None         # per-host command; placeholders see worker_command()
    workdir: str | None = None


@dataclass
class TestbedResult:
    switch: str
    hosts: dict[str, dict] = field(default_factory=dict)   # host -> worker JSON or output
    counters: dict | None = None
    ok: bool = False


# --------------------------------------------------------------------------- choice
def switch_available(kind: str) -> tuple[bool, str]:
    if kind == "reference":
        return True, "reference UDP service behind a Linux bridge"
    if kind == "bmv2":
        if shutil.which("simple_switch_grpc") is None:
            return False, "simple_switch_grpc is not on PATH"
        from dataplane.bmv2.control import DEFAULT_BMV2_JSON
        if not DEFAULT_BMV2_JSON.is_file() and shutil.which("p4c") is None:
            return False, f"{DEFAULT_BMV2_JSON} missing and p4c not on PATH"
        return True, "BMv2 simple_switch_grpc"
    if kind == "dpdk":
        if not SWITCH_BIN.is_file():
            return False, f"{SWITCH_BIN} not built (make build)"
        return True, "DPDK thc_switch on af_packet ports"
    raise TestbedError(f"unknown switch {kind!r}; choose one of auto, {', '.join(SWITCH_KINDS)}")


def choose_switch(requested: str) -> str:
    if requested != "auto":
        ok, reason = switch_available(requested)
        if not ok:
            raise TestbedError(f"switch {requested} cannot run here: {reason}")
        return requested
    for kind in SWITCH_KINDS:
        if switch_available(kind)[0]:
            return kind
    return "reference"


def make_config(n_hosts: int, pool_size: int, values_per_packet: int = 64) -> SwitchConfig:
    """One job, worker w on host h{w+1} = switch port w, 10.0.0.(w+1); its packets carry
    at most `values_per_packet` values (what the workers send)."""
    members = tuple(Member(worker=w, port=w, mac=f"02:00:00:00:01:{w + 1:02x}",
                           ip=f"10.0.0.{w + 1}", udp_port=WORKER_UDP_BASE + w)
                    for w in range(n_hosts))
    job = Job.from_thc(JOB_ID, pool_size, members, values_per_packet=values_per_packet)
    return SwitchConfig(mac="02:00:00:00:00:fe", ip="10.0.0.254", jobs=(job,)).validate()


def check_options(opts: TestbedOptions) -> None:
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, veth, tc)")
    if not 1 <= opts.hosts <= 32:
        raise TestbedError(f"--hosts {opts.hosts}: use 1..32 (a job holds 32 workers)")
    if opts.bw < 0 or opts.loss < 0 or opts.loss > 100:
        raise TestbedError("--bw must be >= 0 Mbit/s and --loss a percentage in 0..100")
    if (opts.delay or opts.loss) and not netem_available():
        raise TestbedError("--delay/--loss need the sch_netem qdisc, which this kernel lacks "
                           "(modprobe sch_netem, or run with --bw only)")


# --------------------------------------------------------------------------- Mininet parts
def htb_quantum(bw_mbit: float) -> int:
    """The htb quantum the kernel would pick for a class at bw_mbit (rate / r2q, clamped),
    given explicitly: then the kernel does not warn that it is big (or small)."""
    low, high = HTB_QUANTUM_RANGE
    return int(min(max(bw_mbit * 1e6 / 8 / HTB_R2Q, low), high))


def _classes():
    # Mininet is imported only when a testbed is built: the CLI's --help and the config
    # helpers work without it.
    load_mininet()
    from mininet.link import TCIntf, TCLink
    from mininet.net import Mininet
    from mininet.node import Host, Switch
    return Mininet, Host, Switch, _quiet_tclink(TCIntf, TCLink)


def _quiet_tclink(TCIntf, TCLink):
    class QuietTCIntf(TCIntf):
        """TCIntf whose htb class names its quantum, so `tc` prints no warning that
        Mininet would report as `*** Error: Warning: sch_htb: quantum ... is big`."""

        def bwCmds(self, bw=None, **params):
            cmds, parent = super().bwCmds(bw=bw, **params)
            return [c + f" quantum {htb_quantum(bw)}" if " htb rate " in c else c
                    for c in cmds], parent

    class QuietTCLink(TCLink):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("cls1", QuietTCIntf)
            kwargs.setdefault("cls2", QuietTCIntf)
            super().__init__(*args, **kwargs)

    return QuietTCLink


def _bridge_class(Switch):
    class IpBridge(Switch):
        """A Linux bridge made with iproute2 (brctl, which LinuxBridge needs, is absent)."""

        def start(self, controllers):
            self.cmd("ip link del", self, "2>/dev/null")
            self.cmd("ip link add name", self, "type bridge stp_state 0")
            quiet_ipv6(self.name)
            for intf in self.intfList():
                if self.name in intf.name:
                    self.cmd("ip link set", intf, "master", self)
            self.cmd("ip link set", self, "up")

        def stop(self, deleteIntfs=True):
            self.cmd("ip link del", self)
            super().stop(deleteIntfs)

    return IpBridge


def _port_switch_class(Switch):
    class PortSwitch(Switch):
        """A switch node whose data plane is a process started by the testbed on its
        interfaces (BMv2 or DPDK); Mininet only creates and removes the links."""

        def start(self, controllers):
            for intf in self.intfList():
                if self.name in intf.name:
                    self.cmd("ip link set", intf, "up")

        def stop(self, deleteIntfs=True):
            super().stop(deleteIntfs)

    return PortSwitch


class Testbed:
    """Builds the network, starts the aggregator, runs the hosts, always tears down."""

    def __init__(self, opts: TestbedOptions):
        self.opts = opts
        self.tag = f"t{os.getpid() % 10000}"
        self.kind = "reference"
        self.net = None
        self.processes: list[subprocess.Popen] = []
        self.agg_process = None
        self.workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="thc_testbed_"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config: SwitchConfig | None = None
        self.controller = None

    # -- build --
    def build(self) -> None:
        check_options(self.opts)
        self.kind = choose_switch(self.opts.switch)
        self.config = make_config(self.opts.hosts, self.opts.pool_size,
                                  self.opts.values_per_packet)
        self.config_path = self.config.save(self.workdir / "switch_config.json")
        Mininet, Host, Switch, TCLink = _classes()
        Mininet.inited = True      # skip Mininet.init's global sysctl tuning (shared machine)
        switch_cls = _bridge_class(Switch) if self.kind == "reference" else \
            _port_switch_class(Switch)
        self.net = net = Mininet(topo=None, build=False, controller=None, link=TCLink,
                                 autoSetMacs=False, waitConnected=False)
        self.switch = net.addSwitch(f"{self.tag}s", cls=switch_cls, dpid="1")
        link_opts = {}
        if self.opts.bw:
            link_opts["bw"] = self.opts.bw
        if self.opts.delay:
            link_opts["delay"] = self.opts.delay
        if self.opts.loss:
            link_opts["loss"] = self.opts.loss
        self.hosts = []
        for m in sorted(self.config.jobs[0].members, key=lambda m: m.worker):
            h = self._quiet_host(net.addHost(f"{self.tag}h{m.worker + 1}", ip=f"{m.ip}/24",
                                             mac=m.mac))
            self._quiet_link(net.addLink(h, self.switch, **link_opts))  # port = worker id
            self.hosts.append((h, m))
        if self.kind == "reference":
            self.agg_host = self._quiet_host(net.addHost(
                f"{self.tag}a", ip=f"{self.config.ip}/24", mac=self.config.mac))
            self._quiet_link(net.addLink(self.agg_host, self.switch))
        net.build()
        net.start()
        # Static ARP: the P4/DPDK switch answers no ARP, and on the bridge it saves the
        # first window from the kernel's small queue of packets awaiting resolution.
        for h, _ in self.hosts:
            h.cmd("ip neigh replace", self.config.ip, "lladdr", self.config.mac,
                  "dev", h.defaultIntf())
        if self.kind == "reference":
            for _, m in self.hosts:
                self.agg_host.cmd("ip neigh replace", m.ip, "lladdr", m.mac,
                                  "dev", self.agg_host.defaultIntf())
        self._start_aggregator()

    @staticmethod
    def _quiet_host(host):
        """IPv6 off in a host's namespace before its links exist: no router solicitation
        or neighbour discovery, which a switch would count as not routable."""
        host.cmd("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
                 "net.ipv6.conf.default.disable_ipv6=1")
        return host

    @staticmethod
    def _quiet_link(link) -> None:
        """IPv6 off on the switch's end of a link (it lives in this namespace)."""
        quiet_ipv6(link.intf2.name)

    def _switch_ports(self) -> list[str]:
        """Switch interfaces in port order (port p = the link to worker p)."""
        return [str(h.connectionsTo(self.switch)[0][1]) for h, _ in self.hosts]

    def _start_aggregator(self) -> None:
        try:
            if self.kind == "reference":
                self.agg_process = aggregators.start_reference(
                    self.agg_host.popen, self.config_path, self.config.ip, AGG_UDP_PORT,
                    counters_json=self.workdir / "counters.json")
            elif self.kind == "dpdk":
                vdevs = [f"net_af_packet{p},iface={intf}"
                         for p, intf in enumerate(self._switch_ports())]
                self.agg_process = aggregators.start_dpdk(subprocess.Popen, self.config, vdevs,
                                                          self.workdir)
            else:
                self._start_bmv2()
        except aggregators.AggregatorError as exc:
            raise TestbedError(str(exc)) from exc

    def _start_bmv2(self) -> None:
        from dataplane.bmv2.switch import Bmv2StartError, Bmv2Switch, compile_program
        from dataplane.bmv2.control import DEFAULT_BMV2_JSON, DEFAULT_P4INFO, P4Controller
        compile_program()
        # A free gRPC port: gRPC servers share a port (SO_REUSEPORT), so a fixed one
        # could reach a stale switch instead of this one.
        switch = Bmv2Switch(dict(enumerate(self._switch_ports())), self.workdir / "bmv2.log")
        try:
            switch.start()
        except Bmv2StartError as exc:
            raise TestbedError(str(exc)) from exc
        self.agg_process = switch.process
        self.controller = P4Controller(switch.grpc_addr, timeout=20.0)
        self.controller.connect(DEFAULT_P4INFO, DEFAULT_BMV2_JSON)
        self.controller.install(self.config)
        switch.set_queue_depth()       # the DLCP stage's queue depth (p4control)

    # -- run --
    def worker_command(self, member: Member) -> list[str]:
        """Default: host.netlab.testbed.worker. A custom --command may use {worker}, {ip},
        {config}, {aggregator}, {job}, {values}, {seed} placeholders."""
        aggregator = f"{self.config.ip}:{AGG_UDP_PORT}"
        if self.opts.command:
            text = self.opts.command.format(worker=member.worker, ip=member.ip,
                                            config=self.config_path, aggregator=aggregator,
                                            job=JOB_ID, values=self.opts.values,
                                            seed=self.opts.seed)
            return ["bash", "-c", text]
        return [sys.executable, "-m", "host.netlab.testbed.worker", "--config", str(self.config_path),
                "--job", str(JOB_ID), "--worker", str(member.worker), "--aggregator",
                aggregator, "--values", str(self.opts.values), "--values-per-packet",
                str(self.opts.values_per_packet), "--seed", str(self.opts.seed),
                "--timeout", str(self.opts.timeout)]

    def run_hosts(self, progress=None) -> dict[str, dict]:
        procs = []
        for h, m in self.hosts:
            p = h.popen(self.worker_command(m), cwd=str(REPO_ROOT), env=aggregators.python_env(),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.processes.append(p)
            procs.append((h, p))
        results = {}
        deadline = time.monotonic() + self.opts.timeout + 30
        for h, p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                results[h.name] = {"ok": False, "error": "timed out", "stderr": err[-2000:]}
                continue
            finally:
                if progress is not None:
                    progress.update(1)
            results[h.name] = _parse_host_output(out, err, p.returncode)
        return results

    def stop_aggregator(self) -> dict | None:
        """Stop the switch/service and return its final counters when it gives them.
        The process is stopped even when reading the counters fails."""
        counters = None
        try:
            if self.controller is not None:
                try:
                    counters = self.controller.counters()
                finally:
                    self.controller.close()
                    self.controller = None
        finally:
            self._stop_agg_process()
        for name in ("counters.json", "dpdk_stats.json"):
            path = self.workdir / name
            if counters is None and path.is_file():
                counters = json.loads(path.read_text())
        return counters

    def _stop_agg_process(self) -> None:
        aggregators.stop(self.agg_process, timeout=10)

    # -- tear down --
    def teardown(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.processes.clear()
        try:
            self.stop_aggregator()
        except Exception:
            pass                       # the network still has to go
        if self.net is not None:
            self.net.stop()
            self.net = None
        cleanup_interfaces(self.tag)


def _parse_host_output(out: str, err: str, rc: int) -> dict:
    for line in reversed(out.strip().splitlines()):
        try:
            result = json.loads(line)
            if isinstance(result, dict):
                result.setdefault("ok", rc == 0)
                return result
        except json.JSONDecodeError:
            continue
    return {"ok": rc == 0, "returncode": rc, "stdout": out[-2000:], "stderr": err[-2000:]}


# Names this module gives its links and bridges: t<pid>s, t<pid>h<n>, t<pid>a (+ -eth<k>).
TESTBED_LINK_RE = re.compile(r"^t\d{1,4}(s|a|h\d+)(-eth\d+)?$")


def _delete_links(matches) -> list[str]:
    """Delete every network interface whose name `matches`; return the names deleted."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    removed = []
    for line in out.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if matches(name):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            removed.append(name)
    return removed


def cleanup_leftovers() -> list[str]:
    """After a testbed was killed (no finally ran): delete every link it may have left."""
    return _delete_links(TESTBED_LINK_RE.match)


def cleanup_interfaces(tag: str) -> list[str]:
    """mn -c for one testbed only: delete links and bridges whose names start with tag."""
    return _delete_links(lambda name: name.startswith(tag))


def run_testbed(opts: TestbedOptions, progress=None) -> TestbedResult:
    """Build, configure, run every host, collect, tear down (also on failure)."""
    bed = Testbed(opts)
    try:
        bed.build()
        result = TestbedResult(bed.kind)
        result.hosts = bed.run_hosts(progress)
        result.counters = bed.stop_aggregator()
        result.ok = all(r.get("ok") for r in result.hosts.values())
        return result
    except ConfigError as exc:
        raise TestbedError(str(exc)) from exc
    finally:
        bed.teardown()
