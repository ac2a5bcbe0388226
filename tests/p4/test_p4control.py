"""dataplane/bmv2/control.py without a switch: the entries computed from a SwitchConfig, the
refusals, the unreachable-switch error, and a lane-by-lane replay of the P4 data path
(lookup entries -> packed 64-bit words -> lane-wise add -> RESULT bytes) against the
reference aggregator."""
from __future__ import annotations


import numpy as np
import pytest

from dataplane import job_plan
from dataplane.config import ConfigError, Dlcp, Job, Member, Route, SwitchConfig
from dataplane.reference import GLOBAL_COUNTERS, JOB_COUNTERS, ReferenceSwitch
from dataplane.bmv2 import control as pc
from dataplane.ports import free_port
from host.packets import (AGG_PORT_BASE, HEADER_LEN, TYPE_RESULT, encode_data, parse_frame,
                          wrap_frames)

TABLE = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)


def members(n: int, first_port: int = 0) -> tuple[Member, ...]:
    return tuple(Member(w, first_port + (n - 1 - w), f"02:00:00:00:01:{w + 1:02x}",
                        f"10.0.0.{w + 1}", 40000 + w) for w in range(n))


VPP = 64                       # the BMv2 program's values per packet


def config(pools=(8,), n=4, routes=()) -> SwitchConfig:
    jobs = tuple(Job(10 + i, pool, TABLE, members(n), VPP) for i, pool in enumerate(pools))
    return SwitchConfig(jobs=jobs, routes=routes).validate()


def entries_of(plan, table):
    return [e for e in plan.entries if e.table == table]


def test_byte_tables_hold_both_lanes_of_every_byte():
    plan = pc.plan_switch(config())
    for position in range(pc.INDEX_BYTES):
        name, action = pc._lookup_table(position)
        rows = entries_of(plan, name)
        assert len(rows) == 256
        for e in rows:
            match, params = dict(e.match), dict(e.params)
            byte = int(match["index_byte.packed"])
            assert match["job"] == "10" and e.action == action
            assert int(params["high_value"]) == TABLE[byte >> 4]
            assert int(params["low_value"]) == TABLE[byte & 0x0F]
        assert sorted(int(dict(e.match)["index_byte.packed"]) for e in rows) == list(range(256))


def test_entry_keys_are_unique_and_plan_is_deterministic():
    cfg = config(pools=(8, 16), routes=(Route("10.1.0.0/16", 3, "02:00:00:00:09:01"),))
    a, b = pc.plan_switch(cfg), pc.plan_switch(cfg)
    keys = [e.key for e in a.entries]
    assert len(keys) == len(set(keys))          # an insert batch never collides with itself
    assert a.entries == b.entries and a.groups == b.groups


def test_multicast_groups_list_members_in_worker_order_with_rid():
    cfg = config(pools=(8, 4))
    plan = pc.plan_switch(cfg)
    assert [g.group_id for g in plan.groups] == [1, 2]
    for job, group in zip(cfg.jobs, plan.groups):
        by_worker = sorted(job.members, key=lambda m: m.worker)
        assert group.replicas == tuple((m.port, m.worker) for m in by_worker)
        assert plan.layouts[job.job].group_id == group.group_id


def test_job_layout_slots_are_disjoint_and_membership_complete():
    cfg = config(pools=(100, 7, 3000))
    plan = pc.plan_switch(cfg)
    layouts = sorted(plan.layouts.values(), key=lambda l: l.slot_base)
    for a, b in zip(layouts, layouts[1:]):
        assert a.slot_base + a.pool_size == b.slot_base
    jobs = {dict(e.match)["hdr.agg.job"]: dict(e.params) for e in entries_of(plan, pc.T_JOBS)}
    for job in cfg.jobs:
        lay = plan.layouts[job.job]
        assert jobs[str(job.job)] == {"job_index": str(lay.index), "slot_base": str(lay.slot_base),
                                      "pool_size": str(job.pool_size),
                                      "values_per_packet": str(VPP),
                                      "member_mask": str(job.member_mask),
                                      "member_count": str(job.member_count)}
    member_keys = {tuple(v for _, v in e.match) for e in entries_of(plan, pc.T_MEMBERS)}
    want = {(str(j.job), str(m.worker), str(m.port), m.mac, m.ip, str(m.udp_port))
            for j in cfg.jobs for m in j.members}
    assert member_keys == want


def test_the_switch_address_is_installed_for_the_fragment_rule():
    cfg = config()
    (e,) = entries_of(pc.plan_switch(cfg), pc.T_OWN_ADDRESS)
    assert dict(e.match) == {"hdr.ipv4.dst_addr": cfg.ip}
    assert e.action == "SwitchIngress.fragment_filter.switch_address"


def test_what_the_program_cannot_hold_is_refused_with_its_limit():
    with pytest.raises(ConfigError, match="the BMv2 program's limit of 64 values per packet; "
                                          "lower values_per_packet"):
        pc.plan_switch(SwitchConfig(jobs=(Job(1, 4, TABLE, members(2), 65),)))
    with pytest.raises(ConfigError, match="limit of 1023 packets .*; lower capacity"):
        pc.plan_switch(SwitchConfig(jobs=(Job(1, 4, TABLE, members(2), VPP),),
                                    dlcp=Dlcp(capacity=pc.BMV2_MAX_CAPACITY + 1)))
    pc.plan_switch(SwitchConfig(jobs=(Job(1, 4, TABLE, members(2), VPP),),
                                dlcp=Dlcp(capacity=pc.BMV2_MAX_CAPACITY)))
    far = Member(0, pc.BMV2_DLCP_PORTS, "02:00:00:00:00:01", "10.0.0.1", 41000)
    with pytest.raises(ConfigError, match="switch port 32: .* ports 0..31 .*renumber"):
        pc.plan_switch(SwitchConfig(jobs=(Job(1, 4, TABLE, (far,), VPP),)))


def test_egress_addressing_uses_switch_source_and_member_destination():
    cfg = config()
    plan = pc.plan_switch(cfg)
    rows = entries_of(plan, pc.T_MEMBER_ADDRESSES)
    assert len(rows) == 4
    for e in rows:
        worker = int(dict(e.match)["meta.dest_worker"])
        m = next(m for m in cfg.jobs[0].members if m.worker == worker)
        assert dict(e.params) == {"switch_mac": cfg.mac, "switch_ip": cfg.ip, "member_mac": m.mac,
                                  "member_ip": m.ip, "member_udp_port": str(m.udp_port)}


def test_dlcp_map_and_thresholds():
    cfg = SwitchConfig(jobs=config().jobs, dlcp=Dlcp(capacity=40)).validate()
    plan = pc.plan_switch(cfg)
    dscp = {int(dict(e.match)["hdr.ipv4.dscp"]): dict(e.params) for e in entries_of(plan, pc.T_DSCP)}
    for band in range(7):
        assert dscp[32 + band] == {"queue": str(6 - band), "is_data": "1"}
    assert dscp[48] == {"queue": "7", "is_data": "0"}
    limits = {int(dict(e.match)["meta.queue"]): dict(e.params)
              for e in entries_of(plan, pc.T_QUEUE_LIMITS)}
    for band in range(7):     # K[6-b] = T (1 + d b) with T = 8, d = 0.5
        assert int(limits[6 - band]["selective_threshold"]) == round(8 * (1 + 0.5 * band))
    assert all(int(v["queue_capacity"]) == 40 for v in limits.values())
    assert int(limits[6]["selective_threshold"]) < int(limits[0]["selective_threshold"])


def test_routes_become_lpm_entries():
    cfg = config(routes=(Route("192.168.1.0/24", 2, "02:00:00:00:09:02"),))
    plan = pc.plan_switch(cfg)
    (e,) = entries_of(plan, pc.T_ROUTES)
    assert dict(e.match) == {"hdr.ipv4.dst_addr": "192.168.1.0/24"}
    assert dict(e.params) == {"route_index": "0", "group_base": "0", "group_size": "1",
                              "switch_mac": cfg.mac}
    (hop,) = entries_of(plan, pc.T_NEXT_HOPS)
    assert dict(hop.match) == {"next_hop_index": "0"}
    assert dict(hop.params) == {"port": "2", "next_hop_mac": "02:00:00:00:09:02"}


def test_equal_cost_next_hops_become_consecutive_group_entries():
    spray = Route("10.2.0.0/16", 1, "02:00:00:00:02:01",
                  extra_hops=((2, "02:00:00:00:02:02"), (3, "02:00:00:00:02:03")))
    single = Route("10.3.0.0/16", 4, "02:00:00:00:03:01")
    plan = pc.plan_switch(config(routes=(spray, single)))
    routes = [dict(e.params) for e in entries_of(plan, pc.T_ROUTES)]
    assert [(r["route_index"], r["group_base"], r["group_size"]) for r in routes] == \
        [("0", "0", "3"), ("1", "3", "1")]
    hops = {int(dict(e.match)["next_hop_index"]): (int(dict(e.params)["port"]),
                                                    dict(e.params)["next_hop_mac"])
            for e in entries_of(plan, pc.T_NEXT_HOPS)}
    assert hops == {0: (1, "02:00:00:00:02:01"), 1: (2, "02:00:00:00:02:02"),
                    2: (3, "02:00:00:00:02:03"), 3: (4, "02:00:00:00:03:01")}


def test_too_many_next_hops_are_refused():
    hops = tuple((p, f"02:00:00:00:05:{p:02x}") for p in range(1, 9))
    with pytest.raises(ConfigError, match="at most 8"):
        pc.plan_switch(config(routes=(Route("10.5.0.0/16", 0, "02:00:00:00:05:00",
                                            extra_hops=hops),)))


@pytest.mark.parametrize("pools, words", [((4097,), "pool_size"), ((3000, 2000), "4096")])
def test_slot_budget_is_refused_with_what_to_change(pools, words):
    jobs = tuple(Job(i + 1, p, TABLE, members(2), VPP) for i, p in enumerate(pools))
    with pytest.raises(ConfigError, match=words):
        pc.plan_switch(SwitchConfig(jobs=jobs))


def test_too_many_jobs_and_overflowing_job_are_refused():
    jobs = tuple(Job(i, 1, TABLE, members(1), VPP) for i in range(pc.BMV2_MAX_JOBS + 1))
    with pytest.raises(ConfigError, match="at most 16"):
        pc.plan_switch(SwitchConfig(jobs=jobs))
    with pytest.raises(ConfigError, match="overflows"):   # 9 x 30 > 255
        pc.plan_switch(SwitchConfig(jobs=(Job(1, 4, TABLE, members(9), VPP),)))


def test_counter_names_match_the_protocol():
    assert set(pc.JOB_COUNTER_CELLS) == set(JOB_COUNTERS)
    assert set(job_plan.GLOBAL_COUNTER_CELLS) | set(job_plan.DLCP_COUNTER_CELLS) == \
        set(GLOBAL_COUNTERS)
    assert max(pc.JOB_COUNTER_CELLS.values()) < job_plan.JOB_COUNTER_STRIDE
    layouts = job_plan.job_layouts(config(pools=(8, 8)))
    stride = job_plan.JOB_COUNTER_STRIDE
    cells = {stride * 1 + 1: 5, stride * 0 + 9: 2}
    out = pc.counters_from_cells(layouts, cells, {6: 3}, {2: 4})
    assert out["jobs"][11]["aggregated"] == 5 and out["jobs"][10]["drop_duplicate"] == 2
    assert out["global"]["forwarded"] == 3 and out["global"]["dlcp_ce_marked"] == 4
    assert out["jobs"][10]["rx"] == 0


def test_unreachable_switch_is_a_clear_error():
    pytest.importorskip("p4runtime_sh", reason="p4runtime-shell not installed (make venv)")
    addr = f"127.0.0.1:{free_port()}"
    ctl = pc.P4Controller(addr, timeout=0.5)
    with pytest.raises(pc.SwitchUnreachable, match=addr.replace(".", r"\.")):
        ctl.connect()
    with pytest.raises(pc.P4ControlError, match="connect"):
        ctl.install(config())


def test_missing_pipeline_files_name_the_compile_command(tmp_path):
    ctl = pc.P4Controller(f"127.0.0.1:{free_port()}", timeout=0.5)
    with pytest.raises(FileNotFoundError, match="p4c --target bmv2"):
        ctl.connect(tmp_path / "main.p4info.txt", tmp_path / "main.json")


def test_cli_plan_needs_no_switch(tmp_path, capsys):
    path = config().save(tmp_path / "cfg.json")
    assert pc.main(["--config", str(path), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "256  SwitchIngress.lookup_31.byte_to_lanes" in out
    bad = SwitchConfig(jobs=(Job(1, 5000, TABLE, members(2), VPP),)).save(tmp_path / "bad.json")
    assert pc.main(["--config", str(bad), "--plan"]) == 2
    assert "pool_size" in capsys.readouterr().err


# ---- the P4 data path, replayed lane by lane from the installed entries ----
LOW7, HIGH1 = 0x7F7F7F7F7F7F7F7F, 0x8080808080808080


def lane_add(a: int, b: int) -> int:
    """aggregation.p4 LANE_ADD: per-lane (a + b) mod 256 inside a 64-bit word."""
    return (((a & LOW7) + (b & LOW7)) ^ ((a ^ b) & HIGH1)) & 0xFFFFFFFFFFFFFFFF


def p4_value_words(plan, job: int, payload: bytes, num_values: int) -> list[int]:
    """lookup.p4 + VALUE_WORD: byte k -> 16-bit pair from table k, 4 pairs per word."""
    pairs = []
    for k in range(pc.INDEX_BYTES):
        if k >= len(payload):
            pairs.append(0)
            continue
        name, _ = pc._lookup_table(k)
        e = next(e for e in entries_of(plan, name)
                 if dict(e.match) == {"job": str(job), "index_byte.packed": str(payload[k])})
        p = dict(e.params)
        pair = int(p["high_value"]) << 8 | int(p["low_value"])
        if 2 * k + 1 >= num_values:
            pair &= 0xFF00                      # padding nibble adds nothing
        pairs.append(pair)
    return [pairs[4 * j] << 48 | pairs[4 * j + 1] << 32 | pairs[4 * j + 2] << 16 | pairs[4 * j + 3]
            for j in range(8)]


def test_p4_lane_arithmetic_matches_the_reference():
    rng = np.random.default_rng(3)
    num_values = 61                              # odd: exercises the padding nibble
    cfg = config(n=4)
    job = cfg.jobs[0]
    plan = pc.plan_switch(cfg)
    ref = ReferenceSwitch(cfg, clock=lambda: 0.0)
    words = [0] * 8
    emitted = []
    for m in sorted(job.members, key=lambda m: m.worker):
        idx = rng.integers(0, 16, num_values + 1).astype(np.uint8)
        idx[-1] = 0
        packed = (idx[0::2] << 4) | idx[1::2]
        bufs, lens = encode_data(packed, num_values, 64, job=job.job, worker=m.worker, tensor=1,
                                 slots=0, rounds=0, expected=job.expected_all)
        payload = bufs[0, HEADER_LEN:lens[0]].tobytes()
        values = p4_value_words(plan, job.job, payload, num_values)
        words = [lane_add(w, v) for w, v in zip(words, values)]
        frame = wrap_frames(bufs, lens, src_mac=m.mac, dst_mac=cfg.mac, src_ip=m.ip, dst_ip=cfg.ip,
                            sport=m.udp_port, dport=AGG_PORT_BASE, tos=0)[0]
        emitted += ref.process(m.port, frame, now=0.0)
    p4_bytes = b"".join(w.to_bytes(8, "big") for w in words)[:num_values]
    results = [parse_frame(f) for _, f in emitted]
    assert len(results) == 4
    for r in results:
        assert r.header["ver_type"] & 0x0F == TYPE_RESULT
        assert bytes(r.payload) == p4_bytes


def test_lane_add_never_carries_between_lanes():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = (rng.integers(0, 256, 8, dtype=np.uint8) for _ in range(2))
        wa, wb = int.from_bytes(a.tobytes(), "big"), int.from_bytes(b.tobytes(), "big")
        got = np.frombuffer(lane_add(wa, wb).to_bytes(8, "big"), dtype=np.uint8)
        assert (got == (a + b)).all()            # uint8 wraps mod 256 per lane
