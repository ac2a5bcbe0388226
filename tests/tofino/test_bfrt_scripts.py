"""bfrt_scripts/ against a recording STAND-IN of the bfrt object (tests/tofino/
bfrt_standin.py: built from the TNA source, it refuses what bfrt_python would refuse; it
is not a switch). Checks every write for a job, idempotence, the dry run, the refusals,
the counter readout, the bfshell script and the deploy wrapper."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bfrt_scripts import deploy, setup_switch
from bfrt_scripts import tofino_plan as tp
from bfrt_scripts.bfrt_controls import (BfrtError, BfrtWriter, ThcInaSwitch, as_int,
                                         planned_key, shown_key)
from dataplane import job_plan
from dataplane import reference as ref
from dataplane.config import ConfigError, Dlcp, Job, Member, Route, SwitchConfig
from .bfrt_standin import BfrtStandIn, StandInError
from .tna_source import bfrt_tables, program

TABLE = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)


def members(n: int, first_port: int = 0) -> tuple[Member, ...]:
    return tuple(Member(w, first_port + w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.0.{w + 1}",
                        40000 + w) for w in range(n))


def job(job_id=10, pool=8, n=4, first_port=0, vpp=64) -> Job:
    return Job(job_id, pool, TABLE, members(n, first_port), vpp)


def config(**kw) -> SwitchConfig:
    jobs = kw.pop("jobs", (job(), job(11, 4, 3, first_port=8)))
    routes = kw.pop("routes", (Route("10.9.0.0/16", 20, "02:00:00:00:09:01",
                                     extra_hops=((21, "02:00:00:00:09:02"),)),))
    return SwitchConfig(jobs=jobs, routes=routes, **kw).validate()


OPTIONS = tp.DeployOptions(drop_report_ports=(30,), add_ports=True)


def table_writes(standin, prefix="thc_ina.pipe."):
    return [w for w in standin.log if w[1].startswith(prefix)]


# ---------------------------------------------------------------- every write for a job
def test_install_writes_every_planned_entry_exactly_once():
    standin = BfrtStandIn()
    switch = ThcInaSwitch(standin, OPTIONS)
    plan = switch.install(config())
    writes = table_writes(standin)
    assert len(writes) == len(plan.entries) + len(plan.defaults)
    expected = {(f"add_with_{e.action}", f"thc_ina.{e.table}",
                 tuple(sorted({**tp.key_kwargs(e.key), **e.data_dict}.items())))
                for e in plan.entries}
    got = {(m, p, tuple(sorted(kw.items()))) for m, p, kw in writes if m.startswith("add")}
    assert got == expected
    for e in plan.entries:                  # and the stand-in holds each as planned
        raw = standin.table(f"thc_ina.{e.table}").get(**tp.key_kwargs(e.key),
                                                     print_ents=False).raw()
        assert raw["action"].endswith(e.action)
        assert all(as_int(raw["data"][k]) == v for k, v in e.data)
    default = standin.table(f"thc_ina.{tp.T_DROP_REPORTING}").get_default().raw()
    assert default["data"] == {"enabled": 1}


def test_job_entries_carry_the_job_description():
    cfg = config()
    plan = ThcInaSwitch(BfrtStandIn(), OPTIONS).install(cfg)
    jobs = {e.key_dict["job"]: e.data_dict for e in plan.entries if e.table == tp.T_JOBS}
    assert jobs[10] == {"job_index": 0, "counter_base": 0, "slot_base": 0, "pool_size": 8,
                        "values_per_packet": 64, "member_count": 4, "group": 1}
    assert jobs[11]["slot_base"] == 8 and jobs[11]["counter_base"] == 16
    assert jobs[11]["job_index"] == 1
    assert jobs[11]["group"] == 2
    # rule R3: one ternary entry per job matches an expected set of members only
    strays = {e.key_dict["job"]: (e.key_dict["expected"], e.action)
              for e in plan.entries if e.table == tp.T_EXPECTED_IN_JOB}
    assert strays == {10: (tp.Ternary(0, 0xFFFFFFF0), "members_only"),
                      11: (tp.Ternary(0, 0xFFFFFFF8), "members_only")}
    keys = {tuple(sorted(e.key_dict.items())) for e in plan.entries if e.table == tp.T_MEMBERS}
    assert (("ip", 0x0A000002), ("job", 10), ("mac", 0x020000000102), ("port", 1),
            ("udp_port", 40001), ("worker", 1)) in keys
    assert len(keys) == 7
    lanes = [e for e in plan.entries if e.table == tp.lookup_table(17)]
    assert len(lanes) == 2 * 256
    assert {e.key_dict["job_index"] for e in lanes} == {0, 1}     # keyed on the dense index
    for e in lanes:
        b = e.key_dict["packed"]
        assert e.data_dict == {"high_value": TABLE[b >> 4], "low_value": TABLE[b & 15]}
    own = [e for e in plan.entries if e.table == tp.T_SWITCH_ADDRESS]
    assert [e.key_dict for e in own] == [{"dst_addr": 0x0A0000FE}]


def test_multicast_nodes_rid_is_the_worker_and_groups_follow_worker_order():
    standin = BfrtStandIn()
    plan = ThcInaSwitch(standin, tp.DeployOptions(port_map=((0, 128), (1, 136),
                                                            (2, 144), (3, 152)))).install(
        config(jobs=(job(),), routes=()))
    nodes = {k[0][1]: e.raw()["data"] for k, e in standin.pre.node.entries.items()}
    assert {n: (d["$MULTICAST_RID"], d["$DEV_PORT"]) for n, d in nodes.items()} == \
        {1: (0, [128]), 2: (1, [136]), 3: (2, [144]), 4: (3, [152])}
    (group,) = standin.pre.mgid.entries.values()
    assert group.raw()["key"] == {"$MGID": 1}
    assert group.raw()["data"]["$MULTICAST_NODE_ID"] == [1, 2, 3, 4]
    assert [g.mgid for g in plan.groups] == [1]


def test_traffic_manager_gets_strict_priority_capacity_and_colour_limits():
    standin = BfrtStandIn()
    cfg = config(dlcp=Dlcp(capacity=40))
    plan = ThcInaSwitch(standin, OPTIONS).install(cfg)
    cpp = plan.cells_per_packet
    assert cpp == 2                          # a 64-value RESULT: 138 bytes, 80-byte cells
    ports = tp.used_ports(cfg, OPTIONS)
    assert set(ports) == {0, 1, 2, 3, 8, 9, 10, 20, 21, 30}
    for port in ports:
        raw = standin.tf1.tm.port.cfg.get(dev_port=port).raw()["data"]
        for queue in range(8):
            key = {"pipe": tp.pipe_of(port), "pg_id": raw["pg_id"],
                   "pg_queue": raw["egress_qid_queues"][queue]}
            sched = standin.tf1.tm.queue.sched_cfg.get(**key).raw()["data"]
            assert sched["max_priority"] == sched["min_priority"] == str(queue)
            buffer = standin.tf1.tm.queue.buffer.get(**key).raw()
            assert buffer["action"] == "buffer_only"
            assert buffer["data"]["guaranteed_cells"] == 40 * cpp
            color = standin.tf1.tm.queue.color.get(**key).raw()["data"]
            assert color["drop_enable"] is True
            assert color["drop_limit_yellow"] == tp.yellow_limit(cfg.dlcp.thresholds[queue], 40)
    pipe = standin.tf1.tm.pipe.cfg.get_default(pipe=0).raw()["data"]
    report = standin.tf1.tm.port.cfg.get(dev_port=30).raw()["data"]
    assert (pipe["mirror_drop_pg_id"], pipe["mirror_drop_pg_queue"]) == \
        (report["pg_id"], report["egress_qid_queues"][0])
    assert "mirror_drop_enable" not in pipe             # Tofino 1's pipe.cfg has no such field
    marks = {e.key_dict["queue"]: e.data_dict["mark_cells"]
             for e in plan.entries if e.table == tp.T_QUEUE_THRESHOLDS}
    assert marks == {q: k * cpp for q, k in enumerate(cfg.dlcp.thresholds)}
    ports_up = {k[0][1]: e.raw()["data"] for k, e in standin.port.port.entries.items()}
    assert set(ports_up) == set(ports)
    assert all(d["$SPEED"] == "BF_SPEED_100G" and d["$PORT_ENABLE"] for d in ports_up.values())
    # The MAC takes frames up to MAX_FRAME (9216 bytes + the 4-byte FCS), protocol.md §4.1.
    assert all(d["$RX_MTU"] == d["$TX_MTU"] == 9220 for d in ports_up.values())


def test_yellow_limit_never_drops_a_packet_the_reference_keeps():
    steps = [float(s.rstrip("%")) / 100 for s in tp.YELLOW_STEPS]
    for capacity in range(1, 80):
        for k in range(0, capacity + 3):
            limit = steps[tp.YELLOW_STEPS.index(tp.yellow_limit(k, capacity))]
            if k >= capacity:
                assert limit == 1.0
                continue
            assert limit * capacity >= k + 1                 # never before the reference
            smaller = [s for s in steps if s < limit]
            assert not smaller or smaller[-1] * capacity < k + 1     # the tightest step


# ---------------------------------------------------------------- idempotence and dry run
def test_a_second_run_changes_nothing():
    standin = BfrtStandIn()
    cfg = config()
    ThcInaSwitch(standin, OPTIONS).install(cfg)
    before = len(standin.log)
    again = ThcInaSwitch(standin, OPTIONS)
    again.install(cfg)
    assert len(standin.log) == before
    assert again.writer.changes == []
    assert again.summary() == f"wrote 0 entries, {again.writer.unchanged} already as planned"


def test_a_drifted_entry_is_put_back_with_one_modify():
    standin = BfrtStandIn()
    cfg = config()
    plan = ThcInaSwitch(standin, OPTIONS).install(cfg)
    target = next(e for e in plan.entries if e.table == tp.lookup_table(3))
    table = standin.table(f"thc_ina.{target.table}")
    table.mod_with_set_lanes(**tp.key_kwargs(target.key), high_value=1, low_value=2)
    n = len(standin.log)
    again = ThcInaSwitch(standin, OPTIONS)
    again.install(cfg)
    assert [w[0] for w in standin.log[n:]] == ["mod_with_set_lanes"]
    assert table.get(**tp.key_kwargs(target.key)).raw()["data"] == target.data_dict


def test_dry_run_prints_every_write_and_writes_nothing():
    standin = BfrtStandIn()
    lines = []
    switch = ThcInaSwitch(standin, OPTIONS, dry_run=True, out=lines.append)
    plan = switch.install(config())
    assert standin.log == []
    writes = [line for line in lines if line.startswith("would ")]
    assert len(writes) == len(switch.writer.changes)
    n_tm = 3 * len(plan.queues) + 1
    assert len(writes) == (len(plan.entries) + len(plan.defaults) + len(plan.nodes)
                           + len(plan.groups) + len(plan.ports) + n_tm)
    assert any(line.startswith("would add_with_set_job thc_ina.pipe.SwitchIngress."
                               "job_membership.jobs job=10 ") for line in writes)
    # on a switch that already serves the job, the dry run has nothing to print
    ThcInaSwitch(standin, OPTIONS).install(config())
    lines.clear()
    quiet = ThcInaSwitch(standin, OPTIONS, dry_run=True, out=lines.append)
    quiet.install(config())
    assert lines == [] and quiet.summary().startswith("would write 0 entries")


def test_offline_dry_run_plans_a_clean_switch():
    lines = []
    switch = ThcInaSwitch(None, OPTIONS, out=lines.append)
    plan = switch.install(config())
    assert switch.writer.dry_run and len(lines) == len(switch.writer.changes)
    assert sum(1 for line in lines if "add_with_set_lanes" in line) == \
        sum(1 for e in plan.entries if e.action == "set_lanes")
    assert any("<queue 7 of dev_port 0>" in line for line in lines)


# ---------------------------------------------------------------- refusals
REFUSALS = [
    ("too many jobs", dict(jobs=tuple(job(i, 1, 1) for i in range(tp.MAX_JOBS + 1))),
     "at most 16"),
    ("slot budget", dict(jobs=(job(1, 6000), job(2, 3000))), "has 8192 in all: lower pool_size"),
    ("one pool over budget", dict(jobs=(job(1, 9000),)), "pool_size 9000"),
    ("8-bit lanes overflow", dict(jobs=(job(1, 4, 9),)), "overflows the 8-bit result lanes"),
    ("capacity past the queue depth", dict(dlcp=Dlcp(capacity=300000)),
     "queue limit of 524287 cells"),
]


@pytest.mark.parametrize("what, kw, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_job_the_program_cannot_hold_is_refused_before_any_write(what, kw, message):
    standin = BfrtStandIn()
    with pytest.raises(ConfigError, match=message):
        ThcInaSwitch(standin, OPTIONS).install(SwitchConfig(**{"jobs": (job(),), **kw}))
    assert standin.log == []


def test_values_per_packet_over_the_program_limit_is_refused():
    with pytest.raises(ConfigError, match="the Tofino program's limit of 64 values per "
                                          "packet; lower values_per_packet"):
        tp.plan_switch(SwitchConfig(jobs=(job(vpp=65),)))
    with pytest.raises(ConfigError, match="give each worker its own udp_port"):
        shared = (Member(0, 0, "02:00:00:00:01:01", "10.0.0.1", 40000),
                  Member(1, 1, "02:00:00:00:01:02", "10.0.0.1", 40000))
        tp.plan_switch(SwitchConfig(jobs=(Job(1, 4, TABLE, shared, 64),)))


def test_members_split_over_pipes_and_bad_ports_are_refused():
    with pytest.raises(ConfigError, match="members on pipes \\[0, 1\\].*ports of one pipe"):
        tp.plan_switch(config(jobs=(job(),)), tp.DeployOptions(port_map=((3, 130),)))
    with pytest.raises(ConfigError, match="dev_port 600 is not a device port"):
        tp.plan_switch(config(jobs=(job(),)), tp.DeployOptions(port_map=((0, 600),)))


def test_the_stand_in_refuses_what_bfrt_python_refuses():
    standin = BfrtStandIn()
    jobs = standin.thc_ina.pipe.SwitchIngress.job_membership.jobs
    with pytest.raises(StandInError, match="no parameters"):
        jobs.add_with_set_job(job=1, counter_base=0, slot_base=0, pool_size=1,
                              values_per_packet=1, member_count=1, group=1, colour=3)
    with pytest.raises(StandInError, match="does not fit 13 bits"):
        jobs.add_with_set_job(job=1, counter_base=0, slot_base=1 << 13, pool_size=1,
                              values_per_packet=1, member_count=1, group=1)
    with pytest.raises(AttributeError):
        jobs.add_with_unknown_job(job=1)        # @defaultonly: no add method
    with pytest.raises(AttributeError):
        standin.thc_ina.pipe.SwitchIngress.job_membership.no_such_table


# ---------------------------------------------------------------- counters
def test_counters_are_read_under_the_protocols_names():
    standin = BfrtStandIn()
    switch = ThcInaSwitch(standin, OPTIONS)
    plan = switch.install(config())
    base11 = plan.layouts[11].counter_base
    standin.counters[tp.C_JOB].update({base11 + tp.JOB_CELLS["pending"]: 5,
                                       base11 + tp.JOB_CELLS["complete"]: 2,
                                       base11 + tp.JOB_CELLS["duplicate"]: 1,
                                       base11 + tp.JOB_CELLS["flush"]: 3})
    standin.counters[tp.C_GLOBAL][job_plan.GLOBAL_COUNTER_CELLS["drop_fragment"]] = 4
    standin.counters[tp.C_DLCP][job_plan.DLCP_COUNTER_CELLS["dlcp_selective_drop"]] = 6
    # drop_oversize is the MACs' count of frames over 9216 bytes, on every port the program
    # takes frames on (members and next hops), not on others.
    first, last = plan.frame_ports[0], plan.frame_ports[-1]
    standin.port.port_stat.count(first, "FrameTooLong", 2)
    standin.port.port_stat.count(last, "FrameTooLong", 5)
    standin.port.port_stat.count(last, "FramesReceivedOversized", 7)     # a different count
    out = switch.counters(plan)
    assert set(out["jobs"][10]) == set(ref.JOB_COUNTERS) | {"drop_unsatisfiable"}
    assert set(out["global"]) == set(ref.GLOBAL_COUNTERS) | {"drop_fragment"}
    j = out["jobs"][11]
    assert (j["rx"], j["aggregated"], j["results_multicast"], j["drop_duplicate"],
            j["flushes"]) == (11, 7, 2, 1, 3)
    assert out["global"]["drop_fragment"] == 4 and out["global"]["dlcp_selective_drop"] == 6
    assert out["global"]["drop_oversize"] == 2 + 5
    assert all(v == 0 for v in out["jobs"][10].values())
    blind = ThcInaSwitch(standin, tp.DeployOptions())
    unreported = blind.counters(blind.plan(config()))
    assert unreported["global"]["dlcp_selective_drop"] is None
    assert unreported["global"]["dlcp_ce_marked"] == 0
    # Ports this deployment did not bring up cannot be read: unknown, not 0.
    fresh = BfrtStandIn()
    ThcInaSwitch(fresh, tp.DeployOptions(drop_report_ports=(30,))).install(config())
    offline = ThcInaSwitch(fresh, tp.DeployOptions(drop_report_ports=(30,)))
    assert offline.counters(offline.plan(config()))["global"]["drop_oversize"] is None


# ---------------------------------------------------------------- the scripts as run
def test_setup_script_runs_as_bfshell_runs_it(tmp_path, monkeypatch):
    """bfshell -b executes the file with `bfrt` in its globals and no arguments."""
    job_file = deploy.write_job_file(tmp_path / "job.json", config(), OPTIONS, "install")
    monkeypatch.setenv("THC_INA_BFRT_JOB", str(job_file))
    standin = BfrtStandIn()
    source = Path(setup_switch.__file__).read_text()
    exec(compile(source, setup_switch.__file__, "exec"), {"bfrt": standin, "__name__": "bfrt"})
    status = json.loads(deploy.status_file(job_file).read_text())
    assert status["status"] == "ok" and len(table_writes(standin)) > 16000
    assert setup_switch.main(standin, str(job_file), out=lambda *_: None) == 0
    assert json.loads(deploy.status_file(job_file).read_text())["message"].startswith(
        "wrote 0 entries")


def test_setup_script_reports_a_refusal(tmp_path):
    bad = SwitchConfig(jobs=(job(1, 4, 9),))            # 9 x 30 overflows the lanes
    job_file = deploy.write_job_file(tmp_path / "job.json", bad, OPTIONS, "install")
    lines = []
    assert setup_switch.main(BfrtStandIn(), str(job_file), out=lines.append) == 2
    assert "overflows" in lines[-1]
    assert json.loads(deploy.status_file(job_file).read_text())["status"] == "error"


def test_deploy_refuses_plans_and_dry_runs_without_an_sde(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SDE", raising=False)
    good = config().save(tmp_path / "good.json")
    assert deploy.main(["--config", str(good), "--plan"]) == 0
    assert "  2048  pipe.SwitchIngress.validation.expected_bits_high" in capsys.readouterr().out
    assert deploy.main(["--config", str(good), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would add_with_member thc_ina.pipe.SwitchIngress.job_membership.members" in out
    bad = SwitchConfig(jobs=(job(1, 9000),)).save(tmp_path / "bad.json")
    assert deploy.main(["--config", str(bad), "--plan"]) == 2
    assert "pool_size 9000 must be in 1..8192" in capsys.readouterr().err
    job_file = tmp_path / "job.json"
    assert deploy.main(["--config", str(good), "--write-only", "--job-file", str(job_file),
                        "--port-map", "8=16,9=17"]) == 0
    assert "run_bfshell.sh -b" in capsys.readouterr().out
    spec = json.loads(job_file.read_text())
    assert spec["options"]["port_map"] == {"8": 16, "9": 17} and spec["mode"] == "install"
    assert deploy.main(["--config", str(good), "--job-file", str(job_file)]) == 2
    assert "no SDE" in capsys.readouterr().err


def test_the_bfshell_side_imports_only_the_standard_library_and_the_project():
    """The SDE's bfshell Python has no numpy or scapy: the planner, the controls and the
    modules they share with the other planes (dataplane.wire, dataplane.job_plan) import
    in a Python without site-packages (-S)."""
    probe = ("import sys\n"
             "import bfrt_scripts.bfrt_controls, bfrt_scripts.setup_switch\n"
             "ours = {m.split('.')[0] for m in sys.modules} - {'__main__'}\n"
             "print(sorted(ours - set(sys.stdlib_module_names) - set(sys.builtin_module_names)))\n"
             "print('dataplane.wire' in sys.modules and 'dataplane.job_plan' in sys.modules)")
    run = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True,
                         cwd=deploy.REPO_ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["['bfrt_scripts', 'dataplane']", "True"]


FAKE_BFSHELL = """#!{python}
# A stand-in for run_bfshell.sh -b: runs the script with a recording bfrt stand-in.
import os, sys
sys.path.insert(0, {root!r})
from tests.tofino.bfrt_standin import BfrtStandIn
assert sys.argv[1] == "-b"
bfrt = BfrtStandIn()
exec(compile(open(sys.argv[2]).read(), sys.argv[2], "exec"), {{"bfrt": bfrt}})
print("stand-in writes:", len(bfrt.log))
"""


def fake_sde(tmp_path):
    """An SDE folder whose run_bfshell.sh runs the script on the stand-in: (the job
    description, the job file to write, the environment that points at both)."""
    runner = tmp_path / "run_bfshell.sh"
    runner.write_text(FAKE_BFSHELL.format(python=sys.executable, root=str(deploy.REPO_ROOT)))
    runner.chmod(0o755)
    env = dict(os.environ, SDE=str(tmp_path), PYTHONPATH=str(deploy.REPO_ROOT))
    return config().save(tmp_path / "good.json"), tmp_path / "job.json", env


def test_deploy_runs_the_script_through_bfshell(tmp_path):
    good, job_file, env = fake_sde(tmp_path)
    run = subprocess.run([sys.executable, "-m", "bfrt_scripts.deploy", "--config", str(good),
                          "--job-file", str(job_file), "--counters"],
                         capture_output=True, text=True, cwd=deploy.REPO_ROOT, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    counters = json.loads(job_file.with_suffix(".counters.json").read_text())
    text = job_file.with_suffix(".counters.json").read_text().rstrip()
    assert run.stdout.rstrip().endswith(text)           # deploy prints them last
    assert counters["jobs"]["10"]["rx"] == 0 and "drop_fragment" in counters["global"]
    bad = SwitchConfig(jobs=(job(1, 4, 9),)).save(tmp_path / "bad.json")
    run = subprocess.run([sys.executable, "-m", "bfrt_scripts.deploy", "--config", str(bad),
                          "--job-file", str(job_file)],
                         capture_output=True, text=True, cwd=deploy.REPO_ROOT, env=env,
                         timeout=300)
    assert run.returncode == 2 and "overflows" in run.stderr


def test_writer_reports_a_refused_write():
    writer = BfrtWriter(BfrtStandIn(), "thc_ina")
    with pytest.raises(BfrtError, match="add_with_set_job on thc_ina.pipe.SwitchIngress."
                                        "job_membership.jobs .*does not fit 13 bits"):
        writer.put(tp.T_JOBS, {"job": 1}, {"job_index": 0, "counter_base": 0,
                                           "slot_base": 1 << 13, "pool_size": 1,
                                           "values_per_packet": 1, "member_count": 1,
                                           "group": 1}, "set_job", {})


# ---------------------------------------------------------------- batching
def test_program_writes_go_in_one_batch_without_a_read_each():
    standin = BfrtStandIn()
    plan = ThcInaSwitch(standin, OPTIONS).install(config())
    writes = table_writes(standin)
    assert len(writes) > 16000 and standin.batches == 1
    # one dump per program table, the TM's reads and writes: not one per entry
    program_tables = len({e.table for e in plan.entries}) + len(plan.defaults)
    tm_calls = 2 * 3 * len(plan.queues) + 2 * len(tp.used_ports(config(), OPTIONS))
    assert standin.round_trips < program_tables + tm_calls + 100 < len(writes) // 20
    # a second job on the same ports: ~8,500 more entries, only its 4 PRE writes more
    one, two = BfrtStandIn(), BfrtStandIn()
    ThcInaSwitch(one, OPTIONS).install(config(jobs=(job(),)))
    ThcInaSwitch(two, OPTIONS).install(config(jobs=(job(), job(11, 4, 3))))
    assert len(table_writes(two)) - len(table_writes(one)) > 8000
    assert two.round_trips - one.round_trips == 4


# ---------------------------------------------------------------- redeploy and teardown
def assert_switch_holds(standin, plan, program="thc_ina"):
    """Every program table holds exactly the plan's entries, the PRE exactly its nodes
    and groups."""
    planned = {}
    for e in plan.entries:
        planned.setdefault(e.table, {})[planned_key(e.key)] = e
    for path in tna_tables():
        table = standin.table(f"{program}.{path}")
        held = {shown_key(entry.raw()["key"]): entry for entry in table.entries.values()}
        assert set(held) == set(planned.get(path, {})), path
        for key, e in planned.get(path, {}).items():
            raw = held[key].raw()
            assert raw["action"].endswith(e.action)
            assert all(as_int(raw["data"][k]) == v for k, v in e.data)
    nodes = {k[0][1]: e.raw()["data"]["$DEV_PORT"] for k, e in standin.pre.node.entries.items()}
    assert nodes == {n.node_id: list(n.dev_ports) for n in plan.nodes}
    groups = {k[0][1]: e.raw()["data"]["$MULTICAST_NODE_ID"]
              for k, e in standin.pre.mgid.entries.items()}
    assert groups == {g.mgid: list(g.node_ids) for g in plan.groups}


def tna_tables():
    return [p for p, (t, _) in bfrt_tables(program()).items() if t.keys]


def dirty_job_state(standin, plan, job_id):
    """Slot state and counters as a running job leaves them."""
    layout = plan.layouts[job_id]
    slots, copies = tp.slot_cells(layout.slot_base, layout.pool_size)
    for path, fields in tp.SLOT_REGISTERS.items():
        for cell in slots:
            standin.registers[path].cells[cell] = {f: 1 for f in fields}
    for path, fields in tp.COPY_REGISTERS.items():
        for cell in copies:
            standin.registers[path].cells[cell] = {f: 7 for f in fields}
    for cell in range(layout.counter_base, layout.counter_base + job_plan.JOB_COUNTER_STRIDE):
        standin.counters[tp.C_JOB][cell] = 5


def dirty_cells(standin):
    return {(path, cell) for path, reg in standin.registers.items()
            for cell, values in reg.cells.items() if any(values.values())}


def test_deploy_redeploy_with_a_change_and_remove_leave_the_switch_as_planned():
    standin = BfrtStandIn()
    first = ThcInaSwitch(standin, OPTIONS).install(config())
    assert_switch_holds(standin, first)
    dirty_job_state(standin, first, 10)
    dirty_job_state(standin, first, 11)
    # job 10 goes, job 11 moves to slot 0 (a new layout), the route changes
    changed = config(jobs=(job(11, 4, 3, first_port=8),),
                     routes=(Route("10.8.0.0/16", 21, "02:00:00:00:09:03"),))
    second = ThcInaSwitch(standin, OPTIONS).install(changed)
    assert_switch_holds(standin, second)
    assert dirty_cells(standin) == set()            # both jobs' old slots were cleared
    assert all(v == 0 for v in standin.counters[tp.C_JOB].values())
    deletes = [w for w in standin.log if w[0] == "delete"]
    assert any(w[1] == "pre.mgid" for w in deletes) and any(w[1] == "pre.node" for w in deletes)
    # an unchanged job keeps its state on a redeploy
    dirty_job_state(standin, second, 11)
    ThcInaSwitch(standin, OPTIONS).install(changed)
    assert len(dirty_cells(standin)) == (len(tp.SLOT_REGISTERS) + 2 * len(tp.COPY_REGISTERS)) * 4
    teardown = ThcInaSwitch(standin, OPTIONS).remove()
    assert_switch_holds(standin, teardown)
    assert dirty_cells(standin) == set()
    assert standin.table(f"thc_ina.{tp.T_DROP_REPORTING}").get_default().raw()["data"] == \
        {"enabled": 0}
    assert standin.tf1.tm.pipe.cfg.get_default(pipe=0).raw()["data"] == {}     # reset
    again = ThcInaSwitch(standin, OPTIONS)
    again.remove()
    assert [c[0] for c in again.writer.changes] == ["reset_default"]   # nothing else left


# ---------------------------------------------------------------- drop reporting per pipe
def test_every_pipe_that_carries_traffic_needs_its_own_drop_report_port():
    on_two_pipes = config(jobs=(job(), job(11, 4, 3, first_port=8)))
    split = tp.DeployOptions(port_map=((8, 136), (9, 137), (10, 138)),
                             drop_report_ports=(30,))
    with pytest.raises(ConfigError, match="pipe 1 \\(dev_ports 136, 137, 138\\) has no "
                                          "drop-report port.*--drop-report-port"):
        tp.plan_switch(on_two_pipes, split)
    with pytest.raises(ConfigError, match="both on pipe 0"):
        tp.plan_switch(config(), tp.DeployOptions(drop_report_ports=(30, 31)))
    both = tp.DeployOptions(port_map=split.port_map, drop_report_ports=(30, 150))
    standin = BfrtStandIn()
    plan = ThcInaSwitch(standin, both).install(on_two_pipes)
    assert plan.drop_report_ports == {0: 30, 1: 150}
    for pipe, port in plan.drop_report_ports.items():
        report = standin.tf1.tm.port.cfg.get(dev_port=port).raw()["data"]
        cfg = standin.tf1.tm.pipe.cfg.get_default(pipe=pipe).raw()["data"]
        assert (cfg["mirror_drop_pg_id"], cfg["mirror_drop_pg_queue"]) == \
            (report["pg_id"], report["egress_qid_queues"][0])
    assert tp.DeployOptions.from_dict({"drop_report_port": 30}).drop_report_ports == (30,)


def test_tofino2_switches_mirror_drop_on():
    standin = BfrtStandIn(tofino=2)
    ThcInaSwitch(standin, tp.DeployOptions(tofino=2, drop_report_ports=(30,))).install(config())
    cfg = standin.tf2.tm.pipe.cfg.get_default(pipe=0).raw()["data"]
    assert cfg["mirror_drop_enable"] is True and "mirror_drop_pg_queue" in cfg
    with pytest.raises(StandInError, match="no data field mirror_drop_enable"):
        BfrtStandIn().tf1.tm.pipe.cfg.set_default(pipe=0, mirror_drop_enable=True)


def test_a_port_with_fewer_than_eight_queues_is_refused_by_its_queue_count():
    standin = BfrtStandIn(port_queues={2: 4})
    with pytest.raises(BfrtError, match="dev_port 2 has 4 queues; the DLCP stage needs 8"):
        ThcInaSwitch(standin, OPTIONS).install(config())


def test_the_sde_tables_offer_only_their_schemas_operations():
    standin = BfrtStandIn()
    tm = standin.tf1.tm
    for table, method in ((tm.pipe.cfg, "get"), (tm.pipe.cfg, "mod"), (tm.port.cfg, "mod"),
                          (tm.queue.sched_cfg, "get_default"), (tm.queue.sched_cfg, "add"),
                          (tm.queue.buffer, "mod"), (standin.pre.node, "clear"),
                          (standin.pre.node, "set_default"), (standin.port.port, "get_default")):
        with pytest.raises(AttributeError):
            getattr(table, method)
    with pytest.raises(StandInError, match="pass pipe="):
        tm.queue.color.mod(pg_id=0, pg_queue=0, drop_enable=True)
    with pytest.raises(StandInError, match="read-only"):
        tm.pipe.cfg.set_default(pipe=0, mirror_drop_dev_port=4)
    with pytest.raises(StandInError, match="mandatory"):
        standin.pre.node.add(MULTICAST_NODE_ID=1, MULTICAST_RID=0)


def test_the_planned_registers_are_the_programs_slot_registers():
    by_index = {}
    for path, reg in BfrtStandIn().registers.items():
        by_index.setdefault(reg.size, {})[path] = reg.fields
    assert by_index[2 * tp.SLOT_BUDGET] == tp.COPY_REGISTERS
    assert by_index[tp.SLOT_BUDGET] == tp.SLOT_REGISTERS


# ---------------------------------------------------------------- failures and remove, as run
def test_setup_script_reports_any_failure_in_one_line(tmp_path):
    job_file = deploy.write_job_file(tmp_path / "job.json", config(), OPTIONS, "install")
    lines = []
    assert setup_switch.main(object(), str(job_file), out=lines.append) == 2
    assert len(lines) == 1 and lines[0].startswith("error: AttributeError")
    assert json.loads(deploy.status_file(job_file).read_text())["status"] == "error"


def test_deploy_remove_runs_the_teardown_through_bfshell(tmp_path):
    good, job_file, env = fake_sde(tmp_path)
    run = subprocess.run([sys.executable, "-m", "bfrt_scripts.deploy", "--config", str(good),
                          "--job-file", str(job_file), "--remove",
                          "--drop-report-port", "30"],
                         capture_output=True, text=True, cwd=deploy.REPO_ROOT, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    spec = json.loads(job_file.read_text())
    assert spec["mode"] == "remove" and spec["options"]["drop_report_ports"] == [30]
    assert json.loads(deploy.status_file(job_file).read_text())["status"] == "ok"
