"""The Tofino split of a slot's state, replayed against the reference aggregator.

p4src/tna/aggregation.p4 cannot keep a copy's state the way the reference does (one
record read and written at once): Tofino allows one stateful-ALU pass per register, two
comparisons and one 32-bit result, so the state is spread over registers in consecutive
stages (occupancy, round, seen, left, contributors, result fields, sums) and "done" is
"left == 0". `TnaSlotModel` below is a line-by-line Python transcription of those
registers and RegisterActions (a MODEL of the program, not the program: no compiler or
switch runs here). Random traffic (retransmissions, stragglers, late workers under
min_count, FLUSH, odd counts with nonzero padding nibbles, round wrap-around when the
reference speaks protocol v2) goes through both; every emitted AGG packet and every
per-job counter must agree byte for byte."""
from __future__ import annotations

import numpy as np
import pytest

from bfrt_scripts import tofino_plan as tp
from dataplane import job_plan
from dataplane import reference as ref
from dataplane.config import Job, Member, SwitchConfig
from dataplane.wire import (FLAG_LATE, FLAG_RESERVE, HEADER_STRUCT as HEADER, TYPE_DATA,
                            TYPE_FLUSH, TYPE_RESULT, TYPE_STRAGGLER)

from . import tna_source as ts

NAMES = ts.constants(ts.preprocess())

M32 = 0xFFFFFFFF
TABLE = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)


def decide(control: str, table: str, answers: dict[str, int]) -> tuple[str, str]:
    """What a decision table of aggregation.p4 does for these answers: its first matching
    constant entry (parsed from the source), or the default action."""
    t = ts.program()[control].tables[table]
    return ts.first_match(t, answers, NAMES) or (t.default[0], "")


def popcount(x: int) -> int:
    return bin(x).count("1")


def job_with(job_id, pool, members, vpp=tp.TOFINO_MAX_VALUES) -> Job:
    return Job(job_id, pool, TABLE, members, vpp)


class TnaSlotModel:
    """SlotState, ResultFields, SumWord (x16), BuildAggReply and ResultShape of
    aggregation.p4 for one job, registers as dicts (0 at start, as after loading)."""

    def __init__(self, job: Job, layout: job_plan.JobLayout, plan: tp.TofinoPlan):
        self.job, self.layout = job, layout
        self.reg: dict[str, dict] = {name: {} for name in (
            "occupancy", "copy_round", "copy_seen", "copy_left", "copy_contributors",
            "result_expected", "result_tensor", "result_offset", "result_num_values",
            "result_min_count", *(f"sums_{k}" for k in range(tp.SUM_WORDS)))}
        # lookup.p4: the installed byte tables of this job, position by position
        self.lanes = {}
        for e in plan.entries:
            if e.table.endswith("byte_to_lanes") and e.key_dict["job_index"] == layout.index:
                position = int(e.table.split(".")[-2].split("_")[1])
                d = e.data_dict
                self.lanes[position, e.key_dict["packed"]] = d["high_value"] << 8 | d["low_value"]
        self.cells = dict.fromkeys(tp.JOB_CELLS, 0)

    def get(self, reg, index):
        return self.reg[reg].get(index, 0)

    def values(self, payload: bytes, num_values: int) -> list[int]:
        """ByteLookup x 32 and the lanes.p(2k) ++ lanes.p(2k+1) operands of SumWord k."""
        pairs = []
        for k in range(tp.INDEX_BYTES):
            pair = self.lanes[k, payload[k]] if k < len(payload) else 0
            if num_values == 2 * k + 1:
                pair &= 0xFF00                          # lanes[7:0] = 0
            pairs.append(pair)
        return [pairs[2 * k] << 16 | pairs[2 * k + 1] for k in range(tp.SUM_WORDS)]

    def packet(self, h: list, payload: bytes) -> list[bytes]:
        (ver_type, flags, job, slot, worker, min_count, round_, expected, contributors_in,
         tensor, offset, num_values, count, reserved) = h
        ptype = ver_type & 0xF
        wbit = 1 << worker
        slot_index = self.layout.slot_base + slot
        if ptype == TYPE_FLUSH:                         # empty_copies
            self.reg["occupancy"][slot_index] = (0, 0)
            self.cells["flush"] += 1
            return []
        parity = round_ & 1
        copy = parity << 13 | slot_index
        expected_size = popcount(expected)
        source = decide("SlotState", "round_target",           # round_target
                         {"expected_size": expected_size, "min_count": min_count})[0]
        target = {"target_from_min_count": min_count, "target_from_expected": expected_size}[source]
        target_left = (target - 1) & 0xFF
        occ = list(self.reg["occupancy"].get(slot_index, (0, 0)))   # occupy_copy<parity>
        was_occupied, occ[parity] = occ[parity], 1
        self.reg["occupancy"][slot_index] = tuple(occ)
        stored = self.get("copy_round", copy)                        # advance_round
        distance = (round_ - stored) & M32
        signed = distance - (1 << 32) if distance >> 31 else distance
        if was_occupied == 0 or signed > 0:
            self.reg["copy_round"][copy] = round_
        fresh = same = False
        already_seen = left_before = 0
        copy_round = 0
        if was_occupied == 0 or (distance != 0 and distance >> 31 == 0):
            fresh = True
            self.reg["copy_seen"][copy] = wbit                       # start_seen
        elif distance == 0:
            same = True
            seen = self.get("copy_seen", copy)                       # join_seen
            already_seen = seen & wbit
            self.reg["copy_seen"][copy] = seen | wbit
        else:                                                        # an older round
            copy_round = (round_ - distance) & M32
        if fresh:
            self.reg["copy_left"][copy] = target_left                # start_left
        elif same:
            left = self.get("copy_left", copy)                       # join_left / read_left
            left_before = left
            if already_seen == 0 and left != 0:
                self.reg["copy_left"][copy] = left - 1
        # the decision tables, row by row from the source (DECISION_KEY)
        answers = {"fresh": int(fresh), "same_round": int(same), "already_seen": already_seen,
                   "left_before": left_before, "target_left": target_left}
        outcome = decide("SlotState", "packet_outcome", answers)
        outcome = {"OUTCOME_COMPLETE": "complete", "OUTCOME_PENDING": "pending",
                   "OUTCOME_RESERVE": "reserve", "OUTCOME_DUPLICATE": "duplicate",
                   "OUTCOME_STRAGGLER": "straggler"}[outcome[1]]
        # ResultFields: contributors
        bitmap_reg = self.reg["copy_contributors"]
        contributors = contributors_in                              # leave_fields
        bitmap_action = decide("ResultFields", "contributor_bitmap", answers)
        if bitmap_action[0] == "start_bitmap":
            bitmap_reg[copy] = contributors = wbit
        elif bitmap_action[0] == "join_bitmap":
            bitmap_reg[copy] = contributors = self.get("copy_contributors", copy) | wbit
        elif bitmap_action[0] == "read_bitmap":
            contributors = self.get("copy_contributors", copy)
        fields = {"expected": expected, "tensor": tensor, "offset": offset,
                  "num_values": num_values, "min_count": min_count}
        for name in fields:
            action = decide("ResultFields", f"keep_{name}", answers)[0]
            if action == f"store_{name}_field":
                self.reg[f"result_{name}"][copy] = fields[name]
            elif action == f"load_{name}_field":
                fields[name] = self.get(f"result_{name}", copy)
        # SumWord x 16
        values = self.values(payload, num_values)
        sums = [0] * tp.SUM_WORDS
        sum_action = decide("SumWord", "sum_word", answers)[0]
        for k in range(tp.SUM_WORDS):
            cells = self.reg[f"sums_{k}"]
            if sum_action == "start_sum":
                cells[copy] = values[k]
            elif sum_action == "add_sum":
                cells[copy] = (self.get(f"sums_{k}", copy) + values[k]) & M32
            sums[k] = self.get(f"sums_{k}", copy)
        cell = {"pending": "pending", "complete": "complete", "duplicate": "duplicate",
                "reserve": "reserved", "straggler": "straggler"}[outcome]
        self.cells[cell] += 1
        if outcome in ("pending", "duplicate"):
            return []
        # BuildAggReply (ingress) + MemberAddressing / ResultShape (egress, per copy)
        count = popcount(contributors)
        payload_out = b"".join(w.to_bytes(4, "big") for w in sums)
        if outcome == "straggler":
            return [HEADER.pack(ver_type & 0xF0 | TYPE_STRAGGLER, flags, job, slot, worker,
                                min_count, copy_round, expected, contributors, tensor,
                                offset, 0, count, reserved)]
        nv = fields["num_values"]
        body = payload_out[:nv]
        if outcome == "complete":
            return [HEADER.pack(ver_type & 0xF0 | TYPE_RESULT, 0, job, slot, m.worker,
                                min_count, round_, expected, contributors, tensor, offset,
                                nv, count, 0) + body
                    for m in sorted(self.job.members, key=lambda m: m.worker)]
        late = FLAG_LATE if contributors & wbit == 0 else 0
        return [HEADER.pack(ver_type & 0xF0 | TYPE_RESULT, FLAG_RESERVE | late, job, slot, worker,
                            fields["min_count"], round_, fields["expected"], contributors,
                            fields["tensor"], fields["offset"], nv, count, 0) + body]


def traffic(rng, job: Job, pool: int, start_round: int, packets: int):
    """Valid DATA and FLUSH of members: every contribution to a round agrees on expected,
    min_count, tensor, offset and num_values (the hosts' promise, protocol 4.3)."""
    workers = sorted(m.worker for m in job.members)
    base = [start_round] * pool
    params = {}
    for _ in range(packets):
        slot = int(rng.integers(pool))
        if rng.random() < 0.03:
            yield slot, int(rng.choice(workers)), None, None
            continue
        if rng.random() < 0.2:
            base[slot] = (base[slot] + 1) & M32
        round_ = (base[slot] + int(rng.integers(-2, 2))) & M32
        if (slot, round_) not in params:
            mode = rng.integers(3)
            subset = [w for w in workers if rng.random() < 0.7] or [workers[0]]
            expected = sum(1 << w for w in subset)
            if mode == 0:
                min_count = 0
            elif mode == 1:
                expected, min_count = 0, int(rng.integers(1, len(workers) + 1))
            else:
                min_count = int(rng.integers(1, len(subset) + 1))
            params[slot, round_] = (expected, min_count, int(rng.integers(1 << 32)),
                                    int(rng.integers(1 << 20)), int(rng.integers(1, 65)))
        expected, min_count, tensor, offset, nv = params[slot, round_]
        senders = [w for w in workers if expected >> w & 1] or workers
        yield slot, int(rng.choice(senders)), round_, (expected, min_count, tensor, offset, nv)


@pytest.mark.parametrize("start_round", [3, (1 << 32) - 3])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tofino_state_split_decides_like_the_reference(seed, start_round):
    if start_round > 1 << 31 and ref.PROTOCOL_VERSION < 2:
        pytest.skip("round wrap-around is protocol v2 (rule R1); this reference is v"
                    f"{ref.PROTOCOL_VERSION}")
    rng = np.random.default_rng(seed)
    members = tuple(Member(w, 10 + w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.0.{w + 1}",
                           40000 + w) for w in range(5))
    job = job_with(7, 3, members)
    cfg = SwitchConfig(jobs=(job,)).validate()
    plan = tp.plan_switch(cfg)
    model = TnaSlotModel(job, plan.layouts[7], plan)
    switch = ref.ReferenceSwitch(cfg)
    by_worker = {m.worker: m for m in members}
    outputs = 0
    for slot, worker, round_, p in traffic(rng, job, 3, start_round, 1500):
        if round_ is None:
            h = [ref.PROTOCOL_VERSION << 4 | TYPE_FLUSH, 0, 7, slot, worker, 0, 0, 0, 0, 0, 0,
                 0, 0, 0]
            payload = b""
        else:
            expected, min_count, tensor, offset, nv = p
            idx = rng.integers(0, 16, 2 * ((nv + 1) // 2)).astype(np.uint8)
            payload = bytes((idx[0::2] << 4) | idx[1::2])    # odd nv: random padding nibble
            h = [ref.PROTOCOL_VERSION << 4 | TYPE_DATA, int(rng.integers(2)), 7, slot, worker,
                 min_count, round_, expected, 0, tensor, offset, nv, 0, int(rng.integers(256))]
        data = HEADER.pack(*h) + payload
        want = [r.agg for r in switch.handle_agg(by_worker[worker].port, data, len(data),
                                                 True, 0)]
        got = model.packet(h, payload)
        assert got == want, (h, [HEADER.unpack_from(x) for x in want],
                             [HEADER.unpack_from(x) for x in got])
        outputs += len(want)
    assert outputs > 200                        # the traffic did reach every outcome
    named = tp.counters_from_cells(plan.layouts, {model.layout.counter_base + c: n for c, n in
                                                  ((tp.JOB_CELLS[k], v)
                                                   for k, v in model.cells.items())}, {}, {})
    reference = switch.counters()["jobs"][7]
    assert {k: named["jobs"][7][k] for k in reference} == reference
    assert all(named["jobs"][7][k] > 0 for k in ("results_multicast", "results_reserved",
                                                 "straggler_notices", "drop_duplicate",
                                                 "flushes"))
