"""The job description: one description, every data plane.

The reference aggregator reads it directly, the DPDK switch reads the file that
`SwitchConfig.save` writes, and the P4Runtime controller installs it into BMv2.
See docs/protocol.md §3 for the rules enforced here.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import numbers
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Re-exported: readers of a job description ask this module for the wire's port range
# and version; dataplane/wire.py defines them.
from dataplane.wire import AGG_PORT_BASE, AGG_PORT_MASK  # noqa: F401
from dataplane.wire import VERSION as PROTOCOL_VERSION  # noqa: F401

MAX_WORKERS = 32               # contributor bitmaps are 32 bits
MAX_VALUES = 8192              # values per packet of the software planes (protocol §8)
DEFAULT_VALUES_PER_PACKET = 1024
DEFAULT_POOL_SIZE = 256
# What a member gets when the description leaves them out: the UDP service ignores both
# (the kernel owns the ports), and the DPDK host service wants one shared MAC on port 0
# (dataplane/dpdk_runner.py, HostService).
DEFAULT_MEMBER_PORT = 0
DEFAULT_MEMBER_MAC = "02:00:00:00:00:01"
DEFAULT_LOCAL_PORT_BASE = 41000
DLCP_MAX_CAPACITY = 1 << 20    # packets per (port, queue), protocol §6
DLCP_MAX_THRESHOLD = (1 << 32) - 1
NUM_QUEUES = 8
CONTROL_DSCP = 48              # CS6 -> queue 7
DATA_DSCP_BASE = 32            # data band b -> DSCP 32 + b -> queue 6 - b
NUM_DATA_BANDS = 7
LANE_MAX = 255                 # 8-bit result lanes

_MAC_RE = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


class ConfigError(ValueError):
    """A job description that no data plane may accept; the message says what to change."""


def _check_mac(mac: str, what: str) -> None:
    if not _MAC_RE.match(mac):
        raise ConfigError(f"{what}: MAC address {mac!r} is not of the form aa:bb:cc:dd:ee:ff")


def _check_ip(ip: str, what: str) -> None:
    try:
        ipaddress.IPv4Address(ip)
    except ValueError as exc:
        raise ConfigError(f"{what}: {ip!r} is not an IPv4 address") from exc


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class Member:
    worker: int
    port: int                  # switch port the worker is attached to
    mac: str
    ip: str
    udp_port: int

    def validate(self, job: int) -> None:
        what = f"job {job} worker {self.worker}"
        if not 0 <= self.worker < MAX_WORKERS:
            raise ConfigError(f"{what}: worker id must be in 0..{MAX_WORKERS - 1}")
        if not 0 <= self.port < 512:
            raise ConfigError(f"{what}: switch port {self.port} must be in 0..511")
        if not 0 < self.udp_port < 65536:
            raise ConfigError(f"{what}: UDP port {self.udp_port} must be in 1..65535")
        _check_mac(self.mac, what)
        _check_ip(self.ip, what)


@dataclass(frozen=True)
class Job:
    job: int
    pool_size: int
    table: tuple[int, ...]
    members: tuple[Member, ...]
    # The most values any DATA of the job carries: slot storage per copy is sized by it,
    # a DATA with more is drop_bad_length (protocol §4.1, R7).
    values_per_packet: int = DEFAULT_VALUES_PER_PACKET

    @classmethod
    def from_thc(cls, job: int, pool_size: int, members, bits: int = 4,
                 granularity: int = 30, p: float = 1 / 32, symmetric: bool = True,
                 values_per_packet: int = DEFAULT_VALUES_PER_PACKET) -> "Job":
        from thc import optimal_table  # lazy: the data planes need no codec
        table = tuple(int(v) for v in optimal_table(bits, granularity, p, symmetric=symmetric))
        return cls(job, pool_size, table, tuple(members), values_per_packet)

    @property
    def member_mask(self) -> int:
        """Bit w set for every member worker w (the `expected` of a whole-job round)."""
        bitmap = 0
        for m in self.members:
            bitmap |= 1 << m.worker
        return bitmap

    expected_all = member_mask

    @property
    def member_count(self) -> int:
        return len(self.members)

    def validate(self, max_slots: int = 65536, max_values: int = MAX_VALUES,
                 plane: str = "this data plane") -> None:
        what = f"job {self.job}"
        if not 0 <= self.job < 65536:
            raise ConfigError(f"{what}: job id must fit in 16 bits")
        if not 1 <= self.pool_size <= max_slots:
            raise ConfigError(f"{what}: pool_size {self.pool_size} must be in 1..{max_slots} "
                              "(this data plane's slot budget)")
        vpp = self.values_per_packet
        if not _is_int(vpp) or vpp < 1:
            raise ConfigError(f"{what}: values_per_packet {vpp!r} must be a positive integer")
        if vpp > max_values:
            raise ConfigError(f"{what}: values_per_packet {vpp} exceeds {plane}'s limit of "
                              f"{max_values} values per packet; lower values_per_packet")
        t = list(self.table)
        if len(t) != 16:
            raise ConfigError(f"{what}: the table needs 16 entries (4-bit indices), got {len(t)}")
        if t[0] != 0 or any(b <= a for a, b in zip(t, t[1:])):
            raise ConfigError(f"{what}: the table must start at 0 and strictly increase, got {t}")
        if not self.members:
            raise ConfigError(f"{what}: a job needs at least one member")
        if len(self.members) > MAX_WORKERS:
            raise ConfigError(f"{what}: {len(self.members)} members; at most {MAX_WORKERS}")
        ids = [m.worker for m in self.members]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{what}: duplicate worker ids in {sorted(ids)}")
        for m in self.members:
            m.validate(self.job)
        self._check_addresses_distinct()
        n, g = len(self.members), t[-1]
        if n * g > LANE_MAX:
            raise ConfigError(
                f"{what}: {n} workers x granularity {g} = {n * g} overflows the 8-bit result "
                f"lanes (max {LANE_MAX}); use granularity <= {LANE_MAX // n} or at most "
                f"{LANE_MAX // g} workers per job")

    def _check_addresses_distinct(self) -> None:
        """A member is bound to its (ip, udp_port): two members may not share one (R2)."""
        seen = {}
        for m in sorted(self.members, key=lambda m: m.worker):
            key = (m.ip, m.udp_port)
            if key in seen:
                raise ConfigError(
                    f"job {self.job}: workers {seen[key]} and {m.worker} share the address "
                    f"{m.ip}:{m.udp_port}; a member is known by its (ip, udp_port), give "
                    "each worker its own udp_port")
            seen[key] = m.worker


def default_thresholds(base: float = 8.0, d: float = 0.5) -> tuple[int, ...]:
    """Per-queue selective-drop thresholds K[q]: K[6-b] = base*(1+d*b); control unbounded."""
    k = [0] * NUM_QUEUES
    for band in range(NUM_DATA_BANDS):
        k[NUM_DATA_BANDS - 1 - band] = int(round(base * (1 + d * band)))
    k[NUM_QUEUES - 1] = 0xFFFF
    return tuple(k)


def window_thresholds(workers: int, pool_size: int, capacity: int,
                      d: float = 0.5) -> tuple[int, ...]:
    """K[q] for an in-network job: no data band's threshold below what the job's own
    window can put in one queue (every worker with pool_size chunks in flight), capped at
    the capacity, so a job alone never meets a selective drop: only traffic on top of its
    window (overload) does. Where that leaves room below the capacity, the bands keep
    their order (K[6-b] = base(1 + d b), base = the window)."""
    window = workers * pool_size
    return tuple(min(k, capacity) if q < NUM_QUEUES - 1 else k
                 for q, k in enumerate(default_thresholds(window, d)))


def default_dscp_map() -> dict[int, tuple[int, bool]]:
    """DSCP -> (queue, is_data). Unlisted DSCPs go to queue 0 without selective drop."""
    m = {DATA_DSCP_BASE + b: (NUM_DATA_BANDS - 1 - b, True) for b in range(NUM_DATA_BANDS)}
    m[CONTROL_DSCP] = (NUM_QUEUES - 1, False)
    return m


def band_to_dscp(band: int) -> int:
    if not 0 <= band < NUM_DATA_BANDS:
        raise ValueError(f"band {band} outside 0..{NUM_DATA_BANDS - 1}")
    return DATA_DSCP_BASE + band


@dataclass(frozen=True)
class Dlcp:
    dscp_map: dict[int, tuple[int, bool]] = field(default_factory=default_dscp_map)
    thresholds: tuple[int, ...] = field(default_factory=default_thresholds)
    capacity: int = 64

    def validate(self) -> None:
        """The one DLCP validation every control plane runs (protocol §6, R6)."""
        if len(self.thresholds) != NUM_QUEUES:
            raise ConfigError(f"dlcp: need {NUM_QUEUES} thresholds, got {len(self.thresholds)}")
        if not _is_int(self.capacity) or not 1 <= self.capacity <= DLCP_MAX_CAPACITY:
            raise ConfigError(f"dlcp: capacity {self.capacity!r} must be an integer in "
                              f"1..{DLCP_MAX_CAPACITY} packets per (port, queue)")
        for queue, k in enumerate(self.thresholds):
            if not _is_int(k) or not 0 <= k <= DLCP_MAX_THRESHOLD:
                raise ConfigError(f"dlcp: threshold {k!r} of queue {queue} must be an integer "
                                  f"in 0..{DLCP_MAX_THRESHOLD}")
        for dscp, (queue, _) in self.dscp_map.items():
            if not (_is_int(dscp) and _is_int(queue) and 0 <= dscp < 64
                    and 0 <= queue < NUM_QUEUES):
                raise ConfigError(f"dlcp: DSCP {dscp!r} -> queue {queue!r} out of range "
                                  "(0..63 -> 0..7)")

    def classify(self, dscp: int) -> tuple[int, bool]:
        return self.dscp_map.get(dscp, (0, False))


MAX_NEXT_HOPS = 8             # next hops per route (docs/protocol.md §7)
MAX_SWITCH_PORT = 511


@dataclass(frozen=True)
class Route:
    prefix: str                # "10.0.0.0/24"
    port: int
    mac: str                   # next-hop MAC
    # Further equal-cost next hops (port, mac): ordinary packets are sprayed round-robin
    # over next_hops, in order (docs/protocol.md §7). Empty: a single next hop.
    extra_hops: tuple[tuple[int, str], ...] = ()

    def __post_init__(self):
        # JSON gives lists; keep the frozen Route hashable and comparable.
        object.__setattr__(self, "extra_hops",
                           tuple((int(p), str(m)) for p, m in self.extra_hops))

    @property
    def next_hops(self) -> tuple[tuple[int, str], ...]:
        return ((self.port, self.mac),) + self.extra_hops

    def validate(self) -> None:
        try:
            ipaddress.IPv4Network(self.prefix)
        except ValueError as exc:
            raise ConfigError(f"route {self.prefix!r}: not an IPv4 prefix") from exc
        hops = self.next_hops
        if len(hops) > MAX_NEXT_HOPS:
            raise ConfigError(f"route {self.prefix}: {len(hops)} next hops; at most "
                              f"{MAX_NEXT_HOPS} (drop some extra_hops)")
        for port, mac in hops:
            if not 0 <= port <= MAX_SWITCH_PORT:
                raise ConfigError(f"route {self.prefix}: next-hop port {port} must be in "
                                  f"0..{MAX_SWITCH_PORT}")
            _check_mac(mac, f"route {self.prefix}")


@dataclass(frozen=True)
class SwitchConfig:
    mac: str = "02:00:00:00:00:fe"
    ip: str = "10.0.0.254"
    jobs: tuple[Job, ...] = ()
    dlcp: Dlcp = field(default_factory=Dlcp)
    routes: tuple[Route, ...] = ()

    def validate(self, max_slots: int = 65536, max_values: int = MAX_VALUES,
                 plane: str = "this data plane") -> "SwitchConfig":
        """Refuse what no data plane may accept; `max_slots`/`max_values` are the plane's
        own limits, named as `plane` in the messages."""
        _check_mac(self.mac, "switch")
        _check_ip(self.ip, "switch")
        ids = [j.job for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"two jobs share an id: {sorted(ids)}")
        for j in self.jobs:
            j.validate(max_slots, max_values, plane)
        self.dlcp.validate()
        for r in self.routes:
            r.validate()
        return self

    def job(self, job_id: int) -> Job:
        for j in self.jobs:
            if j.job == job_id:
                return j
        raise KeyError(job_id)

    # -- serialization: the file the DPDK switch and the P4 controller read --
    def to_dict(self) -> dict:
        d = asdict(self)
        d["dlcp"]["dscp_map"] = {str(k): [q, bool(is_data)] for k, (q, is_data)
                                 in self.dlcp.dscp_map.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SwitchConfig":
        """The description from its JSON form; a missing or unknown field is a ConfigError
        that names it (a member's `port` and `mac` may be left out: see DEFAULT_MEMBER_*)."""
        if not isinstance(d, dict):
            raise ConfigError(f"a job description is a JSON object, got {type(d).__name__}")
        jobs = tuple(_job_from_dict(j) for j in d.get("jobs", ()))
        dl = d.get("dlcp", {})
        dlcp = Dlcp(
            dscp_map={int(k): (int(v[0]), bool(v[1])) for k, v in dl["dscp_map"].items()}
            if "dscp_map" in dl else default_dscp_map(),
            thresholds=tuple(dl.get("thresholds", default_thresholds())),
            capacity=dl.get("capacity", 64))
        routes = tuple(Route(**r) for r in d.get("routes", ()))
        return cls(d.get("mac", cls.mac), d.get("ip", cls.ip), jobs, dlcp, routes)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SwitchConfig":
        """Read a saved description; a missing file or bad JSON is a ConfigError naming it."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"job description {str(path)!r}: {exc.strerror}; write one with "
                              "`python -m dataplane.config local --workers N -o job.json`") \
                from exc
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"job description {str(path)!r} is not JSON: {exc}") from exc
        except ConfigError as exc:
            raise ConfigError(f"job description {str(path)!r}: {exc}") from exc

    @classmethod
    def local(cls, workers: int | None = None, *, ip: str = "127.0.0.1",
              port_base: int = DEFAULT_LOCAL_PORT_BASE, addresses=None, job: int = 1,
              pool_size: int = DEFAULT_POOL_SIZE,
              values_per_packet: int = DEFAULT_VALUES_PER_PACKET, granularity: int = 30,
              switch_ip: str = "10.0.0.254") -> "SwitchConfig":
        """One job on one host, validated: worker w at (ip, port_base + w), or at
        addresses[w] = (ip, udp_port) when given; every member on switch port 0 with
        DEFAULT_MEMBER_MAC (the UDP service ignores both; the DPDK host service needs one
        shared MAC and a non-loopback ip, and its workers send to (switch_ip, 50000))."""
        if addresses is None:
            if not _is_int(workers) or workers < 1:
                raise ConfigError(f"workers {workers!r}: need a positive number of workers")
            addresses = [(ip, port_base + w) for w in range(workers)]
        elif workers is not None and workers != len(addresses):
            raise ConfigError(f"workers {workers} but {len(addresses)} addresses: give one "
                              "address per worker, or leave workers out")
        members = [Member(w, DEFAULT_MEMBER_PORT, DEFAULT_MEMBER_MAC, str(a_ip), int(a_port))
                   for w, (a_ip, a_port) in enumerate(addresses)]
        table_job = Job.from_thc(job, pool_size, members, granularity=granularity,
                                 values_per_packet=values_per_packet)
        return cls(ip=switch_ip, jobs=(table_job,)).validate()


_MEMBER_FIELDS = ("worker", "port", "mac", "ip", "udp_port")
_JOB_FIELDS = ("job", "pool_size", "table", "members", "values_per_packet")


def _check_fields(d, allowed, required, what: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"{what}: expected a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ConfigError(f"{what}: unknown field(s) {unknown}; the fields are {list(allowed)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"{what}: missing field(s) {missing}")


def _job_from_dict(j) -> Job:
    _check_fields(j, _JOB_FIELDS, ("job", "pool_size", "table", "members"), "a job")
    what = f"job {j['job']}"
    members = []
    for i, m in enumerate(j["members"]):
        _check_fields(m, _MEMBER_FIELDS, ("worker", "ip", "udp_port"), f"{what} member #{i}")
        members.append(Member(m["worker"], m.get("port", DEFAULT_MEMBER_PORT),
                              m.get("mac", DEFAULT_MEMBER_MAC), m["ip"], m["udp_port"]))
    return Job(j["job"], j["pool_size"], tuple(j["table"]), tuple(members),
               j.get("values_per_packet", DEFAULT_VALUES_PER_PACKET))


def main(argv=None) -> int:
    """`python -m dataplane.config local --workers N [...] -o job.json`: write a job
    description for N workers on this host (a refused one: a message and exit code 2)."""
    parser = argparse.ArgumentParser(prog="python -m dataplane.config",
                                     description="Write a job description (docs/protocol.md §3).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    local = sub.add_parser("local", help="one job whose workers all run on one host")
    local.add_argument("--workers", type=int, required=True, help="members (= world size)")
    local.add_argument("--ip", default="127.0.0.1",
                       help="the workers' IPv4 address (default %(default)s; for the DPDK host "
                            "service a non-loopback one, e.g. 10.0.0.1)")
    local.add_argument("--port-base", type=int, default=DEFAULT_LOCAL_PORT_BASE,
                       help="worker w binds UDP port base + w (default %(default)s)")
    local.add_argument("--job", type=int, default=1)
    local.add_argument("--pool-size", type=int, default=DEFAULT_POOL_SIZE)
    local.add_argument("--values-per-packet", type=int, default=DEFAULT_VALUES_PER_PACKET)
    local.add_argument("--granularity", type=int, default=30,
                       help="THC table granularity g (workers x g must stay <= 255)")
    local.add_argument("--switch-ip", default="10.0.0.254",
                       help="the switch's IPv4 address (DPDK host service: workers send to "
                            "it on port 50000; the UDP service ignores it)")
    local.add_argument("-o", "--output", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    try:
        config = SwitchConfig.local(args.workers, ip=args.ip, port_base=args.port_base,
                                    job=args.job, pool_size=args.pool_size,
                                    values_per_packet=args.values_per_packet,
                                    granularity=args.granularity, switch_ip=args.switch_ip)
        config.save(args.output)
    except (ConfigError, OSError) as exc:
        print(f"dataplane.config: refused: {exc}", file=sys.stderr)
        return 2
    j = config.jobs[0]
    print(f"wrote {args.output}: job {j.job}, {j.member_count} workers at {args.ip} UDP ports "
          f"{args.port_base}..{args.port_base + j.member_count - 1}, pool_size {j.pool_size}, "
          f"values_per_packet {j.values_per_packet}, granularity {j.table[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
