"""The v1model program through the real compiler, where p4c is on PATH.

A real compile beats a structural check: p4c must accept p4src/v1model with no error, and
every entry the controller plans (dataplane.bmv2.control.plan_switch) must fit the P4Info p4c
writes: tables, match fields and widths, actions and their parameters, the counters the
controller reads. Elsewhere the module skips with the reason (p4c is not packaged here).
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from dataplane import job_plan
from dataplane.config import Job, Member, Route, SwitchConfig
from dataplane.bmv2 import control as pc

pytestmark = pytest.mark.skipif(
    shutil.which("p4c") is None,
    reason="p4c is not on PATH (not packaged here: build p4lang/p4c privately, "
           "see p4src/v1model/README.md)")

TABLE = (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 24, 27, 30)


@pytest.fixture(scope="module")
def p4info(tmp_path_factory):
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2
    out = tmp_path_factory.mktemp("p4c")
    info_path = out / "main.p4info.txtpb"
    proc = subprocess.run(["p4c", "--target", "bmv2", "--arch", "v1model",
                           "--p4runtime-files", str(info_path), "-o", str(out),
                           str(pc.P4_SOURCE)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"p4c failed:\n{proc.stdout}{proc.stderr}"
    assert "error" not in proc.stderr.lower(), proc.stderr
    assert (out / "main.json").stat().st_size > 0
    return text_format.Parse(info_path.read_text(), p4info_pb2.P4Info())


def plan() -> pc.SwitchPlan:
    members = tuple(Member(w, w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.1.{w + 1}", 41000 + w)
                    for w in range(4))
    config = SwitchConfig(jobs=(Job(1, 64, TABLE, members, pc.BMV2_MAX_VALUES),
                                Job(7, 32, TABLE, members[:2], 16)),
                          routes=(Route("10.9.0.0/16", 5, "02:00:00:00:09:01",
                                        extra_hops=((6, "02:00:00:00:09:02"),)),))
    return pc.plan_switch(config)


def test_p4c_compiles_the_program(p4info):
    assert p4info.tables, "the P4Info lists no tables"


def test_every_planned_entry_fits_the_compiled_program(p4info):
    tables = {t.preamble.name: t for t in p4info.tables}
    actions = {a.preamble.name: a for a in p4info.actions}
    for e in plan().entries:
        assert e.table in tables, f"{e.table} is not a table of the compiled program"
        table = tables[e.table]
        fields = {f.name: f for f in table.match_fields}
        assert {name for name, _ in e.match} <= set(fields), f"{e.table}: {e.match}"
        action_ids = {ref.id for ref in table.action_refs}
        assert e.action in actions and actions[e.action].preamble.id in action_ids, \
            f"{e.table}: action {e.action}"
        params = {p.name: p for p in actions[e.action].params}
        assert [name for name, _ in e.params] == [p.name for p in actions[e.action].params], \
            f"{e.action}: parameters {e.params}"
        for name, value in e.params:
            if value.isdigit():
                assert int(value) < 1 << params[name].bitwidth, f"{e.action}.{name}={value}"


def test_counters_the_controller_reads_are_compiled(p4info):
    counters = {c.preamble.name: c.size for c in p4info.counters}
    for name in (pc.C_JOB, pc.C_GLOBAL, pc.C_DLCP, pc.C_QUEUE_DEPARTURES):
        assert name in counters, f"{name} is not a counter of the compiled program"
    assert counters[pc.C_JOB] >= pc.BMV2_MAX_JOBS * job_plan.JOB_COUNTER_STRIDE
    assert counters[pc.C_GLOBAL] > max(job_plan.GLOBAL_COUNTER_CELLS.values())
    assert counters[pc.C_QUEUE_DEPARTURES] == pc.BMV2_DLCP_PORTS * 8
