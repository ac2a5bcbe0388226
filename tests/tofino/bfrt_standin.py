"""A recording STAND-IN for the `bfrt` object of bfshell. It is not a switch and proves
nothing about hardware: it holds table entries in dicts and records every call.

What makes it worth testing against: its program tables are built from the TNA source
(tna_source.bfrt_tables), so a call that the real bfrt_python would refuse for this
program raises StandInError here: an unknown table, action, key or parameter name, a
missing key field, a value wider than its field, an add of an existing entry, a modify of
a missing one, a default-only action used for an entry. The SDE's own tables (pre.node, pre.mgid,
port.port, tf<N>.tm.*) are declared from the SDE's published schemas (FIXED_TABLES: keys,
data fields, and only the operations the SDE offers, so a call it does not offer is an
AttributeError as in bfrt_python). It counts round trips: every call outside a batch is
one, a batch (batch_begin .. batch_end) is one."""
from __future__ import annotations

import re

from . import tna_source as ts


class StandInError(Exception):
    """A call the real bfrt_python would refuse."""


class Entry:
    def __init__(self, key: dict, data: dict, action: str | None, table=None, ident=None):
        self.key, self.data, self.action = dict(key), dict(data), action
        self._table, self._ident = table, ident

    def raw(self) -> dict:
        return {"key": dict(self.key), "data": dict(self.data), "action": self.action}

    def remove(self, pipe=None, gress_dir=None, prsr_id=None):
        """bfrt_python's TableEntry.remove: delete the entry by its key as read."""
        if self._table is None:
            raise StandInError("remove of an entry that was not read from a table")
        self._table.standin.call()
        self._table.delete_ident(self._ident, "delete")


class Node:
    """A namespace of the bfrt tree (bfrt.<program>.pipe.<control>...)."""

    def __init__(self, path: str):
        self._path = path
        self._children: dict[str, object] = {}

    def _child(self, name: str):
        if name not in self._children:
            self._children[name] = Node(f"{self._path}.{name}".lstrip("."))
        return self._children[name]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._children[name]
        except KeyError:
            raise AttributeError(f"bfrt has no {self._path}.{name}") from None


def _fits(value, width: int | None) -> bool:
    if width is None:
        return True
    if isinstance(value, bool):
        value = int(value)
    return isinstance(value, int) and 0 <= value < (1 << width)


class Table:
    """A program table as bfrt_python shows it (the operations of a match-action table,
    BfRtMatchActionTable in bf_rt_p4/bf_rt_p4_table_impl.hpp): get (regex=True dumps it),
    delete, reset_default, add_with_<a> / mod_with_<a> /
    set_default_with_<a> / get_default (or plain add / mod for actionless tables)."""

    def __init__(self, standin: "BfrtStandIn", path: str, key_params: dict[str, int | None],
                 actions: dict[str, dict[str, int | None]], full_actions: dict[str, str],
                 default_only: set[str] = frozenset(), default=None,
                 kinds: dict[str, str] | None = None):
        self.standin = standin
        self.path = path
        self.key_params = key_params            # name -> width
        self.actions = actions                  # short action name ("" = none) -> params
        self.full_actions = full_actions        # short -> the name raw() shows
        self.default_only = set(default_only)
        self.entries: dict[tuple, Entry] = {}
        self.default = default                  # (action, data) of the default entry
        self.kinds = kinds or {}                # match field -> exact / ternary / lpm / range
        self.program_default = default

    # -- helpers --
    def _key(self, kwargs: dict) -> tuple:
        missing = set(self.key_params) - set(kwargs)
        if missing:
            raise StandInError(f"{self.path}: key fields {sorted(missing)} missing")
        for name, width in self.key_params.items():
            if not _fits(kwargs[name], width):
                raise StandInError(f"{self.path}: key {name}={kwargs[name]!r} does not fit "
                                   f"{width} bits")
        return tuple((name, kwargs[name]) for name in self.key_params)

    def _data(self, action: str, kwargs: dict) -> dict:
        if action not in self.actions:
            raise StandInError(f"{self.path}: no action {action!r} (has {sorted(self.actions)})")
        params = self.actions[action]
        data = {k: v for k, v in kwargs.items() if k not in self.key_params}
        unknown = set(data) - set(params)
        if unknown:
            raise StandInError(f"{self.path}: {action} has no parameters {sorted(unknown)}")
        for name, value in data.items():
            if not _fits(value, params[name]) and not isinstance(value, (str, list)):
                raise StandInError(f"{self.path}: {name}={value!r} does not fit "
                                   f"{params[name]} bits")
        return data

    def _record(self, method: str, kwargs: dict) -> None:
        self.standin.log.append((method, self.path, dict(kwargs)))

    def _shown_key(self, k: tuple) -> dict:
        """The key as bfrt_python's raw() shows it: a pair per ternary / lpm / range field,
        the priority as $MATCH_PRIORITY."""
        kw = dict(k)
        out = {}
        for name, kind in self.kinds.items():
            if kind == "ternary":
                out[name] = (kw[name], kw[f"{name}_mask"])
            elif kind == "lpm":
                out[name] = (kw[name], kw[f"{name}_p_length"])
            elif kind == "range":
                out[name] = (kw[f"{name}_start"], kw[f"{name}_end"])
            else:
                out[name] = kw[name]
        if "MATCH_PRIORITY" in kw:
            out["$MATCH_PRIORITY"] = kw["MATCH_PRIORITY"]
        return out

    def delete_ident(self, k: tuple, method: str) -> None:
        if k not in self.entries:
            raise StandInError(f"{self.path}: delete of a missing entry {dict(k)}")
        self._record(method, dict(k))
        del self.entries[k]

    def delete(self, pipe=None, gress_dir=None, prsr_id=None, handle=None, **key):
        self.standin.call()
        self.delete_ident(self._key(key), "delete")

    def reset_default(self, pipe=None, gress_dir=None, prsr_id=None):
        self.standin.call()
        self._record("reset_default", {})
        self.default = self.program_default

    # -- bfrt_python surface --
    def get(self, regex=False, return_ents=True, print_ents=True, table=False, from_hw=False,
            pipe=None, gress_dir=None, prsr_id=None, handle=None, **key):
        self.standin.reads += 1
        self.standin.call()
        if regex:                               # the table's every entry (a dump)
            return list(self.entries.values())
        entry = self.entries.get(self._key(key))
        return -1 if entry is None else entry

    def get_default(self, print_ent=True, from_hw=False, pipe=None):
        self.standin.reads += 1
        self.standin.call()
        if self.default is None:
            return -1
        action, data = self.default
        return Entry({}, data, self.full_actions.get(action, action))

    def _write(self, op: str, action: str, kwargs: dict):
        if op in ("add", "mod") and action in self.default_only:
            raise StandInError(f"{self.path}: {action} is @defaultonly")
        pipe = kwargs.pop("pipe", None)
        if pipe is not None:
            kwargs["pipe"] = pipe
        method = f"{op}_with_{action}" if action else op
        self.standin.call()
        self._record(method, kwargs)
        if op == "set_default":
            self.default = (action, self._data(action, kwargs))
            return None
        k = self._key(kwargs)
        data = self._data(action, kwargs)
        exists = k in self.entries
        if op == "add" and exists:
            raise StandInError(f"{self.path}: add of an existing entry {dict(k)}")
        if op == "mod" and not exists:
            raise StandInError(f"{self.path}: mod of a missing entry {dict(k)}")
        merged = dict(self.entries[k].data) if op == "mod" else {}
        merged.update(data)
        self.entries[k] = Entry(self._shown_key(k), merged,
                                self.full_actions.get(action, action or None), self, k)
        return None

    def __getattr__(self, name: str):
        for op in ("set_default", "add", "mod"):
            if name == op and "" in self.actions:
                return lambda **kw: self._write(op, "", kw)
            if name.startswith(f"{op}_with_"):
                action = name[len(op) + 6:]
                if action not in self.actions or (op != "set_default"
                                                  and action in self.default_only):
                    # bfrt_python makes no add/mod method for a @defaultonly action
                    raise AttributeError(f"{self.path} has no {name}")
                return lambda _a=action, _op=op, **kw: self._write(_op, _a, kw)
        raise AttributeError(f"{self.path} has no {name}")


class BfrtStandIn(Node):
    """bfrt.<program>.pipe..., bfrt.pre, bfrt.port, bfrt.tf<N>.tm: the program's tables,
    counters and registers from the TNA source, the SDE's tables from its schemas."""

    def __init__(self, program: str = "thc_ina", tofino: int = 1,
                 port_queues: dict[int, int] | None = None):
        super().__init__("")
        self.log: list[tuple[str, str, dict]] = []
        self.reads = 0
        self.round_trips = 0
        self.batches = 0
        self.in_batch = False
        self.port_queues = dict(port_queues or {})      # dev_port -> queues carved (8)
        self.counters: dict[str, dict[int, int]] = {}
        self.registers: dict[str, RegisterTable] = {}
        controls = ts.program()
        for path, (table, ctl) in ts.bfrt_tables(controls).items():
            self._add_program_table(f"{program}.{path}", path, table, ctl)
        for path in ts.bfrt_externs(controls, "counters"):
            self.counters[path] = {}
            self._place(f"{program}.{path}", CounterTable(self, path))
        text = ts.preprocess()
        for path, type_args in ts.bfrt_externs(controls, "registers").items():
            value_type, index_type = (t.strip() for t in type_args.rsplit(",", 1))
            width = int(re.search(rf"typedef\s+bit<(\d+)>\s+{index_type}\s*;", text).group(1))
            struct = re.search(rf"struct\s+{value_type}\s*{{([^}}]*)}}", text)
            fields = tuple(re.findall(r"(\w+)\s*;", struct.group(1))) if struct else ("f1",)
            self.registers[path] = RegisterTable(self, path, fields, 1 << width)
            self._place(f"{program}.{path}", self.registers[path])
        for path, spec in {**pre_specs(), **port_specs(), **tm_specs(tofino)}.items():
            kind = {"tm.port.cfg": lambda: PortConfig(self, path, tofino),
                    "port.port_stat": lambda: PortStat(self, path, spec)}
            table = next((make() for suffix, make in kind.items() if path.endswith(suffix)),
                         None) or SdeTable(self, path, spec)
            self._place(path, table)

    # -- round trips and bfrt_python's batching (bfrtcli: batch_begin / batch_end) --
    def call(self) -> None:
        if not self.in_batch:
            self.round_trips += 1

    def batch_begin(self) -> None:
        if self.in_batch:
            raise StandInError("batch_begin inside a batch")
        self.in_batch = True

    def batch_end(self) -> None:
        if not self.in_batch:
            raise StandInError("batch_end without batch_begin")
        self.in_batch = False
        self.batches += 1
        self.round_trips += 1

    def _place(self, dotted: str, table) -> None:
        node = self
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node._child(part)
        node._children[parts[-1]] = table

    def _add_program_table(self, dotted: str, path: str, table, ctl) -> None:
        keys: dict[str, int | None] = {}
        for name, kind in table.keys:
            if kind == "ternary":
                keys.update({name: None, f"{name}_mask": None})
            elif kind == "lpm":
                keys.update({name: None, f"{name}_p_length": 6})
            elif kind == "range":
                keys.update({f"{name}_start": None, f"{name}_end": None})
            else:
                keys[name] = None
        if any(kind in ("ternary", "range") for _, kind in table.keys):
            keys["MATCH_PRIORITY"] = 24
        actions = {a: {p.name: p.width for p in ctl.actions[a][0]} for a in table.actions}
        top, inst = path.split(".")[1], ".".join(path.split(".")[2:-1])
        full = {a: ".".join(x for x in (top, inst, a) if x) for a in table.actions}
        default = None
        if table.default is not None:       # the program's default action and arguments
            action, args = table.default
            names = [p.name for p in ctl.actions[action][0]]
            default = (action, dict(zip(names, args)))
        self._place(dotted, Table(self, dotted, keys, actions, full, table.default_only,
                                  default=default, kinds=dict(table.keys)))

    # -- test helpers --
    def writes(self) -> list[tuple[str, str, dict]]:
        return list(self.log)

    def table(self, dotted: str):
        node = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node


# ---------------------------------------------------------------- the SDE's own tables
# Declared from the SDE's published schemas (open-p4studio, pkgsrc/bf-drivers/src/bf_rt/):
# fields from the bf_rt_<kind>_tf<N>.json files, operations from their "supported_apis"
# (tm) or, where the json names none, from the table class in bf_rt_<kind>_table_impl.hpp
# (pre, port). bfrt_python makes a method only for an operation the table offers.
PRIORITIES = ("LOW", "0", "1", "2", "3", "4", "5", "6", "7", "HIGH")
COLOR_LIMITS = ("12.5%", "25%", "37.5%", "50%", "62.5%", "75%", "87.5%", "100%")
POOLS = ("EG_APP_POOL_0", "EG_APP_POOL_1", "EG_APP_POOL_2", "EG_APP_POOL_3")
BAFS = ("1.5%", "3%", "6%", "11%", "20%", "33%", "50%", "66%", "80%", "DISABLE")
PIPES = 4
# bfrt_python method <- the SDE's api (bfrtTable.set_supported_apis_to_supported_commands)
_READS = {"get", "get_first", "get_next_n", "usage_get"}
_TM_QUEUE_OPS = _READS | {"mod", "clear"}


def _spec(key, data, ops, *, read_only=(), choices=None, actions=None, mandatory=(),
          per_pipe=False, every_key=None, dollar=False, keyless=False):
    return dict(key=key, data=data, ops=frozenset(ops), read_only=frozenset(read_only),
                choices=choices or {}, actions=actions, mandatory=frozenset(mandatory),
                per_pipe=per_pipe, every_key=every_key, dollar=dollar, keyless=keyless)


def pre_specs() -> dict[str, dict]:
    """bf_rt_pre/bf_rt_pre_tf1.json; operations of BfRtPREMulticastNodeTable and
    BfRtPREMGIDTable (bf_rt_pre/bf_rt_pre_table_impl.hpp): no clear, no default entry."""
    return {
        "pre.node": _spec({"MULTICAST_NODE_ID": 32},
                          ("MULTICAST_RID", "MULTICAST_LAG_ID", "DEV_PORT"),
                          _READS | {"add", "mod", "delete"},
                          mandatory=("MULTICAST_RID", "MULTICAST_LAG_ID", "DEV_PORT"),
                          dollar=True),
        "pre.mgid": _spec({"MGID": 16},
                          ("MULTICAST_NODE_ID", "MULTICAST_NODE_L1_XID_VALID",
                           "MULTICAST_NODE_L1_XID", "MULTICAST_ECMP_ID",
                           "MULTICAST_ECMP_L1_XID_VALID", "MULTICAST_ECMP_L1_XID"),
                          _READS | {"add", "mod", "mod_inc", "delete"}, dollar=True),
    }


def port_specs() -> dict[str, dict]:
    """bf_rt_port/bf_rt_port_tf1.json ($PORT); operations of BfRtPortCfgTable
    (bf_rt_port/bf_rt_port_table_impl.hpp)."""
    writable = ("SPEED", "FEC", "N_LANES", "PORT_ENABLE", "AUTO_NEGOTIATION", "LOOPBACK_MODE",
                "TX_MTU", "RX_MTU", "TX_PFC_EN_MAP", "RX_PFC_EN_MAP", "TX_PAUSE_FRAME_EN",
                "RX_PAUSE_FRAME_EN", "CUT_THROUGH_EN", "PORT_DIR", "SDS_TX_ATTN",
                "SDS_TX_PRE", "SDS_TX_PRE2", "SDS_TX_POST", "SDS_TX_POST2",
                "RX_PRSR_PRI_THRESH", "TIMESTAMP_1588_DELTA_TX", "TIMESTAMP_1588_DELTA_RX",
                "PLL_OVRCLK")
    read_only = ("MEDIA_TYPE", "IS_VALID", "IS_INTERNAL", "CONN_ID", "CHNL_ID", "PORT_UP",
                 "PORT_NAME", "TIMESTAMP_1588_VALID", "TIMESTAMP_1588_VALUE",
                 "TIMESTAMP_1588_ID")
    speeds = ("BF_SPEED_NONE", "BF_SPEED_1G", "BF_SPEED_10G", "BF_SPEED_25G", "BF_SPEED_40G",
              "BF_SPEED_40G_NB", "BF_SPEED_40G_NON_BREAKABLE", "BF_SPEED_50G",
              "BF_SPEED_100G", "BF_SPEED_200G", "BF_SPEED_400G")
    fecs = ("BF_FEC_TYP_NONE", "BF_FEC_TYP_FIRECODE", "BF_FEC_TYP_REED_SOLOMON",
            "BF_FEC_TYP_FC", "BF_FEC_TYP_RS")
    # $PORT_STAT (bf_rt_port_stat_table): the MAC's RMON counters, read (and cleared) by
    # port; a few of its fields, those of frames too long among them.
    stats = ("FramesReceivedOK", "FramesReceivedAll", "FramesReceivedwithFCSError",
             "FrameTooLong", "FramesReceivedOversized", "JabberReceived",
             "FramesTransmittedOK")
    return {"port.port": _spec({"DEV_PORT": 9}, writable + read_only,
                               _READS - {"usage_get"} | {"add", "mod", "delete", "clear"},
                               read_only=read_only, choices={"SPEED": speeds, "FEC": fecs},
                               dollar=True),
            "port.port_stat": _spec({"DEV_PORT": 9}, stats, _READS | {"mod", "clear"},
                                    read_only=stats, dollar=True)}


def tm_specs(tofino: int) -> dict[str, dict]:
    """bf_rt_tm/bf_rt_tm_tf1.json and bf_rt_tm_tf2.json: tm.port.cfg (read only),
    tm.queue.sched_cfg / buffer / color (fixed: get and mod, addressed inside a pipe),
    tm.pipe.cfg (no key: one default entry per pipe)."""
    tm = f"tf{tofino}.tm"
    groups, group_queues = (18, 32) if tofino == 1 else (9, 128)
    queue_key = {"pg_id": 8, "pg_queue": 8}
    queue_range = {"pg_id": groups, "pg_queue": group_queues}
    sched = ("min_rate_enable", "min_priority", "max_rate_enable", "max_priority",
             "dwrr_weight", "scheduling_enable")
    if tofino == 2:
        sched += ("advanced_flow_control", "scheduling_speed", "pg_l1_node")
    pipe_cfg = ("mirror_drop_pg_id", "mirror_drop_pg_queue", "mirror_drop_dev_port",
                "mirror_drop_queue_nr", "eg_limit_cells", "eg_hysteresis_cells")
    if tofino == 2:
        pipe_cfg = ("mirror_drop_enable",) + pipe_cfg + ("queue_depth_report_mode",)
    return {
        f"{tm}.port.cfg": _spec({"dev_port": 9}, (), _READS),   # PortConfig below
        f"{tm}.queue.sched_cfg": _spec(
            queue_key, sched, _TM_QUEUE_OPS, per_pipe=True, every_key=(queue_range, (None, {
                "min_rate_enable": False, "min_priority": "LOW", "max_rate_enable": False,
                "max_priority": "LOW", "dwrr_weight": 1023, "scheduling_enable": True})),
            read_only=("scheduling_speed",),
            choices={"min_priority": PRIORITIES, "max_priority": PRIORITIES}),
        f"{tm}.queue.buffer": _spec(
            queue_key, ("guaranteed_cells", "hysteresis_cells", "tail_drop_enable"),
            _TM_QUEUE_OPS | {"get_default"}, per_pipe=True,
            actions={"shared_pool": ("pool_id", "pool_max_cells", "dynamic_baf"),
                     "buffer_only": ()},
            every_key=(queue_range, ("shared_pool", {
                "guaranteed_cells": 20, "hysteresis_cells": 32, "tail_drop_enable": False,
                "pool_id": "EG_APP_POOL_0", "pool_max_cells": 4000, "dynamic_baf": "DISABLE"})),
            choices={"pool_id": POOLS, "dynamic_baf": BAFS}),
        f"{tm}.queue.color": _spec(
            queue_key, ("drop_enable", "drop_limit_yellow", "drop_limit_red",
                        "hysteresis_yellow_cells", "hysteresis_red_cells"),
            _TM_QUEUE_OPS | {"get_default"}, per_pipe=True, every_key=(queue_range, (None, {
                "drop_enable": False, "drop_limit_yellow": "100%", "drop_limit_red": "100%",
                "hysteresis_yellow_cells": 32, "hysteresis_red_cells": 32})),
            choices={"drop_limit_yellow": COLOR_LIMITS, "drop_limit_red": COLOR_LIMITS}),
        f"{tm}.pipe.cfg": _spec(
            {}, pipe_cfg, {"get_default", "set_default", "reset_default", "clear"},
            read_only=("mirror_drop_dev_port", "mirror_drop_queue_nr"), per_pipe=True,
            keyless=True, choices={"queue_depth_report_mode": ("ANY", "COLOR")}),
    }


class SdeTable:
    """One of the SDE's tables with its schema's fields and only its operations: a method
    bfrt_python would not make is an AttributeError; a field the schema lacks, a read-only
    field written, a choice outside the schema's or a missing mandatory field is a
    StandInError. Per-pipe tables want pipe= (their keys are pipe-local)."""

    def __init__(self, standin: "BfrtStandIn", path: str, spec: dict):
        self.standin, self.path, self.spec = standin, path, spec
        self.entries: dict[tuple, Entry] = {}
        self.defaults: dict[int, dict] = {}         # keyless: pipe -> data

    def __getattr__(self, name: str):
        spec = self.__dict__.get("spec")
        if spec is None or name.startswith("_"):
            raise AttributeError(name)
        op, _, action = name.partition("_with_")
        if op not in spec["ops"] or (action and (spec["actions"] is None
                                                 or action not in spec["actions"])) \
                or (op in ("add", "mod", "set_default") and not action
                    and spec["actions"] is not None):
            raise AttributeError(f"{self.path} has no {name} (the SDE offers "
                                 f"{sorted(spec['ops'])})")
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise AttributeError(f"{self.path}: the stand-in does not model {op}")
        return lambda **kw: self._call(handler, action or None, kw)

    def _call(self, handler, action, kwargs):
        self.standin.call()
        return handler(action, kwargs)

    # -- helpers --
    def _name(self, name: str) -> str:
        return f"${name}" if self.spec["dollar"] else name

    def _key(self, kwargs: dict) -> tuple:
        spec = self.spec
        pipe = kwargs.pop("pipe", None)
        if spec["per_pipe"] and pipe is None:
            raise StandInError(f"{self.path}: its keys are inside a pipe: pass pipe=")
        key = []
        for name, width in spec["key"].items():
            if name not in kwargs:
                raise StandInError(f"{self.path}: key field {name} missing")
            value = kwargs.pop(name)
            if not _fits(value, width):
                raise StandInError(f"{self.path}: key {name}={value!r} does not fit {width} bits")
            key.append((name, value))
        if spec["every_key"] is not None:
            for name, value in key:
                if value >= spec["every_key"][0][name]:
                    raise StandInError(f"{self.path}: no {name} {value} on this chip")
        return ((pipe,) if spec["per_pipe"] else ()) + tuple(key)

    def _data(self, action, kwargs: dict, adding: bool) -> dict:
        spec = self.spec
        allowed = set(spec["data"]) | set((spec["actions"] or {}).get(action, ()))
        for name, value in kwargs.items():
            if name not in allowed:
                raise StandInError(f"{self.path}: no data field {name} (has {sorted(allowed)})")
            if name in spec["read_only"]:
                raise StandInError(f"{self.path}: {name} is read-only")
            if name in spec["choices"] and value not in spec["choices"][name]:
                raise StandInError(f"{self.path}: {name}={value!r} is not one of "
                                   f"{spec['choices'][name]}")
        if adding and spec["mandatory"] - set(kwargs):
            raise StandInError(f"{self.path}: mandatory fields "
                               f"{sorted(spec['mandatory'] - set(kwargs))} missing")
        return {self._name(n): v for n, v in kwargs.items()}

    def _existing(self, k: tuple) -> Entry | None:
        if k not in self.entries and self.spec["every_key"] is not None:
            action, data = self.spec["every_key"][1]
            self.entries[k] = Entry(self._shown(k), {self._name(n): v for n, v in data.items()},
                                    action, self, k)
        return self.entries.get(k)

    def _shown(self, k: tuple) -> dict:
        fields = k[1:] if self.spec["per_pipe"] else k
        return {self._name(n): v for n, v in fields}

    def _record(self, method, kwargs):
        self.standin.log.append((method, self.path, dict(kwargs)))

    def delete_ident(self, k: tuple, method: str) -> None:
        if k not in self.entries:
            raise StandInError(f"{self.path}: delete of a missing entry {dict(k)}")
        self._record(method, dict(k))
        del self.entries[k]

    # -- operations --
    def _op_get(self, action, kwargs):
        self.standin.reads += 1
        regex = kwargs.pop("regex", False)
        for name in ("print_ents", "return_ents", "from_hw", "table"):
            kwargs.pop(name, None)
        if regex:
            if "get_first" not in self.spec["ops"]:
                raise StandInError(f"{self.path}: no dump (get_first) on this table")
            return list(self.entries.values())
        entry = self._existing(self._key(kwargs))
        return -1 if entry is None else entry

    def _op_add(self, action, kwargs):
        self._record(f"add_with_{action}" if action else "add", kwargs)
        k = self._key(dict(kwargs))
        if k in self.entries:
            raise StandInError(f"{self.path}: add of an existing entry {dict(k)}")
        data = self._data(action, {n: v for n, v in kwargs.items()
                                   if n not in self.spec["key"] and n != "pipe"}, True)
        self.entries[k] = Entry(self._shown(k), data, action, self, k)

    def _op_mod(self, action, kwargs):
        self._record(f"mod_with_{action}" if action else "mod", kwargs)
        k = self._key(dict(kwargs))
        entry = self._existing(k)
        if entry is None:
            raise StandInError(f"{self.path}: mod of a missing entry {dict(k)}")
        entry.data.update(self._data(action, {n: v for n, v in kwargs.items()
                                              if n not in self.spec["key"] and n != "pipe"},
                                     False))
        entry.action = action or entry.action

    def _op_delete(self, action, kwargs):
        self.delete_ident(self._key(kwargs), "delete")

    def _pipes(self, kwargs) -> list[int]:
        pipe = kwargs.pop("pipe", None)
        return list(range(PIPES)) if pipe is None else [pipe]

    def _op_set_default(self, action, kwargs):
        self._record("set_default", kwargs)
        for pipe in self._pipes(kwargs):        # no pipe: every pipe (BF_DEV_PIPE_ALL)
            data = self._data(action, dict(kwargs), False)
            self.defaults[pipe] = {**self.defaults.get(pipe, {}), **data}

    def _op_reset_default(self, action, kwargs):
        self._record("reset_default", kwargs)
        for pipe in self._pipes(kwargs):
            self.defaults.pop(pipe, None)

    def _op_get_default(self, action, kwargs):
        self.standin.reads += 1
        if kwargs.get("pipe") is None:
            raise StandInError(f"{self.path}: one entry per pipe: pass pipe=")
        return Entry({}, dict(self.defaults.get(kwargs["pipe"], {})), None)


class PortConfig:
    """tm.port.cfg: read only; a port's group (pipe-local), its carved queue count and the
    group queues of its logical queues (one item per logical qid)."""

    def __init__(self, standin: "BfrtStandIn", path: str, tofino: int):
        self.standin, self.path = standin, path
        self.ports_per_group = 4 if tofino == 1 else 8

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("standin", "path", "ports_per_group"):
            raise AttributeError(name)
        raise AttributeError(f"{self.path} has no {name}: it is read only (get)")

    def get(self, dev_port=None, print_ents=True, from_hw=False, pipe=None, **_):
        self.standin.reads += 1
        self.standin.call()
        if dev_port is None or not 0 <= dev_port < 512:
            raise StandInError(f"{self.path}: dev_port {dev_port!r} is not a device port")
        local = dev_port % 128
        nr = local % self.ports_per_group
        count = self.standin.port_queues.get(dev_port, 8)
        qids = [q % count for q in range(32)]
        return Entry({"dev_port": dev_port}, {
            "pg_id": local // self.ports_per_group, "pg_port_nr": nr,
            "port_queues_count": count, "ingress_qid_map": qids,
            "egress_qid_queues": [nr * 8 + q for q in qids], "copy_to_cpu": False,
            "mirror_drop_destination": False, "mirror_drop_pg_queue": 0,
            "pkt_extraction_credits": 0}, None)


class PortStat(SdeTable):
    """port.port_stat: one entry per port that exists in port.port (its counters from 0);
    `count(dev_port, field, n)` stands for the MAC counting frames."""

    def _existing(self, k: tuple) -> Entry | None:
        if k not in self.entries and k in self.standin.port.port.entries:
            self.entries[k] = Entry(self._shown(k), {self._name(n): 0 for n in self.spec["data"]},
                                    None, self, k)
        return self.entries.get(k)

    def count(self, dev_port: int, field: str, n: int) -> None:
        entry = self._existing((("DEV_PORT", dev_port),))
        entry.data[self._name(field)] += n


class CounterTable:
    """An indirect Counter (PACKETS): get / mod of $COUNTER_SPEC_PKTS by COUNTER_INDEX."""

    def __init__(self, standin: "BfrtStandIn", path: str):
        self.standin, self.path = standin, path

    def get(self, COUNTER_INDEX=None, print_ents=True, from_hw=False, **_):
        self.standin.reads += 1
        self.standin.call()
        if COUNTER_INDEX is None:
            raise StandInError(f"{self.path}: COUNTER_INDEX missing")
        packets = self.standin.counters[self.path].get(COUNTER_INDEX, 0)
        return Entry({"$COUNTER_INDEX": COUNTER_INDEX}, {"$COUNTER_SPEC_PKTS": packets}, None)

    def mod(self, COUNTER_INDEX=None, COUNTER_SPEC_PKTS=None, pipe=None):
        self.standin.call()
        if COUNTER_INDEX is None or COUNTER_SPEC_PKTS is None:
            raise StandInError(f"{self.path}: mod wants COUNTER_INDEX and COUNTER_SPEC_PKTS")
        self.standin.log.append(("mod", self.path, {"COUNTER_INDEX": COUNTER_INDEX,
                                                    "COUNTER_SPEC_PKTS": COUNTER_SPEC_PKTS}))
        self.standin.counters[self.path][COUNTER_INDEX] = COUNTER_SPEC_PKTS


class RegisterTable:
    """A Register: get / mod of its fields (f1, or a struct's fields) by REGISTER_INDEX;
    raw() shows one value per pipe under <control path>.<register>.<field>."""

    def __init__(self, standin: "BfrtStandIn", path: str, fields: tuple[str, ...], size: int):
        self.standin, self.path, self.fields, self.size = standin, path, fields, size
        self.cells: dict[int, dict[str, int]] = {}
        self.prefix = path.split(".", 1)[1]         # without "pipe."

    def _index(self, index) -> int:
        if index is None or not 0 <= index < self.size:
            raise StandInError(f"{self.path}: REGISTER_INDEX {index!r} outside 0..{self.size - 1}")
        return index

    def get(self, REGISTER_INDEX=None, print_ents=True, from_hw=False, **_):
        self.standin.reads += 1
        self.standin.call()
        cell = self.cells.get(self._index(REGISTER_INDEX), {})
        return Entry({"$REGISTER_INDEX": REGISTER_INDEX},
                     {f"{self.prefix}.{f}": [cell.get(f, 0)] * PIPES for f in self.fields}, None)

    def mod(self, REGISTER_INDEX=None, pipe=None, **data):
        self.standin.call()
        index = self._index(REGISTER_INDEX)
        if set(data) != set(self.fields):
            raise StandInError(f"{self.path}: mod wants the fields {self.fields}, got {sorted(data)}")
        self.standin.log.append(("mod", self.path, {"REGISTER_INDEX": index, **data}))
        self.cells[index] = dict(data)
