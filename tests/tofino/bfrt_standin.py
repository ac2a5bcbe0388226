"""A recording STAND-IN for the `bfrt` object of bfshell. It is not a switch and proves
nothing about hardware: it holds table entries in dicts and records every call.

What makes it worth testing against: its program tables are built from the TNA source
(tna_source.bfrt_tables), so a call that the real bfrt_python would refuse for this
program raises StandInError here: an unknown table, action, key or parameter name, a
missing key field, a value wider than its field, an add of an existing entry, a modify of
a missing one, a default-only action used for an entry. The fixed tables (pre.node,
pre.mgid, port.port, tf<N>.tm.*) take the field names and choices of the SDE's bf-rt
schema (bf_rt_tm_tf1.json) and behave as fixed-size tables (modify only)."""
from __future__ import annotations

from . import tna_source as ts


class StandInError(Exception):
    """A call the real bfrt_python would refuse."""


class Entry:
    def __init__(self, key: dict, data: dict, action: str | None):
        self.key, self.data, self.action = dict(key), dict(data), action

    def raw(self) -> dict:
        return {"key": dict(self.key), "data": dict(self.data), "action": self.action}


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
    """A table as bfrt_python shows it: get / add_with_<a> / mod_with_<a> /
    set_default_with_<a> / get_default (or plain add / mod for actionless tables)."""

    def __init__(self, standin: "BfrtStandIn", path: str, key_params: dict[str, int | None],
                 actions: dict[str, dict[str, int | None]], full_actions: dict[str, str],
                 default_only: set[str] = frozenset(), fixed: dict | None = None,
                 choices: dict[str, tuple] | None = None, default=None,
                 dollar_names: bool = False):
        self.standin = standin
        self.path = path
        self.key_params = key_params            # name -> width
        self.actions = actions                  # short action name ("" = none) -> params
        self.full_actions = full_actions        # short -> the name raw() shows
        self.default_only = set(default_only)
        self.fixed = fixed                      # fixed tables: every key exists, with these data
        self.choices = choices or {}
        self.entries: dict[tuple, Entry] = {}
        self.default = default                  # (action, data) of the default entry
        self.dollar = dollar_names              # fixed fields show as $NAME in raw()

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
            if name in self.choices and value not in self.choices[name]:
                raise StandInError(f"{self.path}: {name}={value!r} is not one of "
                                   f"{self.choices[name]}")
            if not _fits(value, params[name]) and not isinstance(value, (str, list)):
                raise StandInError(f"{self.path}: {name}={value!r} does not fit "
                                   f"{params[name]} bits")
        return data

    def _record(self, method: str, kwargs: dict) -> None:
        self.standin.log.append((method, self.path, dict(kwargs)))

    # -- bfrt_python surface --
    def get(self, regex=False, return_ents=True, print_ents=True, table=False, from_hw=False,
            pipe=None, gress_dir=None, prsr_id=None, handle=None, **key):
        self.standin.reads += 1
        if pipe is not None:
            key["pipe"] = pipe
        k = self._key(key)
        if self.fixed is not None and k not in self.entries:
            action, data = self.fixed
            return Entry(dict(k), data, action)
        entry = self.entries.get(k)
        return -1 if entry is None else entry

    def get_default(self, print_ent=True, from_hw=False, pipe=None):
        self.standin.reads += 1
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
        self._record(method, kwargs)
        if op == "set_default":
            self.default = (action, self._data(action, kwargs))
            return None
        k = self._key(kwargs)
        data = self._data(action, kwargs)
        exists = k in self.entries or self.fixed is not None
        if op == "add" and exists:
            raise StandInError(f"{self.path}: add of an existing entry {dict(k)}")
        if op == "mod" and not exists:
            raise StandInError(f"{self.path}: mod of a missing entry {dict(k)}")
        if op == "mod" and k in self.entries:
            merged = dict(self.entries[k].data)
        elif self.fixed is not None:
            merged = dict(self.fixed[1])
        else:
            merged = {}
        merged.update({f"${n}" if self.dollar else n: v for n, v in data.items()})
        key = {f"${n}" if self.dollar else n: v for n, v in k}
        self.entries[k] = Entry(key, merged, self.full_actions.get(action, action or None))
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


# Fields and choices of the SDE's fixed tables (bf_rt_tm_tf1.json, pre, port).
PRIORITIES = ("LOW", "0", "1", "2", "3", "4", "5", "6", "7", "HIGH")
COLOR_LIMITS = ("12.5%", "25%", "37.5%", "50%", "62.5%", "75%", "87.5%", "100%")


class BfrtStandIn(Node):
    """bfrt.<program>.pipe..., bfrt.pre, bfrt.port, bfrt.tf<N>.tm, from the TNA source."""

    def __init__(self, program: str = "thc_ina", tofino: int = 1, ports_per_group: int = 4):
        super().__init__("")
        self.log: list[tuple[str, str, dict]] = []
        self.reads = 0
        self.ports_per_group = ports_per_group
        self.counters: dict[str, dict[int, int]] = {}
        controls = ts.program()
        for path, (table, ctl) in ts.bfrt_tables(controls).items():
            self._add_program_table(f"{program}.{path}", path, table, ctl)
        for path in ts.bfrt_externs(controls, "counters"):
            self.counters[path] = {}
            self._place(f"{program}.{path}", CounterTable(self, path))
        self._add_fixed_tables(f"tf{tofino}.tm")

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
                                  default=default))

    def _add_fixed_tables(self, tm: str) -> None:
        self._place("pre.node", Table(self, "pre.node", {"MULTICAST_NODE_ID": 32}, {
            "": {"MULTICAST_RID": 16, "MULTICAST_LAG_ID": None, "DEV_PORT": None}}, {},
            dollar_names=True))
        self._place("pre.mgid", Table(self, "pre.mgid", {"MGID": 16}, {
            "": {"MULTICAST_NODE_ID": None, "MULTICAST_NODE_L1_XID_VALID": None,
                 "MULTICAST_NODE_L1_XID": None}}, {}, dollar_names=True))
        self._place("port.port", Table(self, "port.port", {"DEV_PORT": 9}, {
            "": {"SPEED": None, "FEC": None, "PORT_ENABLE": None}}, {}, dollar_names=True))
        self._place(f"{tm}.port.cfg", PortConfig(self, f"{tm}.port.cfg"))
        queue_key = {"pg_id": 8, "pg_queue": 8}
        self._place(f"{tm}.queue.sched_cfg", Table(
            self, f"{tm}.queue.sched_cfg", queue_key,
            {"": {"min_rate_enable": None, "min_priority": None, "max_rate_enable": None,
                  "max_priority": None, "dwrr_weight": 16, "scheduling_enable": None}}, {},
            fixed=(None, {"min_priority": "LOW", "max_priority": "LOW", "dwrr_weight": 1023,
                          "scheduling_enable": True}),
            choices={"min_priority": PRIORITIES, "max_priority": PRIORITIES}))
        buffer_params = {"guaranteed_cells": 32, "hysteresis_cells": 32, "tail_drop_enable": None}
        self._place(f"{tm}.queue.buffer", Table(
            self, f"{tm}.queue.buffer", queue_key,
            {"buffer_only": dict(buffer_params),
             "shared_pool": dict(buffer_params, pool_id=None, pool_max_cells=32,
                                 dynamic_baf=None)},
            {"buffer_only": "buffer_only", "shared_pool": "shared_pool"},
            fixed=("shared_pool", {"guaranteed_cells": 20, "tail_drop_enable": True,
                                   "pool_max_cells": 4000})))
        self._place(f"{tm}.queue.color", Table(
            self, f"{tm}.queue.color", queue_key,
            {"": {"drop_enable": None, "drop_limit_yellow": None, "drop_limit_red": None,
                  "hysteresis_yellow_cells": 32, "hysteresis_red_cells": 32}}, {},
            fixed=(None, {"drop_enable": False, "drop_limit_yellow": "100%",
                          "drop_limit_red": "100%"}),
            choices={"drop_limit_yellow": COLOR_LIMITS, "drop_limit_red": COLOR_LIMITS}))
        self._place(f"{tm}.pipe.cfg", Table(
            self, f"{tm}.pipe.cfg", {"pipe": 2},
            {"": {"mirror_drop_pg_id": 8, "mirror_drop_pg_queue": 8, "eg_limit_cells": 32,
                  "eg_hysteresis_cells": 32}}, {},
            fixed=(None, {"mirror_drop_pg_id": 0, "mirror_drop_pg_queue": 0})))

    # -- test helpers --
    def writes(self) -> list[tuple[str, str, dict]]:
        return list(self.log)

    def table(self, dotted: str) -> Table:
        node = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node


class PortConfig:
    """tm.port.cfg: read-only; a port's group and the group queues of its 8 logical queues."""

    def __init__(self, standin: BfrtStandIn, path: str):
        self.standin, self.path = standin, path

    def get(self, dev_port=None, print_ents=True, from_hw=False, **_):
        self.standin.reads += 1
        if dev_port is None or not 0 <= dev_port < 512:
            raise StandInError(f"{self.path}: dev_port {dev_port!r} is not a device port")
        per = self.standin.ports_per_group
        first = (dev_port % per) * 8
        return Entry({"dev_port": dev_port},
                     {"pg_id": dev_port // per, "egress_qid_queues": [first + q for q in range(8)]},
                     None)


class CounterTable:
    """An indirect Counter: get(COUNTER_INDEX=i, from_hw=True) -> $COUNTER_SPEC_PKTS."""

    def __init__(self, standin: BfrtStandIn, path: str):
        self.standin, self.path = standin, path

    def get(self, COUNTER_INDEX=None, print_ents=True, from_hw=False, **_):
        self.standin.reads += 1
        if COUNTER_INDEX is None:
            raise StandInError(f"{self.path}: COUNTER_INDEX missing")
        packets = self.standin.counters[self.path].get(COUNTER_INDEX, 0)
        return Entry({"$COUNTER_INDEX": COUNTER_INDEX},
                     {"$COUNTER_SPEC_PKTS": packets, "$COUNTER_SPEC_BYTES": 0}, None)
