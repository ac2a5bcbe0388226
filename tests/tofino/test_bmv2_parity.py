"""One job description, two P4 control planes: dataplane.bmv2.control (BMv2) and
bfrt_scripts.tofino_plan (Tofino) must install the same job layout, membership, lookup
table contents, multicast members, member addresses, DLCP map and routes.

The comparison runs on the fields both plans have (BMv2's member key next to the Tofino
program's)."""
from __future__ import annotations

import ipaddress

import pytest

from bfrt_scripts import tofino_plan as tp
from dataplane import job_plan
from dataplane.config import Job, Member, Route, SwitchConfig
from dataplane.bmv2 import control as pc

TABLE = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)
# BMv2 P4Info match-field names -> the Tofino program's bfrt key names
MEMBER_FIELDS = {"hdr.agg.job": "job", "hdr.agg.worker": "worker",
                 "standard_metadata.ingress_port": "port", "hdr.ethernet.src_addr": "mac",
                 "hdr.ipv4.src_addr": "ip", "hdr.udp.src_port": "udp_port"}


def as_int(field: str, text: str) -> int:
    if field == "mac" or text.count(":") == 5:
        return int(text.replace(":", ""), 16)
    if field == "ip" or text.count(".") == 3:
        return int(ipaddress.IPv4Address(text))
    return int(text)


def job(job_id, pool, n, first_port) -> Job:
    members = tuple(Member(w, first_port + (n - 1 - w), f"02:00:00:00:{job_id:02x}:{w + 1:02x}",
                           f"10.{job_id}.0.{w + 1}", 40000 + w) for w in range(n))
    return Job(job_id, pool, TABLE, members, 64)


@pytest.fixture(scope="module")
def plans():
    cfg = SwitchConfig(jobs=(job(12, 100, 4, 0), job(3, 7, 3, 8), job(40, 30, 2, 20)),
                       routes=(Route("10.9.0.0/16", 1, "02:00:00:00:09:01",
                                     extra_hops=((2, "02:00:00:00:09:02"),)),
                               Route("192.168.0.0/24", 5, "02:00:00:00:09:05"))).validate()
    return cfg, pc.plan_switch(cfg), tp.plan_switch(cfg)


def bmv2_rows(plan, table):
    return [(dict(e.match), dict(e.params)) for e in plan.entries if e.table == table]


def tofino_rows(plan, table):
    return [(e.key_dict, e.data_dict) for e in plan.entries if e.table == table]


def test_job_layout_is_the_same(plans):
    cfg, bmv2, tofino = plans
    assert {j: (lay.index, lay.slot_base, lay.pool_size) for j, lay in bmv2.layouts.items()} == \
        {j: (lay.index, lay.slot_base, lay.pool_size) for j, lay in tofino.layouts.items()}
    bjobs = {int(m["hdr.agg.job"]): p for m, p in bmv2_rows(bmv2, pc.T_JOBS)}
    tjobs = {k["job"]: d for k, d in tofino_rows(tofino, tp.T_JOBS)}
    tstrays = {k["job"]: k["expected"] for k, _ in tofino_rows(tofino, tp.T_EXPECTED_IN_JOB)}
    assert set(bjobs) == set(tjobs) == {j.job for j in cfg.jobs}
    for j, params in bjobs.items():
        assert int(params["slot_base"]) == tjobs[j]["slot_base"]
        assert int(params["pool_size"]) == tjobs[j]["pool_size"]
        assert int(params["job_index"]) * job_plan.JOB_COUNTER_STRIDE == tjobs[j]["counter_base"]
        assert int(params["values_per_packet"]) == tjobs[j]["values_per_packet"]
        assert tstrays[j] == tp.Ternary(0, ~int(params["member_mask"]) & 0xFFFFFFFF)
        assert int(params["member_count"]) == tjobs[j]["member_count"]


def test_membership_is_the_same_on_the_fields_both_key(plans):
    _, bmv2, tofino = plans
    brows = [m for m, _ in bmv2_rows(bmv2, pc.T_MEMBERS)]
    common = [MEMBER_FIELDS[f] for f in brows[0]]
    assert {"job", "worker", "port"} <= set(common)
    want = {tuple(as_int(MEMBER_FIELDS[f], v) for f, v in m.items()) for m in brows}
    got = {tuple(k[f] for f in common) for k, _ in tofino_rows(tofino, tp.T_MEMBERS)}
    assert got == want and len(got) == 9


def test_lookup_tables_hold_the_same_values(plans):
    _, bmv2, tofino = plans
    assert pc.INDEX_BYTES == tp.INDEX_BYTES
    for position in range(tp.INDEX_BYTES):
        name, _ = pc._lookup_table(position)
        want = {(int(m["job"]), int(m["index_byte.packed"])):
                (int(p["high_value"]), int(p["low_value"])) for m, p in bmv2_rows(bmv2, name)}
        job_of = {d["job_index"]: k["job"] for k, d in tofino_rows(tofino, tp.T_JOBS)}
        got = {(job_of[k["job_index"]], k["packed"]): (d["high_value"], d["low_value"])
               for k, d in tofino_rows(tofino, tp.lookup_table(position))}
        assert got == want and len(got) == 3 * 256


def test_multicast_members_are_the_same(plans):
    _, bmv2, tofino = plans
    nodes = {n.node_id: n for n in tofino.nodes}
    want = {g.group_id: list(g.replicas) for g in bmv2.groups}
    got = {g.mgid: [(port, nodes[i].rid) for i in g.node_ids for port in nodes[i].dev_ports]
           for g in tofino.groups}
    assert got == want
    assert all(len(n.dev_ports) == 1 for n in tofino.nodes)


def test_member_addresses_are_the_same(plans):
    _, bmv2, tofino = plans
    want = {(int(m["hdr.agg.job"]), int(m["meta.dest_worker"])):
            {k: as_int(k, v) for k, v in p.items()}
            for m, p in bmv2_rows(bmv2, pc.T_MEMBER_ADDRESSES)}
    got = {(k["job"], k["worker"]): d for k, d in tofino_rows(tofino, tp.T_MEMBER_ADDRESSES)}
    assert got == want


def test_dlcp_map_thresholds_and_routes_are_the_same(plans):
    _, bmv2, tofino = plans
    want = {int(m["hdr.ipv4.dscp"]): (int(p["queue"]), int(p["is_data"]))
            for m, p in bmv2_rows(bmv2, pc.T_DSCP)}
    got = {k["dscp"]: (d["queue"], d["is_data"]) for k, d in tofino_rows(tofino, tp.T_DSCP)}
    assert got == want
    limits = {int(m["meta.queue"]): int(p["selective_threshold"])
              for m, p in bmv2_rows(bmv2, pc.T_QUEUE_LIMITS)}
    marks = {k["queue"]: d["mark_cells"] // tofino.cells_per_packet
             for k, d in tofino_rows(tofino, tp.T_QUEUE_THRESHOLDS)}
    assert marks == limits
    broutes = [(m["hdr.ipv4.dst_addr"], p) for m, p in bmv2_rows(bmv2, pc.T_ROUTES)]
    troutes = tofino_rows(tofino, tp.T_ROUTES)
    assert len(broutes) == len(troutes)
    for (prefix, p), (k, d) in zip(broutes, troutes):
        net = ipaddress.IPv4Network(prefix)
        assert (k["dst_addr"].value, k["dst_addr"].prefix_length) == \
            (int(net.network_address), net.prefixlen)
        assert (int(p["route_index"]), int(p["group_base"]), int(p["group_size"]) - 1) == \
            (d["route_index"], d["next_hop_base"], d["next_hop_last"])
    bhops = {int(m["next_hop_index"]): (int(p["port"]), as_int("mac", p["next_hop_mac"]))
             for m, p in bmv2_rows(bmv2, pc.T_NEXT_HOPS)}
    thops = {k["next_hop_index"]: (d["port"], d["next_hop_mac"])
             for k, d in tofino_rows(tofino, tp.T_NEXT_HOPS)}
    assert thops == bhops
