"""P4Runtime controller for the BMv2 program (p4src/v1model).

Two halves:

* `plan_switch(config)` turns a `dataplane.config.SwitchConfig` into the exact table
  entries and multicast groups the P4 program needs (pure Python, no switch needed,
  unit-tested): job layout and per-job parameters (values_per_packet, member mask and
  count), membership by address, the switch's own address (fragments), the per-byte
  lookup tables, multicast groups (one per job, egress_rid = worker id), per-member
  egress addressing, the DLCP DSCP map and queue limits, and the IPv4 routes.
* `P4Controller` pushes a plan to a running `simple_switch_grpc` through
  p4runtime-shell (imported only when a switch is contacted), loads the
  pipeline (BMv2 JSON + P4Info) and reads the counters back under the protocol names.

Installing is idempotent: every entry is inserted, and an entry that already exists is
modified to the planned value, so running it twice leaves the same state.

    python -m dataplane.bmv2.control --config job.json --grpc 127.0.0.1:9559 \
        --p4info build/p4/main.p4info.txtpb --bmv2-json build/p4/main.json
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dataplane import job_plan
from dataplane.config import NUM_QUEUES, ConfigError, Job, SwitchConfig
from dataplane.job_plan import (JobLayout, check_job_capacity, job_layouts, jobs_in_order,
                                lane_pairs, members_in_order, next_hop_bases, switch_ports)

# ---- resource limits of p4src/v1model (headers.p4); keep in step with the P4 ----
BMV2_MAX_VALUES = 64           # values per packet (protocol.md §8)
BMV2_DLCP_HISTORY = 1024       # DLCP_HISTORY in headers.p4
BMV2_QUEUE_DEPTH = BMV2_DLCP_HISTORY - 1   # set_queue_depth: enq_qdepth stays below the history
BMV2_MAX_CAPACITY = BMV2_QUEUE_DEPTH       # DLCP capacity: BMv2 holds that many per queue
BMV2_DLCP_PORTS = 32           # DLCP_PORTS in headers.p4: switch ports 0..31
INDEX_BYTES = BMV2_MAX_VALUES // 2
BMV2_MAX_JOBS = 16
BMV2_SLOT_BUDGET = 4096        # slots of all jobs together (two copies each)
BMV2_MAX_ROUTES = 1024         # MAX_ROUTES in forwarding.p4
BMV2_NEXT_HOP_SLOTS = 8192     # MAX_NEXT_HOP_SLOTS in forwarding.p4
PLANE = "the BMv2 program"

REPO_ROOT = Path(__file__).resolve().parents[2]
P4_SOURCE = REPO_ROOT / "p4src" / "v1model" / "main.p4"
BUILD_DIR = REPO_ROOT / "build" / "p4"
DEFAULT_BMV2_JSON = BUILD_DIR / "main.json"
DEFAULT_P4INFO = BUILD_DIR / "main.p4info.txtpb"

# ---- names in the P4Info (control instance path + local name) ----
T_JOBS = "SwitchIngress.job_membership.jobs"
T_MEMBERS = "SwitchIngress.job_membership.members"
T_OWN_ADDRESS = "SwitchIngress.fragment_filter.own_address"
T_ROUTES = "SwitchIngress.ipv4_forwarding.routes"
T_NEXT_HOPS = "SwitchIngress.ipv4_forwarding.next_hops"
T_DSCP = "SwitchIngress.dlcp_classify.dscp_to_queue"
T_QUEUE_LIMITS = "SwitchEgress.dlcp_admission.queue_limits"
T_MEMBER_ADDRESSES = "SwitchEgress.member_addressing.member_addresses"
LOOKUP_CONTROL = "SwitchIngress.lookup_{position}"
C_JOB = "SwitchIngress.job_counters"
C_GLOBAL = "SwitchIngress.global_counters"
C_DLCP = "SwitchEgress.dlcp_admission.dlcp_counters"
C_QUEUE_DEPARTURES = "SwitchEgress.dlcp_admission.queue_departures"

# Per-job counter cells (p4src/v1model/counters.p4): one per protocol.md §4.5 name. The
# global and DLCP cells are the Tofino program's as well (dataplane/job_plan.py).
JOB_COUNTER_CELLS = {
    "rx": 0, "aggregated": 1, "results_multicast": 2, "results_reserved": 3,
    "straggler_notices": 4, "flushes": 5, "drop_bad_slot": 6, "drop_not_member": 7,
    "drop_bad_expected": 8, "drop_duplicate": 9, "drop_unsatisfiable": 10,
}


class P4ControlError(RuntimeError):
    """The switch refused or could not run what the controller asked for."""


class SwitchUnreachable(P4ControlError):
    """No P4Runtime server answers at the given address."""


@dataclass(frozen=True)
class Entry:
    """One table entry: match fields and action parameters by their P4Info names."""
    table: str
    match: tuple[tuple[str, str], ...]
    action: str
    params: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> tuple:
        return (self.table, self.match)


@dataclass(frozen=True)
class MulticastGroup:
    group_id: int
    replicas: tuple[tuple[int, int], ...]      # (egress port, instance = egress_rid)


@dataclass
class SwitchPlan:
    layouts: dict[int, JobLayout]
    entries: list[Entry] = field(default_factory=list)
    groups: list[MulticastGroup] = field(default_factory=list)

    def tables(self) -> dict[str, list[Entry]]:
        by_table: dict[str, list[Entry]] = {}
        for e in self.entries:
            by_table.setdefault(e.table, []).append(e)
        return by_table


def _entry(table: str, match: dict, action: str, params: dict | None = None) -> Entry:
    return Entry(table, tuple((k, str(v)) for k, v in match.items()), action,
                 tuple((k, str(v)) for k, v in (params or {}).items()))


def _lookup_table(position: int) -> tuple[str, str]:
    control = LOOKUP_CONTROL.format(position=position)
    return f"{control}.byte_to_lanes", f"{control}.set_lanes"


# --------------------------------------------------------------------------- planning
def validate(config: SwitchConfig) -> None:
    """dataplane.config's validation with the BMv2 program's limits, then what only its
    limits refuse. Raises ConfigError saying what to change."""
    config.validate(max_slots=BMV2_SLOT_BUDGET, max_values=BMV2_MAX_VALUES, plane=PLANE)
    if config.dlcp.capacity > BMV2_MAX_CAPACITY:
        raise ConfigError(f"dlcp: capacity {config.dlcp.capacity} exceeds the BMv2 program's "
                          f"limit of {BMV2_MAX_CAPACITY} packets (its queue depth, below "
                          f"DLCP_HISTORY = {BMV2_DLCP_HISTORY}); lower capacity")
    ports = switch_ports(config)
    if ports and ports[-1] >= BMV2_DLCP_PORTS:
        raise ConfigError(f"switch port {ports[-1]}: the BMv2 program keeps DLCP queue state "
                          f"for ports 0..{BMV2_DLCP_PORTS - 1} (DLCP_PORTS in "
                          "p4src/v1model/headers.p4); renumber the ports")
    check_job_capacity(config, PLANE, BMV2_MAX_JOBS, BMV2_SLOT_BUDGET,
                       "MAX_JOBS in p4src/v1model/headers.p4")


def lookup_entries(job: Job) -> list[Entry]:
    """The 256-entry byte table of every byte position: b -> (T[b >> 4], T[b & 15])."""
    pairs = lane_pairs(job)
    entries = []
    for position in range(INDEX_BYTES):
        name, action = _lookup_table(position)
        for byte, (high, low) in enumerate(pairs):
            entries.append(_entry(name, {"job": job.job, "index_byte.packed": byte}, action,
                                  {"high_value": high, "low_value": low}))
    return entries


def multicast_group(job: Job, layout: JobLayout) -> MulticastGroup:
    """One replica per member, in worker-id order (protocol.md §5.1), rid = worker id."""
    members = members_in_order(job)
    return MulticastGroup(layout.group_id, tuple((m.port, m.worker) for m in members))


def job_entries(config: SwitchConfig, job: Job, layout: JobLayout) -> list[Entry]:
    entries = [_entry(T_JOBS, {"hdr.agg.job": job.job}, "SwitchIngress.job_membership.set_job",
                      {"job_index": layout.index, "slot_base": layout.slot_base,
                       "pool_size": layout.pool_size,
                       "values_per_packet": job.values_per_packet,
                       "member_mask": job.member_mask, "member_count": job.member_count})]
    for m in members_in_order(job):
        # A member is its whole address: port, MAC, IPv4, UDP port (protocol.md §4.1).
        entries.append(_entry(T_MEMBERS, {"hdr.agg.job": job.job, "hdr.agg.worker": m.worker,
                                          "standard_metadata.ingress_port": m.port,
                                          "hdr.ethernet.src_addr": m.mac,
                                          "hdr.ipv4.src_addr": m.ip,
                                          "hdr.udp.src_port": m.udp_port},
                              "SwitchIngress.job_membership.member"))
        entries.append(_entry(T_MEMBER_ADDRESSES, {"hdr.agg.job": job.job,
                                                   "meta.dest_worker": m.worker},
                              "SwitchEgress.member_addressing.address_member",
                              {"switch_mac": config.mac, "switch_ip": config.ip,
                               "member_mac": m.mac, "member_ip": m.ip,
                               "member_udp_port": m.udp_port}))
    return entries + lookup_entries(job)


def dlcp_entries(config: SwitchConfig) -> list[Entry]:
    entries = [_entry(T_DSCP, {"hdr.ipv4.dscp": dscp}, "SwitchIngress.dlcp_classify.set_queue",
                      {"queue": queue, "is_data": int(is_data)})
               for dscp, (queue, is_data) in sorted(config.dlcp.dscp_map.items())]
    for queue in range(NUM_QUEUES):
        entries.append(_entry(T_QUEUE_LIMITS, {"meta.queue": queue},
                              "SwitchEgress.dlcp_admission.set_limits",
                              {"selective_threshold": int(config.dlcp.thresholds[queue]),
                               "queue_capacity": int(config.dlcp.capacity)}))
    return entries


def route_entries(config: SwitchConfig) -> list[Entry]:
    """One LPM entry per route naming its next-hop group, one entry per next hop.

    Route i owns the round-robin register cell i and the next_hops entries
    group_base .. group_base + k - 1, in the route's next-hop order (protocol.md §7)."""
    if len(config.routes) > BMV2_MAX_ROUTES:
        raise ConfigError(f"{len(config.routes)} routes; the BMv2 program holds at most "
                          f"{BMV2_MAX_ROUTES}")
    entries, bases = [], next_hop_bases(config)
    for index, (r, group_base) in enumerate(zip(config.routes, bases)):
        net = ipaddress.IPv4Network(r.prefix, strict=False)
        hops = r.next_hops
        entries.append(_entry(T_ROUTES, {"hdr.ipv4.dst_addr": str(net)},
                              "SwitchIngress.ipv4_forwarding.spray",
                              {"route_index": index, "group_base": group_base,
                               "group_size": len(hops), "switch_mac": config.mac}))
        for offset, (port, mac) in enumerate(hops):
            entries.append(_entry(T_NEXT_HOPS, {"next_hop_index": group_base + offset},
                                  "SwitchIngress.ipv4_forwarding.set_next_hop",
                                  {"port": port, "next_hop_mac": mac}))
    hops = sum(len(r.next_hops) for r in config.routes)
    if hops > BMV2_NEXT_HOP_SLOTS:
        raise ConfigError(f"{hops} next hops in all routes; the BMv2 program holds at "
                          f"most {BMV2_NEXT_HOP_SLOTS}")
    return entries


def own_address_entry(config: SwitchConfig) -> Entry:
    """The switch's IPv4 address: any fragment to it is drop_fragment (protocol.md §4.1)."""
    return _entry(T_OWN_ADDRESS, {"hdr.ipv4.dst_addr": config.ip},
                  "SwitchIngress.fragment_filter.switch_address")


def plan_switch(config: SwitchConfig) -> SwitchPlan:
    """Everything to install for `config`; raises ConfigError with what to change."""
    validate(config)
    layouts = job_layouts(config)
    plan = SwitchPlan(layouts, [own_address_entry(config)])
    for job in jobs_in_order(config):
        plan.entries.extend(job_entries(config, job, layouts[job.job]))
        plan.groups.append(multicast_group(job, layouts[job.job]))
    plan.entries.extend(dlcp_entries(config))
    plan.entries.extend(route_entries(config))
    return plan


def counters_from_cells(layouts: dict[int, JobLayout], job_cells: dict[int, int],
                        global_cells: dict[int, int], dlcp_cells: dict[int, int]) -> dict:
    """Counter cells read from the switch -> the {"global", "jobs"} dict of §4.5."""
    job_parts = {name: (cell,) for name, cell in JOB_COUNTER_CELLS.items()}
    return job_plan.counters_from_cells(layouts, job_parts, job_cells, global_cells, dlcp_cells)


# --------------------------------------------------------------------------- the switch
# p4runtime-shell and what comes with it (grpc, the p4.v1 and google.rpc protobuf modules)
# are imported inside the methods that talk to a switch, not at module level: plan_switch,
# --plan and the tests run without them, and p4runtime-shell pulls in IPython (over half a
# second). connect() imports it first, through _shell(), with a clear error when it is missing.
def _shell():
    try:
        import p4runtime_sh.shell as shell
    except ImportError as exc:
        raise P4ControlError("p4runtime-shell is not installed: make venv "
                             "(or pip install p4runtime-shell)") from exc
    return shell


class P4Controller:
    """A P4Runtime session with one simple_switch_grpc."""

    BATCH = 512                # updates per WriteRequest

    def __init__(self, grpc_addr: str = "127.0.0.1:9559", device_id: int = 0,
                 election_id: tuple[int, int] = (0, 1), timeout: float = 5.0):
        self.grpc_addr = grpc_addr
        self.device_id = device_id
        self.election_id = election_id
        self.timeout = timeout
        self.plan: SwitchPlan | None = None
        self._sh = None

    # -- session --
    def connect(self, p4info: str | Path | None = None, bmv2_json: str | Path | None = None):
        """Open the session; with both files, load them as the switch's pipeline."""
        if (p4info is None) != (bmv2_json is None):
            raise ValueError("give both p4info and bmv2_json (or neither, to keep the "
                             "pipeline the switch already runs)")
        if p4info is not None:
            for path in (p4info, bmv2_json):
                if not Path(path).is_file():
                    raise FileNotFoundError(
                        f"{path}: pipeline file missing; compile with: p4c --target bmv2 "
                        f"--arch v1model --p4runtime-files {DEFAULT_P4INFO} -o {BUILD_DIR} "
                        f"{P4_SOURCE}")
        shell = _shell()
        self._wait_for_server()
        config = None if p4info is None else shell.FwdPipeConfig(str(p4info), str(bmv2_json))
        try:
            shell.setup(device_id=self.device_id, grpc_addr=self.grpc_addr,
                        election_id=self.election_id, config=config, verbose=False)
        except SystemExit as exc:   # p4runtime-shell exits the process on set-up errors
            raise P4ControlError(
                f"P4Runtime set-up with {self.grpc_addr} (device {self.device_id}) failed: "
                "check the device id, that no other controller holds a higher election id, "
                "and that the P4Info matches the BMv2 JSON") from exc
        self._sh = shell
        return self

    def _wait_for_server(self) -> None:
        import grpc
        channel = grpc.insecure_channel(self.grpc_addr)
        try:
            grpc.channel_ready_future(channel).result(timeout=self.timeout)
        except grpc.FutureTimeoutError as exc:
            raise SwitchUnreachable(
                f"no P4Runtime server at {self.grpc_addr} after {self.timeout:.1f} s: start "
                f"simple_switch_grpc (its --grpc-server-addr must match) or fix --grpc") from exc
        finally:
            channel.close()

    def close(self) -> None:
        if self._sh is not None:
            self._sh.teardown()
            self._sh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- writing --
    def install(self, config: SwitchConfig) -> SwitchPlan:
        """Install everything `config` needs; safe to run again (modifies what exists)."""
        plan = plan_switch(config)     # refuses a bad job before touching the switch
        if self._sh is None:
            raise P4ControlError("not connected: call connect() first")
        updates = [self._table_entry(e).msg() for e in plan.entries]
        self._write_idempotent(updates, "table_entry")
        for group in plan.groups:
            self._write_group(group)
        self.plan = plan
        return plan

    def _table_entry(self, e: Entry):
        te = self._sh.TableEntry(e.table)(action=e.action)
        for name, value in e.match:
            te.match[name] = value
        for name, value in e.params:
            te.action[name] = value
        return te

    def _write_idempotent(self, messages, entity_field: str) -> None:
        """INSERT in batches; whatever already exists is sent again as MODIFY."""
        from p4.v1 import p4runtime_pb2
        from google.rpc import code_pb2
        from p4runtime_sh.p4runtime import P4RuntimeWriteException
        for start in range(0, len(messages), self.BATCH):
            batch = messages[start:start + self.BATCH]
            try:
                self._send(batch, entity_field, p4runtime_pb2.Update.INSERT)
            except P4RuntimeWriteException as exc:
                existing = [batch[i] for i, err in exc.errors
                            if err.canonical_code == code_pb2.ALREADY_EXISTS]
                other = [(i, err) for i, err in exc.errors
                         if err.canonical_code != code_pb2.ALREADY_EXISTS]
                if other:
                    raise P4ControlError(f"switch refused entries: {exc}") from exc
                if existing:
                    self._send(existing, entity_field, p4runtime_pb2.Update.MODIFY)

    def _send(self, messages, entity_field: str, update_type) -> None:
        from p4.v1 import p4runtime_pb2
        req = p4runtime_pb2.WriteRequest()
        for msg in messages:
            update = req.updates.add()
            update.type = update_type
            getattr(update.entity, entity_field).CopyFrom(msg)
        self._sh.client.write(req)

    def _write_group(self, group: MulticastGroup) -> None:
        from p4runtime_sh.p4runtime import P4RuntimeWriteException
        entry = self._sh.MulticastGroupEntry(group.group_id)
        for port, rid in group.replicas:
            entry.add(port, rid)
        try:
            entry.insert()
        except P4RuntimeWriteException:
            entry.modify()

    # -- reading --
    def _read_counter(self, name: str) -> dict[int, int]:
        cells = {}
        for ce in self._sh.CounterEntry(name).read():
            msg = ce.msg()
            cells[msg.index.index] = msg.data.packet_count
        return cells

    def counters(self) -> dict:
        """Counters since the pipeline was loaded, named as protocol.md §4.5."""
        if self._sh is None or self.plan is None:
            raise P4ControlError("connect() and install() before reading counters")
        return counters_from_cells(self.plan.layouts, self._read_counter(C_JOB),
                                   self._read_counter(C_GLOBAL), self._read_counter(C_DLCP))

    def port_departures(self, port: int) -> int:
        """Packets of `port`'s eight queues through the egress DLCP stage so far."""
        if self._sh is None:
            raise P4ControlError("connect() before reading counters")
        cells = self._read_counter(C_QUEUE_DEPARTURES)
        return sum(cells.get(port * NUM_QUEUES + q, 0) for q in range(NUM_QUEUES))


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataplane.bmv2.control", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="SwitchConfig JSON (dataplane/config.py)")
    ap.add_argument("--grpc", default="127.0.0.1:9559", help="simple_switch_grpc address")
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--p4info", help=f"P4Info text file (default {DEFAULT_P4INFO})")
    ap.add_argument("--bmv2-json", help=f"BMv2 JSON (default {DEFAULT_BMV2_JSON})")
    ap.add_argument("--keep-pipeline", action="store_true",
                    help="do not load a pipeline, install into the one running")
    ap.add_argument("--plan", action="store_true",
                    help="print the entry counts per table and exit (no switch needed)")
    ap.add_argument("--counters", action="store_true", help="print the counters as JSON")
    args = ap.parse_args(argv)
    try:
        config = SwitchConfig.load(args.config)
        if args.plan:
            plan = plan_switch(config)
            for table, entries in sorted(plan.tables().items()):
                print(f"{len(entries):6d}  {table}")
            print(f"{len(plan.groups):6d}  multicast groups")
            return 0
        ctl = P4Controller(args.grpc, args.device_id)
        files = (None, None) if args.keep_pipeline else (
            args.p4info or DEFAULT_P4INFO, args.bmv2_json or DEFAULT_BMV2_JSON)
        with ctl.connect(*files):
            plan = ctl.install(config)
            print(f"installed {len(plan.entries)} entries, {len(plan.groups)} multicast groups "
                  f"on {args.grpc}")
            if args.counters:
                print(json.dumps(ctl.counters(), indent=1))
    except (ConfigError, P4ControlError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
