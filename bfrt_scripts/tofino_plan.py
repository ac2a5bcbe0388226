"""What the TNA program (p4src/tna) needs installed for a job description, without a switch.

`plan_switch(config, options)` turns a `dataplane.config.SwitchConfig` (the JSON that
`SwitchConfig.save` writes, the same file BMv2, DPDK and the reference read) into every
write the bfrt_python scripts make: table entries by bfrt name, multicast nodes and groups,
Traffic Manager queue settings, port bring-up. It refuses a description the program cannot
hold with a `ConfigError` naming the limit and what to lower, before anything touches a
switch. `counters_from_cells` turns the counter cells read back into the protocol's names.

The job layout (dense job index, slot base, counter block, multicast group) and the
counter cells both P4 programs share come from `dataplane.job_plan`; this module keeps the
TNA program's limits and names. Pure standard-library Python plus `dataplane.config`,
`dataplane.job_plan` and `dataplane.wire` (all standard library only), so the SDE's
bfshell Python imports it as well as the project's venv: one validation, one plan, for the
dry run, the tests and the switch.
"""
from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field

from dataplane import job_plan
from dataplane.config import MAX_WORKERS, NUM_QUEUES, ConfigError, Job, SwitchConfig
from dataplane.job_plan import (JobLayout, check_job_capacity, job_layouts, jobs_in_order,
                                lane_pairs, members_in_order, next_hop_bases, switch_ports)
from dataplane.wire import (AGG_FRAME_OVERHEAD, HEADER_LEN, IPV4_LEN, MAX_FRAME, TYPE_DATA,
                            TYPE_FLUSH, UDP_LEN, payload_len)

# ---- resource limits of p4src/tna (headers.p4, counters.p4); keep in step with the P4 ----
TOFINO_MAX_VALUES = 64          # values per packet in one pass (MAX_VALUES)
INDEX_BYTES = TOFINO_MAX_VALUES // 2
SUM_WORDS = TOFINO_MAX_VALUES // 4
MAX_JOBS = 16
SLOT_BUDGET = 8192              # slots of all jobs together (two copies each)
MAX_ROUTES = 1024
NEXT_HOP_SLOTS = 8192
GLOBAL_COUNTER_CELLS_SIZE = 16
# The MAC takes frames of at most MAX_FRAME bytes (protocol.md §4.1; $RX_MTU counts the
# 4-byte FCS) and counts longer ones as $FrameTooLong: the program's drop_oversize.
PORT_MTU = MAX_FRAME + 4
MAX_DEV_PORT = 511
QUEUE_DEPTH_MAX_CELLS = (1 << 19) - 1   # enq_qdepth is 19 bits (cells)
MARK_CELLS_MAX = (1 << 31) - 1          # K - enq_qdepth keeps its sign (dlcp.p4)
DEFAULT_PROGRAM = "thc_ina"
PLANE = "the Tofino program"

# Cell sizes of the traffic manager buffer (tm.cfg.cell_size_bytes).
CELL_BYTES = {1: 80, 2: 176}
YELLOW_STEPS = ("12.5%", "25%", "37.5%", "50%", "62.5%", "75%", "87.5%", "100%")

# ---- bfrt names (pipe.<control instance path>.<table>) ----
INGRESS = "pipe.SwitchIngress"
EGRESS = "pipe.SwitchEgress"
T_JOBS = f"{INGRESS}.job_membership.jobs"
T_MEMBERS = f"{INGRESS}.job_membership.members"
T_SWITCH_ADDRESS = f"{INGRESS}.switch_address.switch_address"
T_AGG_LENGTHS = f"{INGRESS}.validation.agg_lengths"
T_EXPECTED_BITS = (f"{INGRESS}.validation.expected_bits_high",
                   f"{INGRESS}.validation.expected_bits_mid",
                   f"{INGRESS}.validation.expected_bits_low")
EXPECTED_CHUNKS = ((21, 11, "set_bits_a"), (10, 11, "set_bits_b"), (0, 10, "set_bits_c"))
T_EXPECTED_TOO_FEW = f"{INGRESS}.validation.expected_too_few"
T_EXPECTED_IN_JOB = f"{INGRESS}.validation.expected_in_job"
T_DSCP = f"{INGRESS}.dlcp_classify.dscp_to_queue"
T_DROP_REPORTING = f"{INGRESS}.dlcp_classify.drop_reporting"
T_ROUTES = f"{INGRESS}.ipv4_forwarding.routes"
T_NEXT_HOPS = f"{INGRESS}.ipv4_forwarding.next_hops"
T_MEMBER_ADDRESSES = f"{EGRESS}.member_addressing.member_addresses"
T_CONTRIBUTOR_BITS = tuple(f"{EGRESS}.result_shape.contributor_bits_{k}" for k in range(4))
CONTRIBUTOR_ACTIONS = ("set_bits_a", "set_bits_b", "set_bits_c", "set_bits_d")
T_QUEUE_THRESHOLDS = f"{EGRESS}.dlcp_admission.queue_thresholds"
C_JOB = f"{INGRESS}.job_counters"
C_GLOBAL = f"{INGRESS}.global_counters"
C_DLCP = f"{EGRESS}.dlcp_admission.dlcp_counters"

# Slot registers (p4src/tna/aggregation.p4, thc_ina.p4): bfrt path -> data fields. A copy's
# cell is copy_index = (round & 1) ++ slot_index (validation.p4): slot s of the shared slot
# registers owns cells s and SLOT_BUDGET + s of every per-copy register; `occupancy` has
# one cell per slot (both copies' flags).
R_OCCUPANCY = f"{INGRESS}.occupancy"
SLOT_REGISTERS = {R_OCCUPANCY: ("copy0", "copy1")}
COPY_REGISTERS = {
    **{f"{INGRESS}.slot_state.{name}": ("f1",)
       for name in ("copy_round", "copy_seen", "copy_left")},
    **{f"{INGRESS}.result_fields.{name}": ("f1",)
       for name in ("copy_contributors", "result_expected", "result_tensor", "result_offset",
                    "result_num_values", "result_min_count")},
    **{f"{INGRESS}.sums_{word}.lanes": ("f1",) for word in range(SUM_WORDS)},
}


def lookup_table(position: int) -> str:
    return f"{INGRESS}.lookup_{position}.byte_to_lanes"


# Per-job counter cells (p4src/tna/counters.p4): the program counts outcomes. Its global
# and DLCP cells are the BMv2 program's (dataplane/job_plan.py).
JOB_CELLS = {"pending": 0, "complete": 1, "duplicate": 2, "reserved": 3, "straggler": 4,
             "flush": 5, "drop_bad_slot": 6, "drop_not_member": 7, "drop_bad_expected": 8,
             "drop_unsatisfiable": 9}
# The protocol's per-job names (protocol.md 4.5) as sums of outcome cells.
JOB_NAMES = {
    "rx": ("pending", "complete", "duplicate", "reserved", "straggler", "flush"),
    "aggregated": ("pending", "complete"),
    "results_multicast": ("complete",),
    "results_reserved": ("reserved",),
    "straggler_notices": ("straggler",),
    "flushes": ("flush",),
    "drop_bad_slot": ("drop_bad_slot",),
    "drop_not_member": ("drop_not_member",),
    "drop_bad_expected": ("drop_bad_expected",),
    "drop_duplicate": ("duplicate",),
    "drop_unsatisfiable": ("drop_unsatisfiable",),
}


# --------------------------------------------------------------------------- plan types
@dataclass(frozen=True)
class Ternary:
    value: int
    mask: int


@dataclass(frozen=True)
class Lpm:
    value: int
    prefix_length: int


@dataclass(frozen=True)
class Range:
    low: int
    high: int


def key_kwargs(key) -> dict:
    """bfrt_python keyword arguments of a key: name=v (exact), name/name_mask (ternary),
    name/name_p_length (lpm), name_start/name_end (range)."""
    out = {}
    for name, value in key:
        if isinstance(value, Ternary):
            out[name], out[f"{name}_mask"] = value.value, value.mask
        elif isinstance(value, Lpm):
            out[name], out[f"{name}_p_length"] = value.value, value.prefix_length
        elif isinstance(value, Range):
            out[f"{name}_start"], out[f"{name}_end"] = value.low, value.high
        else:
            out[name] = value
    return out


@dataclass(frozen=True)
class TableEntry:
    """One entry by bfrt names: key values are ints (exact) or Ternary / Lpm / Range;
    MATCH_PRIORITY is the priority of a ternary or range entry. Data values are ints."""
    table: str
    key: tuple[tuple[str, object], ...]
    action: str
    data: tuple[tuple[str, int], ...] = ()

    @property
    def key_dict(self) -> dict:
        return dict(self.key)

    @property
    def data_dict(self) -> dict:
        return dict(self.data)


@dataclass(frozen=True)
class DefaultEntry:
    """The default action of a (keyless) table."""
    table: str
    action: str
    data: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class MulticastNode:
    node_id: int
    rid: int                      # egress_rid of the replica: the member's worker id
    dev_ports: tuple[int, ...]


@dataclass(frozen=True)
class MulticastGroup:
    mgid: int
    node_ids: tuple[int, ...]     # one node per member, in worker-id order


@dataclass(frozen=True)
class QueueSetting:
    """One (port, queue) of the traffic manager (tm.queue.*)."""
    dev_port: int
    queue: int                    # the logical qid the ingress sets
    priority: int                 # strict priority: 7 served first
    capacity_cells: int           # buffer_only limit: the DLCP capacity C
    yellow_limit: str             # colour limit for Not-ECT data (K / C, rounded up)


@dataclass(frozen=True)
class PortSetting:
    dev_port: int
    speed: str
    fec: str


@dataclass(frozen=True)
class DeployOptions:
    """What the job description does not say: the switch's hardware and SDE."""
    program: str = DEFAULT_PROGRAM
    tofino: int = 1                         # 1 or 2: cell size, TM table prefix
    port_map: tuple[tuple[int, int], ...] = ()   # protocol port -> dev_port (default: same)
    speed: str = "BF_SPEED_100G"
    fec: str = "BF_FEC_TYP_NONE"
    add_ports: bool = False                 # bring the ports up (port.port) as well
    # one dev_port per pipe whose queue receives (and counts) that pipe's TM drops
    drop_report_ports: tuple[int, ...] = ()
    dlcp_packet_bytes: int | None = None    # frame size the queue limits are sized for

    @classmethod
    def from_dict(cls, d: dict | None) -> "DeployOptions":
        d = dict(d or {})
        if "port_map" in d:
            d["port_map"] = tuple((int(k), int(v)) for k, v in dict(d["port_map"]).items())
        legacy = d.pop("drop_report_port", None)    # job files of the one-port option
        if legacy is not None and "drop_report_ports" not in d:
            d["drop_report_ports"] = (legacy,)
        d["drop_report_ports"] = tuple(int(p) for p in d.get("drop_report_ports") or ())
        return cls(**d)

    def to_dict(self) -> dict:
        return {"program": self.program, "tofino": self.tofino,
                "port_map": {str(k): v for k, v in self.port_map},
                "speed": self.speed, "fec": self.fec, "add_ports": self.add_ports,
                "drop_report_ports": list(self.drop_report_ports),
                "dlcp_packet_bytes": self.dlcp_packet_bytes}

    def dev_port(self, port: int) -> int:
        return dict(self.port_map).get(port, port)


@dataclass
class TofinoPlan:
    layouts: dict[int, JobLayout]
    entries: list[TableEntry] = field(default_factory=list)
    defaults: list[DefaultEntry] = field(default_factory=list)
    nodes: list[MulticastNode] = field(default_factory=list)
    groups: list[MulticastGroup] = field(default_factory=list)
    queues: list[QueueSetting] = field(default_factory=list)
    ports: list[PortSetting] = field(default_factory=list)
    drop_report_ports: dict[int, int] = field(default_factory=dict)   # pipe -> dev_port
    cells_per_packet: int = 1
    frame_ports: tuple[int, ...] = ()       # dev_ports the program takes frames on

    @property
    def drops_reported(self) -> bool:
        """Whether TM drops reach the egress to be counted (a drop-report port per pipe)."""
        return bool(self.drop_report_ports)

    def tables(self) -> dict[str, list[TableEntry]]:
        by_table: dict[str, list[TableEntry]] = {}
        for e in self.entries:
            by_table.setdefault(e.table, []).append(e)
        return by_table

    def summary(self) -> list[tuple[int, str]]:
        rows = [(len(v), k) for k, v in sorted(self.tables().items())]
        rows += [(len(self.defaults), "default actions"), (len(self.nodes), "multicast nodes"),
                 (len(self.groups), "multicast groups"), (len(self.queues), "TM queues"),
                 (len(self.ports), "ports")]
        return rows


def _entry(table: str, key: dict, action: str, data: dict | None = None) -> TableEntry:
    return TableEntry(table, tuple(key.items()), action, tuple((data or {}).items()))


def mac_int(mac: str) -> int:
    return int(mac.replace(":", ""), 16)


def ip_int(ip: str) -> int:
    return int(ipaddress.IPv4Address(ip))


# --------------------------------------------------------------------------- checks
def values_per_packet(job: Job) -> int:
    """The job's values_per_packet (protocol v2 R7)."""
    return int(job.values_per_packet)


def validate(config: SwitchConfig) -> None:
    """dataplane.config's validation (the one every control plane runs) with this program's
    limits, then what only Tofino limits. Raises ConfigError saying what to lower."""
    config.validate(max_slots=SLOT_BUDGET, max_values=TOFINO_MAX_VALUES, plane=PLANE)
    for job in config.jobs:
        vpp = values_per_packet(job)
        if vpp > TOFINO_MAX_VALUES:
            raise ConfigError(f"job {job.job}: values_per_packet {vpp} exceeds {PLANE}'s limit "
                              f"of {TOFINO_MAX_VALUES} values per packet; lower "
                              "values_per_packet")
    check_job_capacity(config, PLANE, MAX_JOBS, SLOT_BUDGET, "MAX_JOBS in p4src/tna/headers.p4")
    if len(config.routes) > MAX_ROUTES:
        raise ConfigError(f"{len(config.routes)} routes; {PLANE} holds at most {MAX_ROUTES}: "
                          "aggregate prefixes")
    hops = sum(len(r.next_hops) for r in config.routes)
    if hops > NEXT_HOP_SLOTS:
        raise ConfigError(f"{hops} next hops in all routes; {PLANE} holds at most "
                          f"{NEXT_HOP_SLOTS}: drop some extra_hops")


def _check_options(config: SwitchConfig, options: DeployOptions) -> None:
    if options.tofino not in CELL_BYTES:
        raise ConfigError(f"tofino {options.tofino}: the program targets Tofino 1 or 2")
    for port, dev in options.port_map:
        if not 0 <= dev <= MAX_DEV_PORT:
            raise ConfigError(f"port_map: protocol port {port} -> dev_port {dev} is not a "
                              f"device port (0..{MAX_DEV_PORT})")
    for dev in options.drop_report_ports:
        if not 0 <= dev <= MAX_DEV_PORT:
            raise ConfigError(f"drop-report port {dev} is not a device port (0..{MAX_DEV_PORT})")
    for job in config.jobs:
        for m in job.members:
            if not 0 <= options.dev_port(m.port) <= MAX_DEV_PORT:
                raise ConfigError(f"job {job.job} worker {m.worker}: port {m.port} has no "
                                  "device port; add it to port_map")
        pipes = sorted({pipe_of(options.dev_port(m.port)) for m in job.members})
        if len(pipes) > 1:
            raise ConfigError(f"job {job.job}: members on pipes {pipes}; a pipe's slot "
                              "registers see only the packets entering that pipe: attach "
                              "the job's workers to ports of one pipe")


def drop_report_plan(config: SwitchConfig, options: DeployOptions) -> dict[int, int]:
    """pipe -> the drop-report port of that pipe. The TM deflects a drop to the mirror-drop
    queue of the pipe it happened on, which must be a port of that pipe (tm.pipe.cfg is
    per pipe): every pipe whose queues the description uses needs one, or its drops go
    uncounted."""
    if not options.drop_report_ports:
        return {}
    by_pipe: dict[int, int] = {}
    for dev in options.drop_report_ports:
        pipe = pipe_of(dev)
        if by_pipe.get(pipe, dev) != dev:
            raise ConfigError(f"drop-report ports {by_pipe[pipe]} and {dev} are both on pipe "
                              f"{pipe}: a pipe has one mirror-drop queue; give one port per pipe")
        by_pipe[pipe] = dev
    carried: dict[int, list[int]] = {}
    for dev in (options.dev_port(p) for p in switch_ports(config)):
        carried.setdefault(pipe_of(dev), []).append(dev)
    for pipe, devs in sorted(carried.items()):
        if pipe not in by_pipe:
            raise ConfigError(f"pipe {pipe} (dev_ports {', '.join(map(str, sorted(devs)))}) has "
                              "no drop-report port, so its TM drops would go uncounted: add "
                              f"--drop-report-port with a dev_port of pipe {pipe}")
    return by_pipe


def pipe_of(dev_port: int) -> int:
    """DEVPORT_PIPE of tofino1_specs.p4: bits 8:7 of the device port."""
    return dev_port >> 7


# --------------------------------------------------------------------------- planning
def job_entries(config: SwitchConfig, job: Job, layout: JobLayout,
                options: DeployOptions) -> list[TableEntry]:
    mask = job.member_mask
    entries = [_entry(T_JOBS, {"job": job.job}, "set_job", {
        "job_index": layout.index, "counter_base": layout.counter_base,
        "slot_base": layout.slot_base,
        "pool_size": layout.pool_size, "values_per_packet": values_per_packet(job),
        "member_count": len(job.members), "group": layout.group_id})]
    # rule R3: expected names members only, i.e. no bit outside the member mask
    entries.append(_entry(T_EXPECTED_IN_JOB, {"job": job.job,
                                              "expected": Ternary(0, ~mask & 0xFFFFFFFF),
                                              "MATCH_PRIORITY": 1}, "members_only"))
    for m in members_in_order(job):
        entries.append(_entry(T_MEMBERS, {
            "job": job.job, "worker": m.worker, "port": options.dev_port(m.port),
            "mac": mac_int(m.mac), "ip": ip_int(m.ip), "udp_port": m.udp_port}, "member"))
        entries.append(_entry(T_MEMBER_ADDRESSES, {"job": job.job, "worker": m.worker},
                              "address_member", {
                                  "switch_mac": mac_int(config.mac),
                                  "switch_ip": ip_int(config.ip),
                                  "member_mac": mac_int(m.mac), "member_ip": ip_int(m.ip),
                                  "member_udp_port": m.udp_port}))
    return entries + lookup_entries(job, layout)


def lookup_entries(job: Job, layout: JobLayout) -> list[TableEntry]:
    """The 256-entry byte table of every byte position, keyed on the job's dense index:
    b -> (T[b >> 4], T[b & 15])."""
    pairs = lane_pairs(job)
    return [_entry(lookup_table(position), {"job_index": layout.index, "packed": byte},
                   "set_lanes", {"high_value": high, "low_value": low})
            for position in range(INDEX_BYTES) for byte, (high, low) in enumerate(pairs)]


def multicast(job: Job, layout: JobLayout,
              options: DeployOptions) -> tuple[list[MulticastNode], MulticastGroup]:
    """One PRE node per member (rid = worker id, the member's port), in worker-id order."""
    nodes = [MulticastNode(layout.index * MAX_WORKERS + m.worker + 1, m.worker,
                           (options.dev_port(m.port),))
             for m in members_in_order(job)]
    return nodes, MulticastGroup(layout.group_id, tuple(n.node_id for n in nodes))


def _length_entry(pkt_type: int, num_values: Ternary, udp_length: int) -> TableEntry:
    """UDP length as the type and count say, IPv4 length 20 more, the frame parsed whole."""
    return _entry(T_AGG_LENGTHS, {"pkt_type": Ternary(pkt_type, 0xF), "num_values": num_values,
                                  "udp_length": Ternary(udp_length, 0xFFFF),
                                  "ip_length": Ternary(IPV4_LEN + udp_length, 0xFFFF),
                                  "parser_err": Ternary(0, 0xFFFF),
                                  "MATCH_PRIORITY": 1}, "length_fits")


def validation_entries() -> list[TableEntry]:
    """Protocol constants the program reads from tables (validation.p4, aggregation.p4)."""
    agg_udp = UDP_LEN + HEADER_LEN          # UDP length of an AGG packet without payload
    entries = [_length_entry(TYPE_DATA, Ternary(n, 0xFFFF), agg_udp + payload_len(TYPE_DATA, n))
               for n in range(1, TOFINO_MAX_VALUES + 1)]
    # FLUSH: num_values ignored
    entries.append(_length_entry(TYPE_FLUSH, Ternary(0, 0), agg_udp + payload_len(TYPE_FLUSH, 0)))
    for table, (_, width, action) in zip(T_EXPECTED_BITS, EXPECTED_CHUNKS):
        entries += [_entry(table, {"chunk": chunk}, action, {"bits": bin(chunk).count("1")})
                    for chunk in range(1 << width)]
    widths = [width for _, width, _ in EXPECTED_CHUNKS]
    for a in range(widths[0] + 1):
        for b in range(widths[1] + 1):
            for c in range(widths[2] + 1):
                too_few = Range(a + b + c + 1, 63)
                entries.append(_entry(T_EXPECTED_TOO_FEW, {
                    "bits_a": a, "bits_b": b, "bits_c": c, "min_count": too_few,
                    "MATCH_PRIORITY": 1}, "too_few_expected"))
    for table, action in zip(T_CONTRIBUTOR_BITS, CONTRIBUTOR_ACTIONS):
        entries += [_entry(table, {"byte": byte}, action, {"bits": bin(byte).count("1")})
                    for byte in range(256)]
    return entries


def cells_per_packet(config: SwitchConfig, options: DeployOptions) -> int:
    """Queue cells one packet takes: the DLCP limits are in packets, the TM's in cells.
    Sized for the largest RESULT of the description unless the options say otherwise."""
    frame = options.dlcp_packet_bytes
    if frame is None:
        largest = max((values_per_packet(j) for j in config.jobs), default=TOFINO_MAX_VALUES)
        frame = AGG_FRAME_OVERHEAD + largest
    return max(1, math.ceil(frame / CELL_BYTES[options.tofino]))


def yellow_limit(threshold: int, capacity: int) -> str:
    """The smallest colour-limit step at or above the (K + 1)-th packet: the TM never drops
    a Not-ECT packet the reference keeps; the egress drops the ones between K and it."""
    if threshold >= capacity:
        return YELLOW_STEPS[-1]
    step = math.ceil(len(YELLOW_STEPS) * (threshold + 1) / capacity)
    return YELLOW_STEPS[min(max(step, 1), len(YELLOW_STEPS)) - 1]


def dlcp_plan(config: SwitchConfig, options: DeployOptions,
              ports: list[int]) -> tuple[list[TableEntry], list[QueueSetting], int]:
    dlcp = config.dlcp
    cpp = cells_per_packet(config, options)
    capacity_cells = dlcp.capacity * cpp
    if capacity_cells > QUEUE_DEPTH_MAX_CELLS:
        raise ConfigError(f"dlcp: capacity {dlcp.capacity} packets x {cpp} cells = "
                          f"{capacity_cells} cells exceeds {PLANE}'s queue limit of "
                          f"{QUEUE_DEPTH_MAX_CELLS} cells (19-bit queue depth); lower capacity")
    entries = [_entry(T_DSCP, {"ipv4_valid": 1, "dscp": dscp}, "set_queue",
                      {"queue": queue, "is_data": int(is_data)})
               for dscp, (queue, is_data) in sorted(dlcp.dscp_map.items())]
    for queue in range(NUM_QUEUES):
        # K in cells; a threshold past the capacity never marks (the queue is full first).
        # Below 2^31: the egress reads the sign of K - depth (depth < 2^19 cells).
        mark = min(int(dlcp.thresholds[queue]) * cpp, MARK_CELLS_MAX)
        entries.append(_entry(T_QUEUE_THRESHOLDS, {"queue": queue}, "set_threshold",
                              {"mark_cells": mark}))
    queues = [QueueSetting(port, queue, queue, capacity_cells,
                           yellow_limit(int(dlcp.thresholds[queue]), dlcp.capacity))
              for port in ports for queue in range(NUM_QUEUES)]
    return entries, queues, cpp


def route_entries(config: SwitchConfig, options: DeployOptions) -> list[TableEntry]:
    """One LPM entry per route naming its next-hop group, one entry per next hop (route i
    owns turn cell i and next_hops next_hop_base .. next_hop_base + k - 1, in order)."""
    entries = []
    for index, (r, base) in enumerate(zip(config.routes, next_hop_bases(config))):
        net = ipaddress.IPv4Network(r.prefix, strict=False)
        hops = r.next_hops
        prefix = Lpm(int(net.network_address), net.prefixlen)
        entries.append(_entry(T_ROUTES, {"dst_addr": prefix}, "spray", {
            "route_index": index, "next_hop_base": base, "next_hop_last": len(hops) - 1,
            "switch_mac": mac_int(config.mac)}))
        for offset, (port, mac) in enumerate(hops):
            entries.append(_entry(T_NEXT_HOPS, {"next_hop_index": base + offset}, "set_next_hop",
                                  {"port": options.dev_port(port), "next_hop_mac": mac_int(mac)}))
    return entries


def slot_cells(slot_base: int, pool_size: int) -> tuple[range, list[int]]:
    """The cells a job's slots own: in SLOT_REGISTERS (one per slot) and in COPY_REGISTERS
    (two per slot: copy_index = parity ++ slot index)."""
    slots = range(slot_base, slot_base + pool_size)
    return slots, [parity * SLOT_BUDGET + s for parity in (0, 1) for s in slots]


def used_ports(config: SwitchConfig, options: DeployOptions) -> list[int]:
    ports = {options.dev_port(p) for p in switch_ports(config)}
    return sorted(ports | set(options.drop_report_ports))


def plan_switch(config: SwitchConfig, options: DeployOptions | None = None) -> TofinoPlan:
    """Everything to install for `config`; raises ConfigError with what to change."""
    options = options or DeployOptions()
    validate(config)
    _check_options(config, options)
    layouts = job_layouts(config)
    plan = TofinoPlan(layouts)
    plan.entries.append(_entry(T_SWITCH_ADDRESS, {"dst_addr": ip_int(config.ip)},
                               "aggregator_address"))
    for job in jobs_in_order(config):
        layout = layouts[job.job]
        plan.entries += job_entries(config, job, layout, options)
        nodes, group = multicast(job, layout, options)
        plan.nodes += nodes
        plan.groups.append(group)
    plan.entries += validation_entries()
    ports = used_ports(config, options)
    plan.frame_ports = tuple(sorted(set(ports)))
    dlcp_entries, plan.queues, plan.cells_per_packet = dlcp_plan(config, options, ports)
    plan.entries += dlcp_entries
    plan.entries += route_entries(config, options)
    plan.drop_report_ports = drop_report_plan(config, options)
    plan.defaults.append(DefaultEntry(T_DROP_REPORTING, "set_drop_reporting",
                                      (("enabled", int(plan.drops_reported)),)))
    if options.add_ports:
        plan.ports = [PortSetting(p, options.speed, options.fec) for p in ports]
    return plan


# --------------------------------------------------------------------------- counters
def counters_from_cells(layouts: dict[int, JobLayout], job_cells: dict[int, int],
                        global_cells: dict[int, int], dlcp_cells: dict[int, int],
                        drops_reported: bool = True,
                        frames_too_long: int | None = None) -> dict:
    """Counter cells read from the switch -> the {"global", "jobs"} dict of protocol 4.5.

    Without a drop-report port the TM's drops are not seen by the program: the two DLCP
    drop counters are then None (unknown), never a number that looks measured. Likewise
    drop_oversize is the MACs' $FrameTooLong over the program's ports (`frames_too_long`),
    None where those could not be read."""
    job_parts = {name: tuple(JOB_CELLS[c] for c in parts) for name, parts in JOB_NAMES.items()}
    out = job_plan.counters_from_cells(layouts, job_parts, job_cells, global_cells, dlcp_cells)
    if not drops_reported:
        out["global"]["dlcp_selective_drop"] = out["global"]["dlcp_buffer_drop"] = None
    out["global"]["drop_oversize"] = frames_too_long
    return out
