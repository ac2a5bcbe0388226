"""The TNA program (p4src/tna) against Tofino's per-pass rules, the protocol and the
control plane, read from the preprocessed source (tna_source.py).

Where a Tofino compiler is installed (bf-p4c, or p4c with the p4c-barefoot back end) the
last test compiles the program and it must compile; elsewhere it skips with the reason."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from bfrt_scripts import bfrt_controls
from bfrt_scripts import tofino_plan as tp
from dataplane import config as dc
from dataplane import job_plan
from dataplane import reference as ref
from dataplane.config import Job, Member, Route, SwitchConfig
from dataplane.wire import HEADER_STRUCT
from host.packets import HEADER_DTYPE
from . import tna_source as ts

TABLE = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)
# Counter names of protocol v2 (protocol.md 4.5 plus rules R3 and R4).
V2_JOB_COUNTERS = set(ref.JOB_COUNTERS) | {"drop_unsatisfiable"}
V2_GLOBAL_COUNTERS = set(ref.GLOBAL_COUNTERS) | {"drop_fragment"}


@pytest.fixture(scope="module")
def controls():
    try:
        return ts.program()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def job_with(job_id, pool, members, vpp=tp.TOFINO_MAX_VALUES) -> Job:
    return Job(job_id, pool, TABLE, members, vpp)


def full_config() -> SwitchConfig:
    members = tuple(Member(w, w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.0.{w + 1}", 40000 + w)
                    for w in range(3))
    return SwitchConfig(jobs=(job_with(1, 8, members), job_with(2, 4, members[:2])),
                        routes=(Route("10.9.0.0/16", 1, "02:00:00:00:09:09",
                                      extra_hops=((2, "02:00:00:00:09:0a"),)),)).validate()


# ---------------------------------------------------------------- Tofino's per-pass rules
@pytest.mark.parametrize("top", ts.TOP_CONTROLS)
def test_each_table_register_and_counter_at_most_once_per_pass(controls, top):
    uses = ts.pass_uses(controls, top)
    over = {name: n for name, n in uses.items() if not name.startswith("action") and n > 1}
    assert not over, f"used more than once in one pass: {over}"


def test_every_register_is_reached_and_every_register_action_runs_somewhere(controls):
    uses = {**ts.pass_uses(controls, "SwitchIngress"), **ts.pass_uses(controls, "SwitchEgress")}
    registers = ts.bfrt_externs(controls, "registers")
    assert len(registers) >= 26           # 10 slot-state registers, 16 sum words, route turns
    for path in registers:
        assert uses.get(f"register {path}") == 1, path
    for ctl in controls.values():
        for action, register in ctl.register_actions.items():
            assert register in ctl.registers, (ctl.name, action)
            assert len(re.findall(rf"\b{action}\.execute\(", ctl.body)) == 1, action
    reached = {name.split()[1].rsplit(".", 1)[1] for name in uses if name.startswith("action")}
    declared = {a for ctl in controls.values() for a in ctl.register_actions}
    assert declared <= reached, declared - reached


def test_each_action_runs_at_most_one_stateful_alu(controls):
    """A table's action executes its stateful ALUs in the table's stage (4 per stage): one
    RegisterAction per action leaves the compiler free to place each register."""
    for ctl in controls.values():
        for name, (_, body) in ctl.actions.items():
            assert len(re.findall(r"\.execute\(", body)) <= 1, (ctl.name, name)


def test_each_stateful_action_has_one_call_site(controls):
    """Two call sites of an action that runs a register would be two tables competing for
    that register's one stateful ALU."""
    for ctl in controls.values():
        for name, (_, body) in ctl.actions.items():
            if ".execute(" in body:
                calls = len(re.findall(rf"\b{name}\s*\(", ctl.apply))
                in_tables = sum(name in t.actions for t in ctl.tables.values())
                assert calls + in_tables == 1, (ctl.name, name, calls, in_tables)


def test_each_table_has_one_apply_site(controls):
    for ctl in controls.values():
        for table in ctl.tables:
            assert len(re.findall(rf"\b{table}\.apply\(", ctl.body)) == 1, (ctl.name, table)


def test_the_pass_walk_sees_a_second_execution(controls):
    """The walker must catch what the rules forbid, or the tests above prove nothing."""
    text = """
    control Bad(inout headers_t hdr) {
        Register<bit<32>, bit<8>>(16) cells;
        RegisterAction<bit<32>, bit<8>, bit<32>>(cells) bump = {
            void apply(inout bit<32> v) { v = v + 1; } };
        RegisterAction<bit<32>, bit<8>, bit<32>>(cells) clear = {
            void apply(inout bit<32> v) { v = 0; } };
        action do_bump() { bump.execute(0); }
        action do_clear() { clear.execute(0); }
        table t { key = { hdr.x : exact; } actions = { do_bump; do_clear; } }
        apply {
            if (hdr.y == 1) { do_bump(); } else { do_clear(); }
            %s
        }
    }"""
    exclusive = ts.parse_controls(text % "")
    assert ts.pass_uses(exclusive, "Bad")["register pipe.Bad.cells"] == 1
    twice = ts.parse_controls(text % "t.apply();")
    assert ts.pass_uses(twice, "Bad")["register pipe.Bad.cells"] == 2
    applied_twice = ts.parse_controls(text % "t.apply(); if (hdr.z == 0) { t.apply(); }")
    assert ts.pass_uses(applied_twice, "Bad")["table pipe.Bad.t"] == 2


def test_register_actions_stay_within_one_stateful_alu(controls):
    """Tofino 1: two comparisons and one 32-bit result per RegisterAction, a 32-bit cell
    or a pair of cells. Counted from the source: conditions (if) and outputs."""
    checked = 0
    for ctl in controls.values():
        for m in re.finditer(r"RegisterAction<(.*?)>\s*\((\w+)\)\s+(\w+)\s*=\s*\{", ctl.body):
            checked += 1
            body, _ = ts.block_after(ctl.body, m.end() - 1)
            ifs = re.findall(r"\bif\s*\(([^{]*)\)\s*\{", body)
            comparisons = sum(len(re.findall(r"==|!=|>=|<=|>|<", re.sub(r"\b(?:int|bit)<\d+>",
                                                                       "", c))) for c in ifs)
            assert comparisons <= 2, (m.group(3), ifs)
            out = re.search(r"\bout\s+([\w<>]+)\s+(\w+)\)", body)
            if out:
                assert int(re.search(r"\d+", out.group(1)).group()) <= 32, m.group(3)
            value_type = ctl.registers[m.group(2)].split(",")[0].strip()
            width = re.fullmatch(r"bit<(\d+)>", value_type)
            assert (int(width.group(1)) if width else PAIRS[value_type]) <= 32, value_type
    assert checked == sum(len(c.register_actions) for c in controls.values())


PAIRS = {"occupancy_t": 8}      # register cells made of two fields: the field width

# ---------------------------------------------------------------- the control plane fits
def key_params(table: ts.Table) -> set[str]:
    names = set()
    for name, kind in table.keys:
        names |= {"ternary": {name, f"{name}_mask"}, "lpm": {name, f"{name}_p_length"},
                  "range": {f"{name}_start", f"{name}_end"}}.get(kind, {name})
    if any(kind in ("ternary", "range") for _, kind in table.keys):
        names.add("MATCH_PRIORITY")
    return names


def test_every_planned_entry_fits_the_program(controls):
    known = ts.bfrt_tables(controls)
    plan = tp.plan_switch(full_config(), tp.DeployOptions(drop_report_ports=(5,)))
    assert {e.table for e in plan.entries} <= set(known)
    for e in plan.entries:
        table, ctl = known[e.table]
        assert set(tp.key_kwargs(e.key)) == key_params(table), e.table
        assert e.action in table.actions and e.action not in table.default_only, e
        params = ctl.actions[e.action][0]
        assert [p.name for p in params] == [name for name, _ in e.data], e.action
        for p, (_, value) in zip(params, e.data):
            assert 0 <= value < 1 << p.width, (e.table, p.name, value)
        assert not table.has_const_entries, e.table
    for d in plan.defaults:
        table, ctl = known[d.table]
        assert not table.keys and d.action in table.actions
        assert [p.name for p in ctl.actions[d.action][0]] == [n for n, _ in d.data]
    # every table the control plane owns gets entries; the others are constant
    planned = {e.table for e in plan.entries} | {d.table for d in plan.defaults}
    for path, (table, _) in known.items():
        assert path in planned or table.has_const_entries, f"{path}: nothing installs it"


def test_table_sizes_hold_the_largest_plan(controls):
    known = ts.bfrt_tables(controls)
    members = tuple(Member(w, w, f"02:00:00:00:02:{w:02x}", f"10.1.0.{w + 1}", 41000 + w)
                    for w in range(8))
    jobs = tuple(job_with(100 + i, tp.SLOT_BUDGET // tp.MAX_JOBS, members)
                 for i in range(tp.MAX_JOBS))
    plan = tp.plan_switch(SwitchConfig(jobs=jobs))
    for table, entries in plan.tables().items():
        assert len(entries) <= known[table][0].size, table


def test_counters_the_readout_reads_exist(controls):
    counters = ts.bfrt_externs(controls, "counters")
    assert ts.eval_int(counters[tp.C_JOB]) == tp.MAX_JOBS * job_plan.JOB_COUNTER_STRIDE
    assert ts.eval_int(counters[tp.C_GLOBAL]) == tp.GLOBAL_COUNTER_CELLS_SIZE
    assert ts.eval_int(counters[tp.C_DLCP]) > max(job_plan.DLCP_COUNTER_CELLS.values())


def test_counter_cells_and_names_agree_with_the_protocol():
    text = (ts.P4_DIR / "counters.p4").read_text()
    consts = {m.group(1): int(m.group(2)) for m in
              re.finditer(r"const bit<\d+>\s+(\w+)\s*=\s*(\d+);", text)}
    for name, cell in tp.JOB_CELLS.items():
        assert consts[f"JC_{name.upper()}"] == cell
    for name, cell in job_plan.GLOBAL_COUNTER_CELLS.items():
        assert consts[f"GC_{name.upper()}"] == cell
    for name, cell in job_plan.DLCP_COUNTER_CELLS.items():
        assert consts[f"DC_{name.upper().removeprefix('DLCP_')}"] == cell
    assert set(tp.JOB_NAMES) == V2_JOB_COUNTERS
    assert set(job_plan.GLOBAL_COUNTER_CELLS) | set(job_plan.DLCP_COUNTER_CELLS) == \
        V2_GLOBAL_COUNTERS
    assert max(tp.JOB_CELLS.values()) < job_plan.JOB_COUNTER_STRIDE
    assert max(job_plan.GLOBAL_COUNTER_CELLS.values()) < tp.GLOBAL_COUNTER_CELLS_SIZE


def test_limits_agree_with_the_plan():
    text = "".join((ts.P4_DIR / f).read_text() for f in ("headers.p4", "counters.p4"))
    d = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define\s+(\w+)\s+(\d+)", text)}
    assert d["MAX_VALUES"] == tp.TOFINO_MAX_VALUES >= 64
    assert d["INDEX_BYTES"] * 2 == d["SUM_WORDS"] * 4 == d["MAX_VALUES"]
    assert (d["MAX_JOBS"], d["SLOT_BUDGET"], d["JOB_COUNTER_STRIDE"]) == \
        (tp.MAX_JOBS, tp.SLOT_BUDGET, job_plan.JOB_COUNTER_STRIDE)
    assert d["SLOT_COPIES"] == 2 * d["SLOT_BUDGET"]
    assert (d["MAX_ROUTES"], d["MAX_NEXT_HOP_SLOTS"]) == (tp.MAX_ROUTES, tp.NEXT_HOP_SLOTS)
    widths = {m.group(2): int(m.group(1))
              for m in re.finditer(r"typedef bit<(\d+)>\s+(\w+);", text)}
    assert 1 << widths["slot_index_t"] == d["SLOT_BUDGET"]
    assert 1 << widths["copy_index_t"] == d["SLOT_COPIES"]
    assert 1 << widths["route_index_t"] == d["MAX_ROUTES"]
    assert 1 << widths["next_hop_index_t"] == d["MAX_NEXT_HOP_SLOTS"]
    assert ts.TYPE_WIDTHS["slot_index_t"] == widths["slot_index_t"]
    # popcount(expected): the planner's chunks are the key slices of validation.p4
    slices = re.findall(r"hdr\.agg\.expected\[(\d+):(\d+)\]\s*: exact",
                        (ts.P4_DIR / "validation.p4").read_text())
    assert [(int(lo), int(hi) - int(lo) + 1) for hi, lo in slices] == \
        [(shift, width) for shift, width, _ in tp.EXPECTED_CHUNKS]
    assert sum(width for _, width, _ in tp.EXPECTED_CHUNKS) == 32


# ---------------------------------------------------------------- the protocol is all there
def test_agg_header_matches_the_wire_format(controls):
    text = ts.preprocess()
    body, _ = ts.block_after(text, text.index("header agg_t"))
    fields = re.findall(r"bit<(\d+)>\s+(\w+)\s*;", body)
    assert sum(int(w) for w, _ in fields) == 8 * HEADER_DTYPE.itemsize
    names = [n for _, n in fields]
    assert names[:2] == ["version", "pkt_type"]
    assert names[2:] == [n for n in HEADER_DTYPE.names if n != "ver_type"]
    version = re.search(r"AGG_VERSION\s*=\s*(\d+);", text)
    assert int(version.group(1)) == 2
    assert dc.PROTOCOL_VERSION == 2


FEATURES = {
    "R4 fragments dropped before anything else": [r"meta\.is_fragment == 1",
                                                  r"drop_global\(GC_DROP_FRAGMENT\)"],
    "R2 members bound to port and addresses": [r'ingress_port\s*: exact @name\("port"\)',
                                               r'src_addr\s*: exact @name\("mac"\)',
                                               r'src_port\s*: exact @name\("udp_port"\)'],
    "R3 unsatisfiable slots": [r"drop_job\(JC_DROP_UNSATISFIABLE\)", r"table expected_in_job",
                               r"table expected_too_few", r"members_gap\[7:7\]"],
    "R7 per-job values_per_packet": [r"values_gap\[15:15\]\s*: ternary"],
    "R1 serial round arithmetic": [r"\(int<32>\)\(hdr\.agg\.round - round\) > 0",
                                   r"round_distance\[31:31\] == 0"],
    "R5 incremental checksum": [r"control CeChecksumUpdate", r"ce_checksum\.apply"],
    "two copies by round parity": [r"copy_of_slot\.get\(\{hdr\.agg\.round\[0:0\], meta\.slot_index\}\)"],
    "FLUSH empties both copies": [r"cell\.copy0 = 0;\s*cell\.copy1 = 0;"],
    "RESULT multicast through the TM": [r"ig_tm_md\.mcast_grp_a = meta\.group",
                                        r"eg_intr_md\.egress_rid"],
    "unicast re-serve and STRAGGLER": [r"OUTCOME_RESERVE", r"TYPE_STRAGGLER",
                                       r"FLAG_RESERVE \| FLAG_LATE"],
    "completion by expected set or min_count": [r"meta\.target_left = meta\.expected_size - 1",
                                                r"meta\.target_left = hdr\.agg\.min_count - 1"],
    "DLCP queue, colour, deflection, CE": [r"ig_tm_md\.qid", r"ig_tm_md\.packet_color",
                                           r"ig_tm_md\.deflect_on_drop",
                                           r"eg_intr_md\.enq_qdepth", r"hdr\.ipv4\.diffserv\[1:0\] = 3"],
    "per-packet spraying": [r"take_turn\.execute"],
    "lanes added four to a 32-bit cell": [r"cell = cell \+ values;"],
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_protocol_feature_is_in_the_program(controls, feature):
    text = ts.preprocess()
    for pattern in FEATURES[feature]:
        assert re.search(pattern, text), (feature, pattern)


def test_validation_order_follows_the_protocol(controls):
    """R4 (fragments) before everything, then agg_checks' rows in the protocol's order."""
    apply = controls["SwitchIngress"].apply
    assert apply.index("drop_global(GC_DROP_FRAGMENT)") < apply.index("agg_checks.apply()")
    order = ["GC_DROP_BAD_VERSION", "GC_DROP_BAD_TYPE", "GC_DROP_BAD_LENGTH",
             "GC_DROP_UNKNOWN_JOB", "GC_DROP_BAD_LENGTH", "JC_DROP_BAD_SLOT",
             "JC_DROP_NOT_MEMBER", "JC_DROP_BAD_EXPECTED", "JC_DROP_UNSATISFIABLE"]
    verdicts = [a for _, (_, a) in agg_checks_rows(controls)]
    named = [v for v in dict.fromkeys(verdicts) if not v.startswith("accept")]
    assert [v for v in named if v in order] == list(dict.fromkeys(order))
    assert controls["SwitchIngress"].tables["agg_checks"].default == (
        "drop_global", [0])                    # GC_DROP_TRUNCATED: no valid AGG header


def agg_checks_rows(controls) -> list[tuple[list[str], tuple[str, str]]]:
    """agg_checks' constant rows in priority order: (key patterns, (action, cell name))."""
    return [(keys, (action, args))
            for keys, action, args in controls["SwitchIngress"].tables["agg_checks"].entries]


def tofino_check_inputs(cfg, plan, h: dict, udp_payload_len: int) -> dict:
    """The fields agg_checks reads, as validation.p4 and forwarding.p4 set them (the
    per-job tables from the plan's own entries)."""
    job = next((j for j in cfg.jobs if j.job == h["job"]), None)
    members = {m.worker: m for m in job.members} if job else {}
    header = (2 if h["type"] == 0 else 3 if h["type"] == 3 else 1) if h["version"] == 2 else 0
    lengths = {"pkt_type": h["type"], "num_values": h["num_values"],
               "udp_length": 8 + udp_payload_len, "ip_length": 28 + udp_payload_len,
               "parser_err": 0}
    length_ok = any(all(tp_match(lengths[k], v) for k, v in e.key if k != "MATCH_PRIORITY")
                    for e in plan.entries if e.table == tp.T_AGG_LENGTHS)
    strays = not any(e.key_dict["job"] == h["job"] and tp_match(h["expected"], e.key_dict["expected"])
                     for e in plan.entries if e.table == tp.T_EXPECTED_IN_JOB)
    e = h["expected"]
    chunks = [bin(e >> 21).count("1"), bin(e >> 10 & 0x7FF).count("1"), bin(e & 0x3FF).count("1")]
    vpp, pool = (job.values_per_packet, job.pool_size) if job else (0, 0)
    return {
        "header_check": header, "length_ok": int(length_ok), "job_known": int(job is not None),
        "values_over": (vpp - h["num_values"]) >> 15 & 1,
        "slot_high": h["slot"] >> 13, "slot_in_pool": (h["slot"] - pool) >> 15 & 1,
        "is_member": int(h["worker"] in members), "expected": e, "min_count": h["min_count"],
        "in_expected": int(h["worker"] < 32 and e >> h["worker"] & 1),
        "expected_strays": int(strays),
        "too_few_expected": int(sum(chunks) + 1 <= h["min_count"] & 63),
        "members_short": (len(members) - h["min_count"]) >> 7 & 1, "parity": h["round"] & 1,
        "agg_valid": 1}


def tp_match(value: int, key) -> bool:
    if isinstance(key, tp.Ternary):
        return value & key.mask == key.value & key.mask
    return value == key


def test_agg_checks_decide_like_the_reference(controls, monkeypatch):
    """Random AGG headers through agg_checks' rows (first match, parsed from the source)
    give the verdict the reference aggregator gives, with the plane's MAX_VALUES = 64."""
    monkeypatch.setattr(ref, "MAX_VALUES", tp.TOFINO_MAX_VALUES)
    table = controls["SwitchIngress"].tables["agg_checks"]
    rows = agg_checks_rows(controls)
    names = ts.constants(ts.preprocess())
    cell_names = {f"GC_{n.upper()}": n for n in job_plan.GLOBAL_COUNTER_CELLS} | {
        f"JC_{n.upper()}": n for n in tp.JOB_CELLS}
    cfg = full_config()
    full = tp.plan_switch(cfg)
    plan = tp.TofinoPlan(full.layouts)
    plan.entries = [e for e in full.entries if e.table in (tp.T_AGG_LENGTHS, tp.T_EXPECTED_IN_JOB)]
    rng = np.random.default_rng(11)
    pick = lambda *choices: choices[rng.integers(len(choices))]    # noqa: E731
    seen = set()
    for _ in range(3000):
        h = {"version": pick(2, 2, 2, 2, 1, 3), "type": pick(0, 0, 0, 0, 3, 3, 1, 2, 7),
             "num_values": pick(int(rng.integers(1, 65)), 0, 65, 64, 1),
             "job": pick(1, 1, 2, 9), "slot": pick(int(rng.integers(0, 8)), 3, 4, 7, 8,
                                                   8192, 8195, 65535),
             "worker": pick(0, 1, 2, 2, 3, 31, 40),
             "min_count": pick(0, 0, 1, 2, 3, 4, 63, 64, 65, 128, 200),
             "expected": pick(0, 0, int(rng.integers(0, 8)), int(rng.integers(0, 16)), 1 << 31),
             "round": int(rng.integers(0, 1 << 32))}
        payload = (h["num_values"] + 1) // 2 if h["type"] == 0 else 0
        udp_payload_len = 32 + payload + pick(0, 0, 0, 0, 0, 1, -1)
        inputs = tofino_check_inputs(cfg, plan, h, udp_payload_len)
        verdict = ts.first_match(table, inputs, names)
        assert verdict is not None, h               # every valid AGG header meets a row
        sw = ref.ReferenceSwitch(cfg)
        member = next((m for j in cfg.jobs if j.job == h["job"] for m in j.members
                       if m.worker == h["worker"]), None)
        data = HEADER_STRUCT.pack(h["version"] << 4 | h["type"], 0, h["job"],
                                  h["slot"], h["worker"], h["min_count"], h["round"],
                                  h["expected"], 0, 0, 0,
                                  h["num_values"], 0, 0) + bytes(max(payload, 0))
        sw.handle_agg(member.port if member else 7, data, udp_payload_len, True, 0)
        before = ref.ReferenceSwitch(cfg).counters()
        moved = {n for n, v in sw.counters()["global"].items() if v != before["global"][n]}
        moved |= {n for j, c in sw.counters()["jobs"].items() for n, v in c.items()
                  if v != before["jobs"][j][n]}
        action, cell = verdict
        accepted = action.startswith("accept")
        want = {"rx"} if accepted else {cell_names[cell]}
        assert want <= moved and (accepted or len(moved) == 1), (h, verdict, moved)
        if accepted:        # the occupancy step it runs: the FLUSH's slot, or the round's copy
            assert action == ("accept_flush" if h["type"] == 3 else
                              f"accept_copy{h['round'] & 1}"), (h, action)
        seen.add(verdict)
    assert {v for _, v in rows} <= seen, "every row decided some packet"


# ---------------------------------------------------------------- arithmetic of the program
def test_four_lanes_in_one_32_bit_add_match_the_reference():
    """lookup.p4 pairs -> SumWord operands (p2k ++ p2k+1) -> plain 32-bit adds: with
    n * max(T) <= 255 no lane carries, and the bytes are the reference's RESULT."""
    rng = np.random.default_rng(5)
    members = tuple(Member(w, w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.0.{w + 1}", 40000 + w)
                    for w in range(8))                  # 8 x 30 = 240 <= 255
    cfg = SwitchConfig(jobs=(job_with(3, 2, members),)).validate()
    plan = tp.plan_switch(cfg)
    pairs = {(int(e.table.split(".")[-2][7:]), e.key_dict["packed"]):
             e.data_dict["high_value"] << 8 | e.data_dict["low_value"]
             for e in plan.entries if e.table.endswith("byte_to_lanes")}
    num_values = 63                                     # odd: the padding nibble is masked
    words = [0] * tp.SUM_WORDS
    switch = ref.ReferenceSwitch(cfg)
    results = []
    for m in members:
        idx = rng.integers(0, 16, num_values + 1).astype(np.uint8)
        idx[-1] = 15                                    # a misbehaving padding nibble
        payload = bytes((idx[0::2] << 4) | idx[1::2])
        lanes = [pairs[k, payload[k]] & (0xFF00 if num_values == 2 * k + 1 else 0xFFFF)
                 for k in range(len(payload))] + [0] * (tp.INDEX_BYTES - len(payload))
        words = [(w + (lanes[2 * k] << 16 | lanes[2 * k + 1])) & 0xFFFFFFFF
                 for k, w in enumerate(words)]
        header = struct_pack_data(ref.PROTOCOL_VERSION, 3, m.worker, sum(1 << w for w in
                                  range(8)), num_values)
        data = header + payload
        results += switch.handle_agg(m.port, data, len(data), True, 0)
    assert len(results) == 8
    got = b"".join(w.to_bytes(4, "big") for w in words)[:num_values]
    assert {bytes(r.agg[32:]) for r in results} == {got}


def struct_pack_data(version, job, worker, expected, num_values) -> bytes:
    return HEADER_STRUCT.pack(version << 4, 0, job, 0, worker, 0, 0, expected, 0,
                              0, 0, num_values, 0, 0)


def ce_step_entries() -> list[tuple[int, int | None, int]]:
    """checksums.p4's ce_step entries in order: (delta, checksum or None for _, addend)."""
    text = (ts.P4_DIR / "checksums.p4").read_text()
    body = re.search(r"const entries = \{(.*?)\}", text, re.S).group(1)
    return [(int(d), None if c == "_" else int(c), int(a, 0)) for d, c, a in
            re.findall(r"\((\d+),\s*(\w+)\)\s*:\s*subtract\((\w+)\);", body)]


def test_ce_checksum_entries_are_rfc1624_eqn3():
    """checksums.p4: for ECT -> CE, the first ce_step entry that matches (delta = 3 - ECN,
    HC) adds what ~(~HC + ~m + m') needs, for every HC and every ECT ToS byte."""
    def fold(s):
        while s >> 16:
            s = (s & 0xFFFF) + (s >> 16)
        return s

    entries = ce_step_entries()
    assert len(entries) == 5
    hc = np.arange(1 << 16)
    for m in (0x4501, 0x4502, 0x45B9, 0x45BA, 0x4F01, 0x4602):
        mp = m | 3
        delta = 3 - (m & 3)
        eqn3 = np.array([~fold((~h & 0xFFFF) + (~m & 0xFFFF) + mp) & 0xFFFF for h in hc])
        tofino = np.empty_like(hc)
        done = np.zeros(hc.shape, bool)
        for d, c, addend in entries:
            hit = ~done & (d == delta) & ((hc == c) if c is not None else True)
            tofino[hit] = (hc[hit] + addend) & 0xFFFF
            done |= hit
        assert done.all() and (eqn3 == tofino).all(), hex(m)


def test_result_words_carry_every_value_and_the_lengths_say_num_values():
    """result_words makes ceil(nv / 4) words (the last one's unused lanes trail the
    datagram as link padding, protocol.md 5.1), and the egress sets the UDP and IPv4
    lengths from num_values; the egress parser stops at the AGG header."""
    agg = (ts.P4_DIR / "aggregation.p4").read_text()
    parser = (ts.P4_DIR / "parser.p4").read_text()
    text = ts.preprocess()
    table = ts.program()["BuildAggReply"].tables["result_words"]
    words = {ts.eval_int(nv): int(action.removeprefix("words_"))
             for (nv,), action, _ in table.entries}
    assert sorted(words) == list(range(1, tp.TOFINO_MAX_VALUES + 1))
    for nv, k in words.items():
        assert k == -(-nv // 4), nv
    for k in range(1, tp.SUM_WORDS + 1):      # words_k validates words 0 .. k - 1
        body, _ = ts.block_after(text, text.index(f"action words_{k}()"))
        assert f"hdr.sums[{k} - 1].setValid()" in body and f"words_{k - 1}()" in body
    assert re.search(r"hdr\.udp\.length = UDP_HEADER_LEN \+ AGG_HEADER_LEN \+ "
                     r"hdr\.agg\.num_values", agg)
    assert re.search(r"hdr\.ipv4\.total_len = IPV4_HEADER_LEN \+ hdr\.udp\.length", agg)
    reply = re.search(r"state parse_reply \{(.*?)\}", parser, re.S).group(1)
    assert "hdr.sums" not in reply and "transition accept" in reply


# ---------------------------------------------------------------- the real compiler
# (target, architecture, back-end options, the binary). Tofino 2 needs two options of p4c
# 1.2.5.16's open-source back end: with CLOTs its assembler crashes on the index bytes, and
# its dark-container allocation overlaps metadata fields (p4src/tna/README.md).
TARGETS = {"tofino": ("tofino", "tna", [], "tofino.bin"),
           "tofino2": ("tofino2", "t2na", ["--no-clot", "--disable-dark-allocation"],
                       "tofino2.bin")}


def tofino_compiler(target: str, arch: str, options: list[str]) -> list[str] | None:
    """The SDE's bf-p4c, or p4c's driver with the p4c-barefoot back end (both pass back-end
    options with -Xp4c), or that back end alone."""
    driver = shutil.which("bf-p4c")
    if driver is None and shutil.which("p4c-barefoot"):
        driver = shutil.which("p4c")
        if driver is None:
            return ["p4c-barefoot", "--target", target, "--arch", arch, *options]
    if driver is None:
        return None
    extra = [f"-Xp4c={' '.join(options)}"] if options else []
    return [driver, "--target", target, "--arch", arch, *extra]


def assert_plan_fits_bfrt(bfrt: dict) -> None:
    """Every write the deployment scripts make names a table, key field, action and
    action parameter of the compiler's own control-plane description (bfrt.json), and
    every counter and register they read exists there."""
    tables = {t["name"]: t for t in bfrt["tables"]}
    plan = tp.plan_switch(full_config(), tp.DeployOptions(drop_report_ports=(5,)))
    for e in plan.entries + plan.defaults:
        assert e.table in tables, e.table
        t = tables[e.table]
        keys = {k["name"] for k in t.get("key", [])}
        assert {n for n, _ in getattr(e, "key", ())} <= keys | {"$MATCH_PRIORITY",
                                                                "MATCH_PRIORITY"}, e
        actions = {a["name"].split(".")[-1]: a for a in t.get("action_specs", [])}
        assert e.action in actions, (e.table, e.action, sorted(actions))
        assert [n for n, _ in e.data] == [d["name"] for d in actions[e.action]["data"]], e
    def data_names(table):
        return {(d.get("singleton") or d)["name"] for d in table["data"]}

    for path in (tp.C_JOB, tp.C_GLOBAL, tp.C_DLCP):    # read as bfrt_controls reads them
        assert "$COUNTER_SPEC_PKTS" in data_names(tables[path]), path
    for name in bfrt_controls.SlotState.REGISTERS:
        register = tables[f"{tp.INGRESS}.slot_state.{name}"]
        assert f"SwitchIngress.slot_state.{name}.f1" in data_names(register), name


@pytest.mark.timeout(1800)             # a Tofino compile takes minutes
@pytest.mark.parametrize("chip", sorted(TARGETS))
def test_the_program_compiles_for_tofino(tmp_path, chip):
    target, arch, options, binary = TARGETS[chip]
    command = tofino_compiler(target, arch, options)
    if command is None:
        pytest.skip("no Tofino compiler on PATH (bf-p4c, or p4c with its p4c-barefoot back "
                    "end); the CEO side compiles p4src/tna/thc_ina.p4 with the open-source "
                    "Tofino back end")
    out = subprocess.run(command + ["-o", str(tmp_path), str(ts.P4_MAIN)],
                         capture_output=True, text=True, timeout=1700)
    log = out.stdout + out.stderr
    bfrt = tmp_path / "bfrt.json"
    assert bfrt.exists(), log[-8000:]
    assert_plan_fits_bfrt(json.loads(bfrt.read_text()))
    # placed (Tofino 1: in its 12 ingress stages) and assembled: the binary the SDE loads
    assert out.returncode == 0, log[-8000:]
    assert (tmp_path / "pipe" / binary).exists(), log[-8000:]
