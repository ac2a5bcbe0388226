"""bfrt_python controls of the TNA program: one class per P4 control, as SwitchML's
controller has, plus the packet replication engine, the traffic manager and the ports.

Everything goes through a `BfrtWriter`: each program table is read once (one dump), compared
with the plan, and only the differences are written (add what is missing, modify what
differs, delete what the plan no longer has), the program tables' writes in one bfrt_python
batch; in a dry run the writes are printed instead. The SDE's own tables are used only with
the operations their schemas offer (tm.pipe.cfg: set_default / get_default per pipe;
tm.queue.*: get / mod inside the port's pipe; tm.port.cfg: get). The `bfrt` object is the
one bfshell puts in scope (`bfshell -b` / `run_bfshell.sh -b`); with `bfrt=None` the writer
plans for a clean switch (every write is an add).

    switch = ThcInaSwitch(bfrt, DeployOptions(program="thc_ina"))
    plan = switch.install(SwitchConfig.load("job.json"))   # ConfigError before any write
    print(switch.counters(plan))
    switch.remove()                                        # the teardown
"""
from __future__ import annotations

import ipaddress
import re
from contextlib import contextmanager

from bfrt_scripts.tofino_plan import (
    C_DLCP, C_GLOBAL, C_JOB, COPY_REGISTERS, GLOBAL_COUNTER_CELLS_SIZE, INDEX_BYTES, MAX_JOBS,
    NUM_QUEUES, PORT_MTU, SLOT_REGISTERS, T_AGG_LENGTHS, T_CONTRIBUTOR_BITS, T_DROP_REPORTING, T_DSCP,
    T_EXPECTED_BITS, T_EXPECTED_IN_JOB, T_EXPECTED_TOO_FEW, T_JOBS, T_MEMBER_ADDRESSES,
    T_MEMBERS, T_NEXT_HOPS, T_QUEUE_THRESHOLDS, T_ROUTES, T_SWITCH_ADDRESS, YELLOW_STEPS,
    DefaultEntry, DeployOptions, Lpm, Range, TableEntry, Ternary, TofinoPlan,
    counters_from_cells, key_kwargs, lookup_table, pipe_of, plan_switch, slot_cells)
from dataplane.config import MAX_WORKERS
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


def holds(raw: dict | None, action: str | None, data: dict) -> bool:
    """Whether an entry as bfrt_python shows it (raw()) already holds `action` and `data`."""
    return raw is not None and (action is None or _short(raw.get("action")) == action) and \
        all(_field(raw["data"], name) is not None and _same(_field(raw["data"], name), value)
            for name, value in data.items())


def _shown_value(value):
    if isinstance(value, (list, tuple)):
        return tuple(as_int(v) for v in value)
    return as_int(value)


def shown_key(raw_key: dict) -> tuple:
    """An entry's key as bfrt_python shows it (raw()["key"]: exact fields as values, ternary,
    lpm and range fields as pairs, fixed fields named $NAME), in a comparable form."""
    return tuple(sorted((name.lstrip("$"), _shown_value(v)) for name, v in raw_key.items()))


def planned_key(key) -> tuple:
    """A planned key in the form of `shown_key`."""
    def value(v):
        if isinstance(v, Ternary):
            return (v.value, v.mask)
        if isinstance(v, Lpm):
            return (v.value, v.prefix_length)
        if isinstance(v, Range):
            return (v.low, v.high)
        return _shown_value(v)
    return tuple(sorted((name, value(v)) for name, v in key))


class BfrtWriter:
    """Reads and writes through the bfrt object, or a dry run that prints the writes.

    A table is read once (`snapshot`: one dump), compared with the plan, and only the
    differences are written (`put`, `remove`); `batch` sends a run of writes to the driver
    together (bfrt.batch_begin / batch_end)."""

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

    def read_default(self, path: str, in_program: bool = True, pipe: int | None = None):
        if self.bfrt is None:
            return None
        kwargs = {"print_ent": False} if pipe is None else {"print_ent": False, "pipe": pipe}
        entry = self.node(path, in_program).get_default(**kwargs)
        return None if entry is None or entry == -1 else entry.raw()

    def snapshot(self, path: str, in_program: bool = True) -> dict[tuple, tuple[object, dict]]:
        """Every entry of a table in one read (get(regex=True) dumps the table):
        shown key -> (the entry object, its raw()). Empty when planning for a clean switch."""
        if self.bfrt is None:
            return {}
        entries = self.node(path, in_program).get(regex=True, print_ents=False,
                                                  return_ents=True)
        if entries is None or entries == -1:
            return {}
        out = {}
        for entry in entries if isinstance(entries, list) else [entries]:
            raw = entry.raw()
            out[shown_key(raw["key"])] = (entry, raw)
        return out

    # -- writing --
    @contextmanager
    def batch(self):
        """The writes inside go to the driver as one batch: one round trip, not one each."""
        if self.dry_run:
            yield
            return
        try:
            self.bfrt.batch_begin()
        except Exception as exc:    # bfrt_python raises plain exceptions
            raise BfrtError(f"batch_begin failed: {exc}") from exc
        try:
            yield
        finally:
            try:
                self.bfrt.batch_end()
            except Exception as exc:
                raise BfrtError(f"batch_end failed: {exc}") from exc

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

    def remove(self, path: str, found: tuple[object, dict], in_program: bool = True) -> None:
        """Delete an entry read by `snapshot` (through its own remove(): its key as read)."""
        entry, raw = found
        target = f"{self.program}.{path}" if in_program else path
        self.changes.append(("delete", target, dict(raw["key"])))
        if self.dry_run or self.verbose:
            self.out(f"{'would ' if self.dry_run else ''}delete {target} {raw['key']}")
        if self.dry_run:
            return
        try:
            entry.remove()
        except Exception as exc:
            raise BfrtError(f"delete on {target} ({raw['key']}) failed: {exc}") from exc

    def put(self, path: str, key: dict, data: dict, action: str | None, current: dict,
            in_program: bool = True) -> bool:
        """Make the entry at `key` hold `data` (and `action`), knowing the table's contents
        (`current`, from `snapshot`): no read. True when it wrote."""
        found = current.get(planned_key(key.items()))
        if found is not None and holds(found[1], action, data):
            self.unchanged += 1
            return False
        suffix = f"_with_{action}" if action else ""
        op = "mod" if found is not None else "add"
        self.write(path, f"{op}{suffix}", {**key_kwargs(key.items()), **data}, in_program)
        return True

    def ensure(self, path: str, key: dict, data: dict, action: str | None = None,
               in_program: bool = True, modify_only: bool = False):
        """Read the entry at `key`, then make it hold `data` (and `action`): for the fixed
        tables (traffic manager, ports) whose every entry exists."""
        current = self.read(path, key, in_program)
        if holds(current, action, data):
            self.unchanged += 1
            return
        suffix = f"_with_{action}" if action else ""
        op = "mod" if (current is not None or modify_only) else "add"
        self.write(path, f"{op}{suffix}", {**key, **data}, in_program)

    def ensure_default(self, entry: DefaultEntry) -> None:
        if holds(self.read_default(entry.table), entry.action, dict(entry.data)):
            self.unchanged += 1
            return
        self.write(entry.table, f"set_default_with_{entry.action}", dict(entry.data))


class Control:
    """A P4 control: the tables it owns and how their contents follow the plan."""
    tables: tuple[str, ...] = ()            # tables with entries
    default_tables: tuple[str, ...] = ()    # keyless tables: only their default action

    def __init__(self, writer: BfrtWriter):
        self.writer = writer

    def entries(self, plan: TofinoPlan) -> list[TableEntry]:
        owned = set(self.tables)
        return [e for e in plan.entries if e.table in owned]

    def read(self) -> dict[str, object]:
        """What the switch holds: one dump per table, one read per default."""
        out: dict[str, object] = {t: self.writer.snapshot(t) for t in self.tables}
        out.update({t: self.writer.read_default(t) for t in self.default_tables})
        return out

    def remove_stale(self, plan: TofinoPlan, current: dict) -> list[tuple[str, dict]]:
        """Delete the entries the plan does not have; (table, key) of each."""
        deleted = []
        for table in self.tables:
            wanted = {planned_key(e.key) for e in plan.entries if e.table == table}
            for key, found in current[table].items():
                if key not in wanted:
                    self.writer.remove(table, found)
                    deleted.append((table, dict(key)))
        return deleted

    def install(self, plan: TofinoPlan, current: dict) -> list[tuple[str, dict]]:
        """Add or modify what differs from the plan; (table, key) of each entry written."""
        written = []
        for entry in self.entries(plan):
            if self.writer.put(entry.table, entry.key_dict, entry.data_dict, entry.action,
                               current[entry.table]):
                written.append((entry.table, dict(planned_key(entry.key))))
        for default in plan.defaults:
            if default.table in self.default_tables:
                if holds(current[default.table], default.action, dict(default.data)):
                    self.writer.unchanged += 1
                else:
                    self.writer.write(default.table, f"set_default_with_{default.action}",
                                      dict(default.data))
        return written


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
    tables = (T_DSCP,)
    default_tables = (T_DROP_REPORTING,)


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
    """Multicast nodes (one per member: rid = worker id, the member's port) and groups.
    The program owns groups 1..MAX_JOBS and nodes 1..MAX_JOBS * MAX_WORKERS (the job
    layout, tofino_plan.multicast): only those are deleted when the plan drops them."""
    NODE, GROUP = "pre.node", "pre.mgid"

    def __init__(self, writer: BfrtWriter):
        self.writer = writer

    def read(self) -> dict[str, dict]:
        return {t: self.writer.snapshot(t, in_program=False) for t in (self.NODE, self.GROUP)}

    def install(self, plan: TofinoPlan, current: dict) -> None:
        w = self.writer
        for node in plan.nodes:         # a group names its nodes: nodes first
            w.put(self.NODE, {"MULTICAST_NODE_ID": node.node_id},
                  {"MULTICAST_RID": node.rid, "MULTICAST_LAG_ID": [],
                   "DEV_PORT": list(node.dev_ports)}, None, current[self.NODE], in_program=False)
        for group in plan.groups:
            n = len(group.node_ids)
            w.put(self.GROUP, {"MGID": group.mgid},
                  {"MULTICAST_NODE_ID": list(group.node_ids),
                   "MULTICAST_NODE_L1_XID_VALID": [False] * n,
                   "MULTICAST_NODE_L1_XID": [0] * n}, None, current[self.GROUP],
                  in_program=False)
        # groups before the nodes they name
        self._remove_stale(self.GROUP, "MGID", {g.mgid for g in plan.groups}, MAX_JOBS,
                           current)
        self._remove_stale(self.NODE, "MULTICAST_NODE_ID", {n.node_id for n in plan.nodes},
                           MAX_JOBS * MAX_WORKERS, current)

    def _remove_stale(self, table: str, field: str, wanted: set[int], last_owned: int,
                      current: dict) -> None:
        for key, found in current[table].items():
            ident = dict(key)[field]
            if 1 <= ident <= last_owned and ident not in wanted:
                self.writer.remove(table, found, in_program=False)


class TrafficManager:
    """Strict priority (queue 7 first), capacity C as the queue's buffer limit, the yellow
    colour limit for Not-ECT data (K / C, rounded up), and per pipe the mirror-drop
    (drop-report) queue. Tables and operations of the SDE's TM schema (bf_rt_tm_tf<N>.json):
    tm.port.cfg is read-only; tm.queue.* are fixed tables (get / mod) addressed by
    (pg_id, pg_queue) inside a pipe, so every call names the port's pipe; tm.pipe.cfg has no
    key, one default entry per pipe (get_default / set_default / reset_default)."""

    def __init__(self, writer: BfrtWriter, tofino: int = 1):
        self.writer = writer
        self.tofino = tofino
        self.prefix = f"tf{tofino}.tm"
        self._port_cfg: dict[int, dict | None] = {}

    def _port(self, dev_port: int) -> dict | None:
        if dev_port not in self._port_cfg:      # one read per port, not one per queue
            self._port_cfg[dev_port] = self.writer.read(
                f"{self.prefix}.port.cfg", {"dev_port": dev_port}, in_program=False)
        return self._port_cfg[dev_port]

    def queue_of(self, dev_port: int, queue: int) -> dict:
        """The key (pipe, pg_id, pg_queue) of a port's logical queue, from tm.port.cfg."""
        raw = self._port(dev_port)
        if raw is None:             # a plan for a clean switch: name it by port and qid
            return {"pipe": pipe_of(dev_port), "pg_id": f"<pg of dev_port {dev_port}>",
                    "pg_queue": f"<queue {queue} of dev_port {dev_port}>"}
        data = raw["data"]
        carved = as_int(data["port_queues_count"])
        if queue >= carved:
            raise BfrtError(f"dev_port {dev_port} has {carved} queues; the DLCP stage needs "
                            f"{NUM_QUEUES}: carve {NUM_QUEUES} queues for it in tm.port.group "
                            "(port_queue_count)")
        return {"pipe": pipe_of(dev_port), "pg_id": as_int(data["pg_id"]),
                "pg_queue": as_int(data["egress_qid_queues"][queue])}

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
        for pipe, dev_port in sorted(plan.drop_report_ports.items()):
            self.set_drop_queue(pipe, self.queue_of(dev_port, 0))

    def set_drop_queue(self, pipe: int, key: dict) -> None:
        """The pipe's TM drops go to this queue (Tofino 2 also switches the function on)."""
        data = {"mirror_drop_pg_id": key["pg_id"], "mirror_drop_pg_queue": key["pg_queue"]}
        if self.tofino == 2:
            data = {"mirror_drop_enable": True, **data}
        path = f"{self.prefix}.pipe.cfg"
        if holds(self.writer.read_default(path, in_program=False, pipe=pipe), None, data):
            self.writer.unchanged += 1
            return
        self.writer.write(path, "set_default", {"pipe": pipe, **data}, in_program=False)

    def reset_drop_queues(self, pipes) -> None:
        """Back to the SDE's reset values on these pipes (the teardown)."""
        for pipe in sorted(pipes):
            self.writer.write(f"{self.prefix}.pipe.cfg", "reset_default", {"pipe": pipe},
                              in_program=False)


class Ports:
    """Port bring-up (port.port), when the deployment asks for it, with the frame limit
    of protocol.md §4.1 in the MAC; the MACs' count of longer frames (port.port_stat)."""

    def __init__(self, writer: BfrtWriter):
        self.writer = writer

    def install(self, plan: TofinoPlan) -> None:
        for p in plan.ports:
            self.writer.ensure("port.port", {"DEV_PORT": p.dev_port},
                               {"SPEED": p.speed, "FEC": p.fec, "PORT_ENABLE": True,
                                "RX_MTU": PORT_MTU, "TX_MTU": PORT_MTU},
                               in_program=False)

    def frames_too_long(self, plan: TofinoPlan) -> int | None:
        """drop_oversize: $FrameTooLong summed over the program's ports; None when a
        port's statistics cannot be read (not brought up, or planning offline)."""
        total = 0
        for dev_port in plan.frame_ports:
            raw = self.writer.read("port.port_stat", {"DEV_PORT": dev_port}, in_program=False)
            value = None if raw is None else _field(raw["data"], "FrameTooLong")
            if value is None:
                return None
            total += as_int(value)
        return total


def jobs_on_switch(jobs_table: dict) -> dict[int, dict[str, int]]:
    """job id -> its set_job data, from a snapshot of the jobs table."""
    return {dict(key)["job"]: {name.lstrip("$"): as_int(v) for name, v in raw["data"].items()}
            for key, (_, raw) in jobs_table.items()}


def changed_jobs(changed: list[tuple[str, dict]], old_jobs: dict[int, dict]) -> set[int]:
    """Jobs on the switch whose parameters or members an apply changed or deleted: their
    slot state and counters no longer belong to what the switch now serves."""
    return {key["job"] for table, key in changed
            if table in (T_JOBS, T_MEMBERS) and key.get("job") in old_jobs}


class ThcInaSwitch:
    """The whole deployment: plan (refusing what the program cannot hold), read what the
    switch holds, then ports, multicast, every control's tables (one batch) and the traffic
    manager, so that the switch ends up exactly as the plan says."""

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
        """Serve `config`: what it adds is written, what it changes is modified, what the
        switch holds beyond it is deleted; jobs changed or gone get their state cleared."""
        plan = self.plan(config)            # ConfigError here: nothing written yet
        owned = {t for c in self.controls for t in (*c.tables, *c.default_tables)}
        missing = {e.table for e in plan.entries} - owned
        if missing:                         # a planned table no control installs: a bug
            raise BfrtError(f"no control installs {sorted(missing)}")
        self.apply(plan)
        self.tm.install(plan)
        return plan

    def remove(self) -> TofinoPlan:
        """Tear the deployment down: every entry of the program's tables, its multicast
        groups and nodes, the slot registers and counters of every job it served, drop
        reporting off and the drop-report pipes' mirror-drop queue back to reset. Ports
        and queue settings stay (other traffic may use them)."""
        plan = TofinoPlan(layouts={}, defaults=[
            DefaultEntry(T_DROP_REPORTING, "set_drop_reporting", (("enabled", 0),))])
        self.apply(plan)
        self.tm.reset_drop_queues({pipe_of(p) for p in self.options.drop_report_ports})
        return plan

    def apply(self, plan: TofinoPlan) -> None:
        current = {t: v for c in self.controls for t, v in c.read().items()}   # reads first
        old_jobs = jobs_on_switch(current[T_JOBS])
        multicast = self.pre.read()
        self.ports.install(plan)
        with self.writer.batch():           # the program's tables: one batch
            changed = []
            for control in self.controls:   # deletes first: they free the entries' space
                changed += control.remove_stale(plan, current)
            for control in self.controls:
                changed += control.install(plan, current)
            for job in sorted(changed_jobs(changed, old_jobs)):
                self.clear_job_state(old_jobs[job])
        self.pre.install(plan, multicast)

    def clear_job_state(self, job: dict[str, int]) -> None:
        """Zero the slot registers and counter cells a job (as it was on the switch) used."""
        w = self.writer
        slots, copies = slot_cells(job["slot_base"], job["pool_size"])
        for registers, cells in ((SLOT_REGISTERS, slots), (COPY_REGISTERS, copies)):
            for path, fields in registers.items():
                zero = {name: 0 for name in fields}
                for cell in cells:
                    w.write(path, "mod", {"REGISTER_INDEX": cell, **zero})
        for cell in range(job["counter_base"], job["counter_base"] + JOB_COUNTER_STRIDE):
            w.write(C_JOB, "mod", {"COUNTER_INDEX": cell, "COUNTER_SPEC_PKTS": 0})

    def counters(self, plan: TofinoPlan) -> dict:
        """Counters since the program was loaded, named as protocol.md 4.5."""
        job_cells, global_cells = self.ingress.read_counters(plan)
        dlcp = next(c for c in self.controls if isinstance(c, DlcpAdmission))
        return counters_from_cells(plan.layouts, job_cells, global_cells, dlcp.read_counters(),
                                   drops_reported=plan.drops_reported,
                                   frames_too_long=self.ports.frames_too_long(plan))

    def summary(self) -> str:
        w = self.writer
        verb = "would write" if w.dry_run else "wrote"
        return f"{verb} {len(w.changes)} entries, {w.unchanged} already as planned"
