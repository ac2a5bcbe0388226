"""The TNA program (p4src/tna) read without a compiler: controls, tables (bfrt names, key
names and match kinds, actions and their parameters), registers and their RegisterActions,
counters, control instances, and the worst-case use of each per pass.

`pass_uses(program, "SwitchIngress")` walks every control-flow path of a control's apply
block (if/else branches, table actions, nested control instances) and returns, for each
table, register and counter, the most times one pass can touch it. Tofino allows a table
to be applied and a register or counter to be executed at most once per pass; the
structural tests assert exactly that (the walk sums sequences and takes the max over
branches, so it can only over-count, never miss a second use)."""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
P4_DIR = REPO / "p4src" / "tna"
P4_MAIN = P4_DIR / "thc_ina.p4"

# Widths of the type names the program uses (tna.p4's and headers.p4's).
TYPE_WIDTHS = {"PortId_t": 9, "MulticastGroupId_t": 16, "QueueId_t": 5, "mac_addr_t": 48,
               "ipv4_addr_t": 32, "slot_index_t": 13, "copy_index_t": 14,
               "route_index_t": 10, "next_hop_index_t": 13, "job_index_t": 4}


def preprocess(defines: dict[str, str] | None = None) -> str:
    """cpp over thc_ina.p4 with empty stand-ins for the architecture files (which come
    with the compiler)."""
    if shutil.which("cpp") is None:
        raise FileNotFoundError("the C preprocessor (cpp) is not installed")
    args = ["cpp", "-P", "-undef", "-nostdinc", f"-I{_stub_includes()}"]
    args += [f"-D{k}={v}" for k, v in (defines or {}).items()]
    out = subprocess.run(args + [str(P4_MAIN)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout


@lru_cache(maxsize=1)
def _stub_includes() -> str:
    """Empty core.p4 / tna.p4 / t2na.p4: the architecture files come with the compiler."""
    stubs = Path(tempfile.mkdtemp(prefix="tna_stub_include_"))
    for name in ("core.p4", "tna.p4", "t2na.p4"):
        (stubs / name).write_text("")
    return str(stubs)


def block_after(text: str, start: int, open_ch: str = "{", close_ch: str = "}") -> tuple[str, int]:
    """The balanced block opening at or after `start`: (inside, index after the close)."""
    i = text.index(open_ch, start)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return text[i + 1:j], j + 1
    raise ValueError("unbalanced block")


@dataclass
class Param:
    direction: str
    type: str
    name: str

    @property
    def width(self) -> int | None:
        m = re.fullmatch(r"bit<(\d+)>", self.type)
        return int(m.group(1)) if m else TYPE_WIDTHS.get(self.type)


@dataclass
class Table:
    name: str
    keys: list[tuple[str, str]]             # (bfrt key name, match kind)
    actions: list[str]
    default_only: set[str]
    has_const_entries: bool
    size: int | None
    default: tuple[str, list[int]] | None = None    # default action and its arguments
    # the constant entries in priority order: (key patterns, action, argument text)
    entries: list[tuple[list[str], str, str]] = field(default_factory=list)


@dataclass
class Control:
    name: str
    params: str
    body: str
    apply: str
    tables: dict[str, Table] = field(default_factory=dict)
    actions: dict[str, tuple[list[Param], str]] = field(default_factory=dict)
    registers: dict[str, str] = field(default_factory=dict)         # name -> type args
    register_actions: dict[str, str] = field(default_factory=dict)  # name -> register
    counters: dict[str, str] = field(default_factory=dict)          # name -> size expr
    instances: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (type, args)


def _params(text: str) -> list[Param]:
    out = []
    for part in text.split(","):
        words = part.split()
        if not words:
            continue
        direction = words[0] if words[0] in ("in", "out", "inout") else ""
        rest = words[1:] if direction else words
        out.append(Param(direction, " ".join(rest[:-1]), rest[-1]))
    return out


def constants(text: str) -> dict[str, str]:
    """The program's `const bit<N> NAME = value;` declarations, name -> value text."""
    return dict(re.findall(r"\bconst\s+bit<\d+>\s+(\w+)\s*=\s*([^;]+);", text))


def _tables(body: str, names: dict[str, str] | None = None) -> dict[str, Table]:
    out = {}
    for m in re.finditer(r"\btable\s+(\w+)\s*\{", body):
        tb, _ = block_after(body, m.end() - 1)
        keys = []
        if re.search(r"\bkey\s*=", tb):
            kb, _ = block_after(tb, re.search(r"\bkey\s*=", tb).end())
            for elem in kb.split(";"):
                m_key = re.match(r"(.*):\s*(exact|ternary|lpm|range)\b(.*)", elem, re.S)
                if not m_key:
                    continue
                expr, kind, rest = m_key.groups()
                named = re.search(r'@name\("([^"]+)"\)', rest)
                keys.append((named.group(1) if named else expr.strip(), kind))
        ab, _ = block_after(tb, re.search(r"\bactions\s*=", tb).end())
        actions, default_only = [], set()
        for a in ab.split(";"):
            a = a.strip()
            if not a:
                continue
            if a.startswith("@defaultonly"):
                a = a.split()[-1]
                default_only.add(a)
            actions.append(a)
        size = re.search(r"\bsize\s*=\s*([^;]+);", tb)
        dflt = re.search(r"\bdefault_action\s*=\s*(\w+)\s*\(([^)]*)\)", tb)
        default = None if dflt is None else (
            dflt.group(1), [eval_int(a, names) for a in dflt.group(2).split(",") if a.strip()])
        # constant: entries fixed by the program, or a keyless table whose one action the
        # program fixes (an add in a stage of its own)
        constant = "const entries" in tb or (not keys and "const default_action" in tb)
        out[m.group(1)] = Table(m.group(1), keys, actions, default_only, constant,
                                size and eval_int(size.group(1)), default, _const_rows(tb))
    return out


def _const_rows(table_body: str) -> list[tuple[list[str], str, str]]:
    if "const entries" not in table_body:
        return []
    entries, _ = block_after(table_body, table_body.index("const entries"))
    rows = re.findall(r"\(([^()]*)\)\s*:\s*(\w+)\(([^()]*)\)\s*;", entries)
    return [([p.strip() for p in keys.split(",")], action, args.strip())
            for keys, action, args in rows]


def eval_int(expr: str, names: dict[str, str] | None = None) -> int:
    for name, value in (names or {}).items():                  # named constants
        expr = re.sub(rf"\b{name}\b", f"({value})", expr)
    expr = re.sub(r"\b\d+w(\d+)", r"\1", expr.strip())          # 32w1 -> 1
    if not re.fullmatch(r"[\dxXa-fA-F\s*+()<-]+", expr):
        raise ValueError(f"not a constant expression: {expr}")
    return int(eval(expr, {"__builtins__": {}}))   # literals and arithmetic only


def pattern_matches(value: int, pattern: str, names: dict[str, str] | None = None) -> bool:
    """One key of a constant entry: `_`, a value, `value &&& mask`, true / false."""
    if pattern == "_":
        return True
    if pattern in ("true", "false"):
        return value == (pattern == "true")
    if "&&&" in pattern:
        want, mask = (eval_int(p, names) for p in pattern.split("&&&"))
        return value & mask == want & mask
    return value == eval_int(pattern, names)


def first_match(table: Table, inputs: dict[str, int],
                names: dict[str, str] | None = None) -> tuple[str, str] | None:
    """(action, arguments) of the table's first constant entry matching `inputs` (bfrt key
    name -> value), None where the default action runs."""
    keys = [name for name, _ in table.keys]
    for patterns, action, args in table.entries:
        if all(pattern_matches(inputs[k], p, names) for k, p in zip(keys, patterns)):
            return action, args
    return None


@lru_cache(maxsize=4)
def program(defines: tuple = ()) -> dict[str, Control]:
    return parse_controls(preprocess(dict(defines)))


def parse_controls(text: str) -> dict[str, Control]:
    controls, names = {}, constants(text)
    for m in re.finditer(r"\bcontrol\s+(\w+)\s*\(", text):
        params, end = block_after(text, m.end() - 1, "(", ")")
        rest = text[end:].lstrip()
        if rest.startswith("("):                       # constructor parameters
            _, end = block_after(text, end, "(", ")")
        body, _ = block_after(text, end)
        apply_at = [a.start() for a in re.finditer(r"\bapply\s*\{", body)][-1]
        apply, _ = block_after(body, apply_at)
        c = Control(m.group(1), params, body, apply, tables=_tables(body, names))
        for a in re.finditer(r"\baction\s+(\w+)\s*\(([^)]*)\)\s*\{", body):
            abody, _ = block_after(body, a.end() - 1)
            c.actions[a.group(1)] = (_params(a.group(2)), abody)
        for r in re.finditer(r"\bRegister<([^>]*(?:<\d+>[^>]*)*)>\s*\([^;]*\)\s+(\w+)\s*;", body):
            c.registers[r.group(2)] = r.group(1)
        for r in re.finditer(r"\bRegisterAction<[^(]*>\s*\((\w+)\)\s+(\w+)\s*=", body):
            c.register_actions[r.group(2)] = r.group(1)
        for r in re.finditer(r"\bCounter<[^(]*>\s*\(([^,]+),[^;]*\)\s+(\w+)\s*;", body):
            c.counters[r.group(2)] = r.group(1).strip()
        controls[c.name] = c
    for c in controls.values():
        for i in re.finditer(r"\b(\w+)\s*\(([^()]*)\)\s+(\w+)\s*;", c.body):
            if i.group(1) in controls:
                c.instances[i.group(3)] = (i.group(1), i.group(2).strip())
    return controls


TOP_CONTROLS = ("SwitchIngress", "SwitchEgress")


def bfrt_tables(controls: dict[str, Control]) -> dict[str, tuple[Table, Control]]:
    """bfrt path ("pipe.<top>.<instance>.<table>") -> (table, the control declaring it)."""
    out = {}
    for top in TOP_CONTROLS:
        ctl = controls[top]
        for name, t in ctl.tables.items():
            out[f"pipe.{top}.{name}"] = (t, ctl)
        for inst, (ctype, _) in ctl.instances.items():
            for name, t in controls[ctype].tables.items():
                out[f"pipe.{top}.{inst}.{name}"] = (t, controls[ctype])
    return out


def bfrt_externs(controls: dict[str, Control], kind: str) -> dict[str, str]:
    """bfrt path -> size expression of every Register ("registers") or Counter."""
    out = {}
    for top in TOP_CONTROLS:
        ctl = controls[top]
        for owner, prefix in [(ctl, f"pipe.{top}")] + [
                (controls[t], f"pipe.{top}.{i}") for i, (t, _) in ctl.instances.items()]:
            for name, value in getattr(owner, kind).items():
                out[f"{prefix}.{name}"] = value
    return out


# --------------------------------------------------------------------------- pass walk
def _add(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def _max(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)}


def _split_statements(text: str) -> list[str]:
    """Top-level statements of a block: `if (...) X [else Y]` kept whole, blocks whole."""
    out, i, n = [], 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        if re.match(r"if\s*\(", text[i:]):
            start = i
            _, i = block_after(text, i, "(", ")")
            i = _skip_statement(text, i)
            while True:
                m = re.match(r"\s*else\b", text[i:])
                if not m:
                    break
                i = _skip_statement(text, i + m.end())
            out.append(text[start:i])
        else:
            start = i
            i = _skip_statement(text, i)
            out.append(text[start:i])
    return out


def _skip_statement(text: str, i: int) -> int:
    while text[i].isspace():
        i += 1
    if text[i] == "{":
        _, end = block_after(text, i)
        return end
    if re.match(r"if\s*\(", text[i:]):
        _, j = block_after(text, i, "(", ")")
        j = _skip_statement(text, j)
        m = re.match(r"\s*else\b", text[j:])
        return _skip_statement(text, j + m.end()) if m else j
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(text[j], 0)
        if text[j] == ";" and depth == 0:
            return j + 1
    raise ValueError(f"no end of statement: {text[i:i + 60]}")


class PassWalk:
    def __init__(self, controls: dict[str, Control]):
        self.controls = controls

    def control(self, ctype: str, prefix: str) -> dict:
        ctl = self.controls[ctype]
        return self.block(ctl, prefix, ctl.apply)

    def block(self, ctl: Control, prefix: str, text: str) -> dict:
        uses: dict = {}
        for stmt in _split_statements(text):
            uses = _add(uses, self.statement(ctl, prefix, stmt))
        return uses

    def statement(self, ctl: Control, prefix: str, stmt: str) -> dict:
        stmt = stmt.strip()
        if stmt.startswith("{"):
            inner, _ = block_after(stmt, 0)
            return self.block(ctl, prefix, inner)
        if re.match(r"if\s*\(", stmt):
            cond, i = block_after(stmt, 0, "(", ")")
            j = _skip_statement(stmt, i)
            then = self.statement(ctl, prefix, stmt[i:j])
            m = re.match(r"\s*else\b", stmt[j:])
            other = self.statement(ctl, prefix, stmt[j + m.end():]) if m else {}
            return _add(self.expression(ctl, prefix, cond), _max(then, other))
        return self.expression(ctl, prefix, stmt)

    def expression(self, ctl: Control, prefix: str, text: str) -> dict:
        uses: dict = {}
        for m in re.finditer(r"\b(\w+)\s*\.\s*(apply|execute|count)\s*\(|\b(\w+)\s*\(", text):
            name, method, call = m.group(1), m.group(2), m.group(3)
            if method == "apply" and name in ctl.tables:
                table = ctl.tables[name]
                acts: dict = {}
                for a in table.actions:
                    if a in ctl.actions:
                        acts = _max(acts, self.block(ctl, prefix, ctl.actions[a][1]))
                uses = _add(uses, _add({f"table {prefix}.{name}": 1}, acts))
            elif method == "apply" and name in ctl.instances:
                uses = _add(uses, self.control(ctl.instances[name][0], f"{prefix}.{name}"))
            elif method == "execute" and name in ctl.register_actions:
                reg = ctl.register_actions[name]
                uses = _add(uses, {f"register {prefix}.{reg}": 1,
                                   f"action {prefix}.{name}": 1})
            elif method == "count" and name in ctl.counters:
                uses = _add(uses, {f"counter {prefix}.{name}": 1})
            elif call and call in ctl.actions:
                uses = _add(uses, self.block(ctl, prefix, ctl.actions[call][1]))
        return uses


def pass_uses(controls: dict[str, Control], top: str) -> dict[str, int]:
    return PassWalk(controls).control(top, f"pipe.{top}")
