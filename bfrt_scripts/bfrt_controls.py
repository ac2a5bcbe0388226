"""bfrt_python controls of the TNA program: one class per P4 control, as SwitchML's
controller has, plus the packet replication engine, the traffic manager and the ports.

Everything writes through a `BfrtWriter`, which makes every write idempotent (read the
entry, leave it when it already holds the planned action and data, modify it when it
differs, add it when it is missing) and, in a dry run, prints the write instead of making
it. The `bfrt` object is the one bfshell puts in scope (`bfshell -b` / `run_bfshell.sh -b`);
with `bfrt=None` the writer plans for a clean switch (every write is an add).

    switch = ThcInaSwitch(bfrt, DeployOptions(program="thc_ina"))
    plan = switch.install(SwitchConfig.load("job.json"))   # ConfigError before any write
    print(switch.counters(plan))
"""
from __future__ import annotations

import ipaddress
import re

from bfrt_scripts.tofino_plan import (
    C_DLCP, C_GLOBAL, C_JOB, GLOBAL_COUNTER_CELLS_SIZE, INDEX_BYTES, NUM_QUEUES,
    T_AGG_LENGTHS, T_CONTRIBUTOR_BITS, T_DROP_REPORTING, T_DSCP, T_EXPECTED_BITS,
    T_EXPECTED_IN_JOB, T_EXPECTED_TOO_FEW, T_JOBS, T_MEMBER_ADDRESSES, T_MEMBERS,
    T_NEXT_HOPS, T_QUEUE_THRESHOLDS, T_ROUTES, T_SWITCH_ADDRESS, YELLOW_STEPS, DefaultEntry,
    DeployOptions, TableEntry, TofinoPlan, counters_from_cells, key_kwargs, lookup_table,
    pipe_of, plan_switch)
from dataplane.job_plan import JOB_COUNTER_STRIDE

_MAC_RE = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


class BfrtError(RuntimeError):
    """The switch refused or could not do what the script asked for."""


def as_int(value):
    """A value as bfrt_python shows it (int, MAC or IPv4 string, bool) -> int."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    text = str(value)
    if _MAC_RE.match(text):
        return int(text.replace(":", ""), 16)
    try:
        return int(ipaddress.IPv4Address(text))
    except ValueError:
        return int(text, 0)


def _same(current, wanted) -> bool:
    if isinstance(wanted, (list, tuple)):
        return isinstance(current, (list, tuple)) and \
            sorted(as_int(v) for v in current) == sorted(as_int(v) for v in wanted)
    if isinstance(wanted, str):
        return str(current) == wanted
    return as_int(current) == as_int(wanted)


def _field(data: dict, name: str):
    """A field of a raw entry: the SDE's fixed tables show theirs as $NAME."""
    return data[name] if name in data else data.get(f"${name}")


def _short(action) -> str | None:
    return None if action is None else str(action).rsplit(".", 1)[-1]


def _format(kwargs: dict) -> str:
    return " ".join(f"{k}={v:#x}" if isinstance(v, int) and not isinstance(v, bool) and v > 255
                    else f"{k}={v}" for k, v in kwargs.items())


class BfrtWriter:
    """Idempotent reads and writes through the bfrt object, or a dry run that prints them."""

    def __init__(self, bfrt, program: str, dry_run: bool = False, out=print,
                 verbose: bool = False):
        self.bfrt = bfrt
        self.program = program
        self.dry_run = dry_run or bfrt is None
        self.out = out
        self.verbose = verbose
        self.changes: list[tuple[str, str, dict]] = []
        self.unchanged = 0

    # -- navigation --
    def node(self, path: str, in_program: bool = True):
        node = getattr(self.bfrt, self.program) if in_program else self.bfrt
        for part in path.split("."):
            node = getattr(node, part)
        return node

    # -- reading --
    def read(self, path: str, key: dict, in_program: bool = True, from_hw: bool = False):
        """The raw entry {"key", "data", "action"} at `key`, or None when there is none
        (or when planning for a clean switch)."""
        if self.bfrt is None:
            return None
        kwargs = dict(key, print_ents=False)
        if from_hw:
            kwargs["from_hw"] = True
        entry = self.node(path, in_program).get(**kwargs)
        if entry is None or entry == -1:
            return None
        if isinstance(entry, list):
            if not entry:
                return None
            entry = entry[0]
        return entry.raw()

    def read_default(self, path: str):
        if self.bfrt is None:
            return None
        entry = self.node(path).get_default(print_ent=False)
        return None if entry is None or entry == -1 else entry.raw()

    # -- writing --
    def write(self, path: str, method: str, kwargs: dict, in_program: bool = True) -> None:
        target = f"{self.program}.{path}" if in_program else path
        self.changes.append((method, target, dict(kwargs)))
        if self.dry_run or self.verbose:
            self.out(f"{'would ' if self.dry_run else ''}{method} {target} {_format(kwargs)}")
        if self.dry_run:
            return
        try:
            getattr(self.node(path, in_program), method)(**kwargs)
        except Exception as exc:    # bfrt_python raises plain exceptions or BfRtTableError
            raise BfrtError(f"{method} on {target} ({_format(kwargs)}) failed: {exc}") from exc

    def ensure(self, path: str, key: dict, data: dict, action: str | None = None,
               in_program: bool = True, method_base: str = "", modify_only: bool = False):
        """Make the entry at `key` hold `data` (and `action`): nothing if it does."""
        current = self.read(path, key, in_program)
        if current is not None and (action is None or _short(current.get("action")) == action) \
                and all(_field(current["data"], name) is not None
                        and _same(_field(current["data"], name), value)
                        for name, value in data.items()):
            self.unchanged += 1
            return
        suffix = f"_with_{action}" if action else ""
        op = "mod" if (current is not None or modify_only) else "add"
        self.write(path, f"{op}{suffix}{method_base}", {**key, **data}, in_program)

    def ensure_entry(self, entry: TableEntry) -> None:
        self.ensure(entry.table, key_kwargs(entry.key), entry.data_dict, entry.action)

    def ensure_default(self, entry: DefaultEntry) -> None:
        current = self.read_default(entry.table)
        data = dict(entry.data)
        if current is not None and _short(current.get("action")) == entry.action and \
                all(_field(current["data"], k) is not None
                    and _same(_field(current["data"], k), v) for k, v in data.items()):
            self.unchanged += 1
            return
        self.write(entry.table, f"set_default_with_{entry.action}", data)


class Control:
    """A P4 control: the tables it owns and how its entries get installed."""
    tables: tuple[str, ...] = ()

    def __init__(self, writer: BfrtWriter):
        self.writer = writer

    def entries(self, plan: TofinoPlan) -> list[TableEntry]:
        owned = set(self.tables)
        return [e for e in plan.entries if e.table in owned]

    def install(self, plan: TofinoPlan) -> None:
        for entry in self.entries(plan):
            self.writer.ensure_entry(entry)
        for default in plan.defaults:
            if default.table in self.tables:
                self.writer.ensure_default(default)


class JobMembership(Control):
    """jobs (per-job parameters) and members (rule R2: job, worker, port, MAC, IP, UDP)."""
    tables = (T_JOBS, T_MEMBERS)


class SwitchAddress(Control):
    """The aggregator's own IPv4 address (rule R4: fragments to it are dropped)."""
    tables = (T_SWITCH_ADDRESS,)


class AggValidation(Control):
    """Protocol constants (lengths by type and count, popcount(expected) chunks, R3) and
    per job the members an expected set may name."""
    tables = (T_AGG_LENGTHS, *T_EXPECTED_BITS, T_EXPECTED_TOO_FEW, T_EXPECTED_IN_JOB)


class ByteLookup(Control):
    """One byte position's THC table: packed byte -> two 8-bit lane values, per job."""

    def __init__(self, writer: BfrtWriter, position: int):
        super().__init__(writer)
        self.position = position
        self.tables = (lookup_table(position),)


class DlcpClassify(Control):
    """DSCP -> (queue, is_data), and whether TM drops are deflected to be counted."""
    tables = (T_DSCP, T_DROP_REPORTING)


class Ipv4Forwarding(Control):
    """Routes (LPM) naming their next-hop groups, and the next hops (round-robin spray)."""
    tables = (T_ROUTES, T_NEXT_HOPS)


class MemberAddressing(Control):
    """Egress: (job, worker) -> the member's MAC, IPv4, UDP port and worker bit."""
    tables = (T_MEMBER_ADDRESSES,)


class ResultShape(Control):
    """Egress: popcount of the contributor bytes (the RESULT's count)."""
    tables = T_CONTRIBUTOR_BITS


class DlcpAdmission(Control):
    """Egress: K[queue] in queue cells for CE marking; the DLCP counters."""
    tables = (T_QUEUE_THRESHOLDS,)

    def read_counters(self) -> dict[int, int]:
        return read_counter(self.writer, C_DLCP, range(4))


class SwitchIngress(Control):
    """The ingress's own externs: the per-job and global counters."""

    def read_counters(self, plan: TofinoPlan) -> tuple[dict[int, int], dict[int, int]]:
        cells = [layout.counter_base + c for layout in plan.layouts.values()
                 for c in range(JOB_COUNTER_STRIDE)]
        return (read_counter(self.writer, C_JOB, cells),
                read_counter(self.writer, C_GLOBAL, range(GLOBAL_COUNTER_CELLS_SIZE)))


class SlotState(Control):
    """Read-only view of one copy's registers, for an operator looking at a stuck slot."""
    REGISTERS = ("copy_round", "copy_seen", "copy_left")

    def read_copy(self, copy_index: int) -> dict[str, list[int]]:
        out = {}
        for name in self.REGISTERS:
            path = f"pipe.SwitchIngress.slot_state.{name}"
            raw = self.writer.read(path, {"REGISTER_INDEX": copy_index}, from_hw=True)
            field = f"SwitchIngress.slot_state.{name}.f1"
            out[name] = [] if raw is None else list(raw["data"].get(field, []))
        return out


def read_counter(writer: BfrtWriter, path: str, cells) -> dict[int, int]:
    """Packet counts of counter cells, read from the hardware."""
    out = {}
    for cell in cells:
        raw = writer.read(path, {"COUNTER_INDEX": cell}, from_hw=True)
        out[cell] = 0 if raw is None else as_int(raw["data"].get("$COUNTER_SPEC_PKTS", 0))
    return out


class PacketReplicationEngine:
    """Multicast nodes (one per member: rid = worker id, the member's port) and groups."""

    def __init__(self, writer: BfrtWriter):
        self.writer = writer

    def install(self, plan: TofinoPlan) -> None:
        for node in plan.nodes:         # a group names its nodes: nodes first
            self.writer.ensure("pre.node", {"MULTICAST_NODE_ID": node.node_id},
                               {"MULTICAST_RID": node.rid, "MULTICAST_LAG_ID": [],
                                "DEV_PORT": list(node.dev_ports)}, in_program=False)
        for group in plan.groups:
            n = len(group.node_ids)
            self.writer.ensure("pre.mgid", {"MGID": group.mgid},
                               {"MULTICAST_NODE_ID": list(group.node_ids),
                                "MULTICAST_NODE_L1_XID_VALID": [False] * n,
                                "MULTICAST_NODE_L1_XID": [0] * n}, in_program=False)


class TrafficManager:
    """Strict priority (queue 7 first), capacity C as the queue's buffer limit, the yellow
    colour limit for Not-ECT data (K / C, rounded up), and the drop-report queue."""

    def __init__(self, writer: BfrtWriter, tofino: int = 1):
        self.writer = writer
        self.prefix = f"tf{tofino}.tm"

    def queue_of(self, dev_port: int, queue: int) -> dict:
        """The (pg_id, pg_queue) of a port's logical queue, from tm.port.cfg."""
        raw = self.writer.read(f"{self.prefix}.port.cfg", {"dev_port": dev_port},
                               in_program=False)
        if raw is None:             # a plan for a clean switch: name it by port and qid
            return {"pg_id": f"<pg of dev_port {dev_port}>",
                    "pg_queue": f"<queue {queue} of dev_port {dev_port}>"}
        queues = raw["data"]["egress_qid_queues"]
        if queue >= len(queues):
            raise BfrtError(f"dev_port {dev_port} has {len(queues)} queues; the DLCP stage "
                            f"needs {NUM_QUEUES} (tm.port.group: carve 8 queues per port)")
        return {"pg_id": as_int(raw["data"]["pg_id"]), "pg_queue": as_int(queues[queue])}

    def install(self, plan: TofinoPlan) -> None:
        w = self.writer
        for q in plan.queues:
            key = self.queue_of(q.dev_port, q.queue)
            w.ensure(f"{self.prefix}.queue.sched_cfg", key,
                     {"min_priority": str(q.priority), "max_priority": str(q.priority)},
                     in_program=False, modify_only=True)
            w.ensure(f"{self.prefix}.queue.buffer", key,
                     {"guaranteed_cells": q.capacity_cells, "tail_drop_enable": True},
                     action="buffer_only", in_program=False, modify_only=True)
            w.ensure(f"{self.prefix}.queue.color", key,
                     {"drop_enable": True, "drop_limit_yellow": q.yellow_limit,
                      "drop_limit_red": YELLOW_STEPS[0]}, in_program=False, modify_only=True)
        if plan.drop_report_port is not None:
            key = self.queue_of(plan.drop_report_port, 0)
            pipe = pipe_of(plan.drop_report_port)
            w.ensure(f"{self.prefix}.pipe.cfg", {"pipe": pipe},
                     {"mirror_drop_pg_id": key["pg_id"], "mirror_drop_pg_queue": key["pg_queue"]},
                     in_program=False, modify_only=True)


class Ports:
    """Port bring-up (port.port), when the deployment asks for it."""

    def __init__(self, writer: BfrtWriter):
        self.writer = writer

    def install(self, plan: TofinoPlan) -> None:
        for p in plan.ports:
            self.writer.ensure("port.port", {"DEV_PORT": p.dev_port},
                               {"SPEED": p.speed, "FEC": p.fec, "PORT_ENABLE": True},
                               in_program=False)


class ThcInaSwitch:
    """The whole deployment: plan (refusing what the program cannot hold), then ports,
    multicast, every control's tables and the traffic manager, in that order."""

    def __init__(self, bfrt, options: DeployOptions | None = None, dry_run: bool = False,
                 out=print, verbose: bool = False):
        self.options = options or DeployOptions()
        self.writer = BfrtWriter(bfrt, self.options.program, dry_run, out, verbose)
        w = self.writer
        self.ports = Ports(w)
        self.pre = PacketReplicationEngine(w)
        self.controls: list[Control] = [
            JobMembership(w), SwitchAddress(w), AggValidation(w), DlcpClassify(w),
            Ipv4Forwarding(w), *(ByteLookup(w, k) for k in range(INDEX_BYTES)),
            MemberAddressing(w), ResultShape(w), DlcpAdmission(w)]
        self.ingress = SwitchIngress(w)
        self.slot_state = SlotState(w)
        self.tm = TrafficManager(w, self.options.tofino)

    def plan(self, config) -> TofinoPlan:
        return plan_switch(config, self.options)

    def install(self, config) -> TofinoPlan:
        plan = self.plan(config)            # ConfigError here: nothing written yet
        owned = {t for c in self.controls for t in c.tables}
        missing = {e.table for e in plan.entries} - owned
        if missing:                         # a planned table no control installs: a bug
            raise BfrtError(f"no control installs {sorted(missing)}")
        self.ports.install(plan)
        self.pre.install(plan)
        for control in self.controls:
            control.install(plan)
        self.tm.install(plan)
        return plan

    def counters(self, plan: TofinoPlan) -> dict:
        """Counters since the program was loaded, named as protocol.md 4.5."""
        job_cells, global_cells = self.ingress.read_counters(plan)
        dlcp = next(c for c in self.controls if isinstance(c, DlcpAdmission))
        return counters_from_cells(plan.layouts, job_cells, global_cells, dlcp.read_counters(),
                                   drops_reported=plan.drop_report_port is not None)

    def summary(self) -> str:
        w = self.writer
        verb = "would write" if w.dry_run else "wrote"
        return f"{verb} {len(w.changes)} entries, {w.unchanged} already as planned"
