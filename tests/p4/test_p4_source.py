"""The P4 program (p4src/v1model) against the controller and the wire protocol, without p4c.

These checks read the preprocessed source and run wherever cpp is (test_p4_compile.py
compiles with p4c where it is on PATH): every entry
the controller plans names a table, key fields, action and parameters that exist in the
program (with p4c's P4Info naming: control instance path + local name); each table is
applied once per control; the AGG header matches HEADER_DTYPE; the counter cells and
resource limits agree with dataplane/bmv2/control.py. Compiling and running on BMv2 is the
bmv2 packet-suite target (skipped here with its reason)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from dataplane import job_plan
from dataplane.config import Job, Member, Route, SwitchConfig
from dataplane.bmv2 import control as pc
from host.packets import HEADER_DTYPE

P4_DIR = pc.P4_SOURCE.parent


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    if shutil.which("cpp") is None:
        pytest.skip("the C preprocessor (cpp) is not installed")
    stubs = tmp_path_factory.mktemp("p4include")
    for name in ("core.p4", "v1model.p4"):      # the architecture files come with p4c
        (stubs / name).write_text("")
    out = subprocess.run(["cpp", "-P", "-undef", "-nostdinc", f"-I{stubs}", str(pc.P4_SOURCE)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def block_after(text: str, start: int) -> str:
    """The {...} block that opens at or after `start` (balanced braces)."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    raise AssertionError("unbalanced braces")


def controls(text: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"\bcontrol\s+(\w+)\s*\(", text):
        # skip the parameter lists (apply params, then constructor params)
        depth, i = 0, m.end() - 1
        while True:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                rest = text[i:].lstrip()
                if rest.startswith("("):
                    i = text.index("(", i)
                    continue
                break
        out[m.group(1)] = block_after(text, i)
    return out


def tables(body: str) -> dict[str, dict]:
    out = {}
    for m in re.finditer(r"\btable\s+(\w+)\s*\{", body):
        tb = block_after(body, m.end() - 1)
        keys = block_after(tb, tb.index("key")) if "key" in tb else ""
        acts = block_after(tb, tb.index("actions"))
        out[m.group(1)] = {
            "keys": {k.split(":")[0].strip() for k in keys.split(";") if ":" in k},
            "actions": {a.strip() for a in acts.split(";") if a.strip()},
        }
    return out


def actions(body: str) -> dict[str, list[str]]:
    return {m.group(1): [p.split()[-1] for p in m.group(2).split(",") if p.strip()]
            for m in re.finditer(r"\baction\s+(\w+)\s*\(([^)]*)\)", body)}


def instances(body: str, known: set[str]) -> dict[str, str]:
    return {m.group(3): m.group(1) for m in re.finditer(r"\b(\w+)\s*\(([^)]*)\)\s+(\w+)\s*;", body)
            if m.group(1) in known}


def p4info_tables(text: str) -> dict[str, tuple[dict, dict]]:
    """Full P4Info table name -> (table, actions of its control)."""
    ctl = controls(text)
    out = {}
    for top in ("SwitchIngress", "SwitchEgress"):
        for inst, ctype in instances(ctl[top], set(ctl)).items():
            acts = actions(ctl[ctype])
            for name, table in tables(ctl[ctype]).items():
                out[f"{top}.{inst}.{name}"] = (table, acts)
    return out


def full_config() -> SwitchConfig:
    table = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)
    members = tuple(Member(w, w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.0.{w + 1}", 40000 + w)
                    for w in range(3))
    return SwitchConfig(jobs=(Job(1, 8, table, members, values_per_packet=64),),
                        routes=(Route("10.9.0.0/16", 1, "02:00:00:00:09:09",
                                      extra_hops=((2, "02:00:00:00:09:0a"),)),)).validate()


def test_every_planned_entry_fits_the_program(source):
    known = p4info_tables(source)
    plan = pc.plan_switch(full_config())
    assert {e.table for e in plan.entries} <= set(known)
    for e in plan.entries:
        table, acts = known[e.table]
        assert {k for k, _ in e.match} == table["keys"], e.table
        local_action = e.action.rsplit(".", 1)[1]
        assert e.action.rsplit(".", 1)[0] == e.table.rsplit(".", 1)[0]
        assert local_action in table["actions"], (e.table, e.action)
        assert [p for p, _ in e.params] == acts[local_action], e.action


def test_one_lookup_instance_per_payload_byte(source):
    ctl = controls(source)
    inst = instances(ctl["SwitchIngress"], set(ctl))
    lookups = {name: ctype for name, ctype in inst.items() if ctype == "ByteLookup"}
    assert sorted(lookups) == sorted(f"lookup_{k}" for k in range(pc.INDEX_BYTES))
    for k in range(pc.INDEX_BYTES):      # instance k is built for byte position k
        assert re.search(rf"ByteLookup\(\s*{k}\s*\)\s+lookup_{k}\s*;", source)
        assert re.search(rf"lookup_{k}\.apply\(\s*hdr\.idx\[{k}\]", source)


def test_each_table_applied_once_per_control(source):
    for name, body in controls(source).items():
        for table in tables(body):
            assert len(re.findall(rf"\b{table}\.apply\(", body)) == 1, (name, table)


def test_state_machine_registers_are_touched_in_one_action(source):
    body = controls(source)["SlotAggregation"]
    regs = re.findall(r"register<[^;]*?\)\s+(\w+)\s*;", body)
    assert len(regs) >= 9
    acts = {m.group(1): block_after(body, m.end() - 1)
            for m in re.finditer(r"\baction\s+(\w+)\s*\([^)]*\)\s*\{", body)}
    machine = acts["run_state_machine"]
    for reg in regs:          # read AND written inside the one action: one BMv2 lock scope
        assert f"{reg}.read(" in machine and f"{reg}.write(" in machine, reg
        assert f"{reg}.write(first" in acts["flush_slot"], reg
    apply_body = body[body.rindex("apply"):]
    assert ".read(" not in apply_body and ".write(" not in apply_body


def test_route_round_robin_register_is_read_and_written_in_one_action(source):
    body = controls(source)["Ipv4Forwarding"]
    (reg,) = re.findall(r"register<[^;]*?\)\s+(\w+)\s*;", body)
    acts = {m.group(1): block_after(body, m.end() - 1)
            for m in re.finditer(r"\baction\s+(\w+)\s*\([^)]*\)\s*\{", body)}
    assert f"{reg}.read(" in acts["spray"] and f"{reg}.write(" in acts["spray"]
    assert "next_hops.apply(" in body[body.rindex("apply {"):]
    defines = {m.group(1): int(m.group(2))
               for m in re.finditer(r"#define\s+(\w+)\s+(\d+)",
                                    (P4_DIR / "forwarding.p4").read_text())}
    assert defines["MAX_ROUTES"] == pc.BMV2_MAX_ROUTES
    assert defines["MAX_NEXT_HOP_SLOTS"] == pc.BMV2_NEXT_HOP_SLOTS


def test_agg_header_matches_the_wire_format(source):
    body = block_after(source, source.index("header agg_t"))
    fields = re.findall(r"bit<(\d+)>\s+(\w+)\s*;", body)
    assert sum(int(w) for w, _ in fields) == 8 * HEADER_DTYPE.itemsize
    names = [n for _, n in fields]
    assert names[:2] == ["version", "pkt_type"]
    wire = list(HEADER_DTYPE.names)
    renamed = {"ver_type": None}
    assert [n for n in names[2:]] == [n for n in wire if n not in renamed]
    widths = dict((n, int(w)) for w, n in fields)
    for name in wire[1:]:
        assert widths[name] == 8 * HEADER_DTYPE[name].itemsize, name


def test_counter_cells_and_limits_agree_with_the_controller():
    counters = (P4_DIR / "counters.p4").read_text()
    headers = (P4_DIR / "headers.p4").read_text()
    consts = {m.group(1): int(m.group(2)) for m in
              re.finditer(r"const bit<32>\s+(\w+)\s*=\s*(\d+);", counters)}
    for name, cell in pc.JOB_COUNTER_CELLS.items():
        assert consts[f"JC_{name.upper()}"] == cell
    for name, cell in job_plan.GLOBAL_COUNTER_CELLS.items():
        assert consts[f"GC_{name.upper()}"] == cell
    for name, cell in job_plan.DLCP_COUNTER_CELLS.items():
        assert consts[f"DC_{name.upper().removeprefix('DLCP_')}"] == cell
    defines = {m.group(1): int(m.group(2))
               for m in re.finditer(r"#define\s+(\w+)\s+(\d+)", headers + counters)}
    assert defines["MAX_VALUES"] == pc.BMV2_MAX_VALUES
    assert defines["INDEX_BYTES"] * 2 == defines["MAX_VALUES"] == defines["SUM_WORDS"] * 8
    assert defines["MAX_JOBS"] == pc.BMV2_MAX_JOBS
    assert defines["SLOT_BUDGET"] == pc.BMV2_SLOT_BUDGET
    assert defines["SLOT_COPIES"] == 2 * defines["SLOT_BUDGET"]
    assert defines["JOB_COUNTER_STRIDE"] == job_plan.JOB_COUNTER_STRIDE


def test_checksum_recomputed_and_drop_reasons_all_counted(source):
    assert re.search(r"update_checksum\(\s*hdr\.ipv4\.isValid\(\)\s*&&\s*meta\.ipv4_changed",
                     source)
    ingress = controls(source)["SwitchIngress"]
    for name in list(job_plan.GLOBAL_COUNTER_CELLS) + list(pc.JOB_COUNTER_CELLS):
        assert f"C_{name.upper()}" in ingress, name      # every counter has a counting site
    dlcp = controls(source)["DlcpAdmission"]
    for name in job_plan.DLCP_COUNTER_CELLS:
        assert f"DC_{name.upper().removeprefix('DLCP_')}" in dlcp


def test_counters_read_by_the_controller_exist(source):
    ctl = controls(source)

    def declared(body: str) -> dict[str, int]:
        return {m.group(2): m.group(1) for m in
                re.finditer(r"counter<bit<32>>\(([^,]+),\s*CounterType\.packets\)\s+(\w+)\s*;",
                            body)}

    found = {f"SwitchIngress.{n}": size for n, size in declared(ctl["SwitchIngress"]).items()}
    for inst, ctype in instances(ctl["SwitchEgress"], set(ctl)).items():
        found.update({f"SwitchEgress.{inst}.{n}": s for n, s in declared(ctl[ctype]).items()})
    assert {pc.C_JOB, pc.C_GLOBAL, pc.C_DLCP} <= set(found)
    assert int(found[pc.C_DLCP]) > max(job_plan.DLCP_COUNTER_CELLS.values())
