/* THC-INA in-network aggregation for Tofino (TNA), protocol version 2 (docs/protocol.md).
 * The role of p4src/v1model/main.p4; named thc_ina so the SDE calls the program thc_ina
 * (bfrt.thc_ina...). Limits and the resource budget: p4src/tna/README.md.
 *
 * Build (Tofino 1):  p4c --target tofino --arch tna -o build/tna p4src/tna/thc_ina.p4
 *                    (or the SDE's bf-p4c --target tofino --arch tna ...)
 * Build (Tofino 2):  p4c --target tofino2 --arch t2na -Xp4c="--no-clot --disable-dark-allocation"
 *                    (same source; the options work around the open-source back end)
 * Install:           python -m bfrt_scripts.deploy --config job.json  (bfrt_scripts/) */
#include <core.p4>
#if __TARGET_TOFINO__ == 2
#include <t2na.p4>
#else
#include <tna.p4>
#endif

#include "headers.p4"
#include "counters.p4"
#include "parser.p4"
#include "lookup.p4"
#include "validation.p4"
#include "aggregation.p4"
#include "dlcp.p4"
#include "forwarding.p4"
#include "checksums.p4"

#define LOOKUP(k) lookup_##k.apply(hdr.idx[k], meta.job_index, meta.lanes.p##k);
#define SUM_WORD(k, a, b) \
    sums_##k.apply(meta, meta.lanes.p##a ++ meta.lanes.p##b, hdr.sums[k].lanes);

@pa_auto_init_metadata
control SwitchIngress(inout headers_t hdr,
                      inout ingress_metadata_t meta,
                      in ingress_intrinsic_metadata_t ig_intr_md,
                      in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                      inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                      inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* per job (counter_base + JC_*) and global (GC_*) counters: one count per packet */
    Counter<bit<32>, bit<16>>(MAX_JOBS * JOB_COUNTER_STRIDE, CounterType_t.PACKETS) job_counters;
    Counter<bit<32>, bit<8>>(GLOBAL_COUNTER_CELLS, CounterType_t.PACKETS) global_counters;

    DlcpClassify() dlcp_classify;
    SwitchAddress() switch_address;
    Ipv4Forwarding() ipv4_forwarding;
    JobMembership() job_membership;
    AggValidation() validation;
    SlotState() slot_state;
    ResultFields() result_fields;
    BuildAggReply() build_reply;
    ByteLookup()   lookup_0;  ByteLookup()   lookup_1;  ByteLookup()   lookup_2;
    ByteLookup()   lookup_3;  ByteLookup()   lookup_4;  ByteLookup()   lookup_5;
    ByteLookup()   lookup_6;  ByteLookup()   lookup_7;  ByteLookup()   lookup_8;
    ByteLookup()   lookup_9;  ByteLookup()   lookup_10; ByteLookup()   lookup_11;
    ByteLookup()   lookup_12; ByteLookup()   lookup_13; ByteLookup()   lookup_14;
    ByteLookup()   lookup_15; ByteLookup()   lookup_16; ByteLookup()   lookup_17;
    ByteLookup()   lookup_18; ByteLookup()   lookup_19; ByteLookup()   lookup_20;
    ByteLookup()   lookup_21; ByteLookup()   lookup_22; ByteLookup()   lookup_23;
    ByteLookup()   lookup_24; ByteLookup()   lookup_25; ByteLookup()   lookup_26;
    ByteLookup()   lookup_27; ByteLookup()   lookup_28; ByteLookup()   lookup_29;
    ByteLookup()   lookup_30; ByteLookup()   lookup_31;
    SumWord() sums_0;  SumWord() sums_1;  SumWord() sums_2;  SumWord() sums_3;
    SumWord() sums_4;  SumWord() sums_5;  SumWord() sums_6;  SumWord() sums_7;
    SumWord() sums_8;  SumWord() sums_9;  SumWord() sums_10; SumWord() sums_11;
    SumWord() sums_12; SumWord() sums_13; SumWord() sums_14; SumWord() sums_15;

    action drop_global(bit<8> cell) {
        meta.global_cell = cell;
        ig_dprsr_md.drop_ctl = 1;
    }

    action count_global(bit<8> cell) {
        meta.global_cell = cell;
    }

    /* The counter index is computed where the cell is chosen: Tofino's counter
     * addresses a plain field, not the sum. */
    action drop_job(bit<16> cell) {
        meta.count_job = 1;
        meta.job_counter_index = meta.counter_base + cell;
        ig_dprsr_md.drop_ctl = 1;
    }

    action count_job(bit<16> cell) {
        meta.count_job = 1;
        meta.job_counter_index = meta.counter_base + cell;
    }

    /* Accepting a packet is also its first slot-state step: the occupancy of the slot's
     * copies (aggregation.p4) is read and set here, in the stage that accepts, so the
     * round register follows in the next one. One action per thing done to it. */
    Register<occupancy_t, slot_index_t>(SLOT_BUDGET) occupancy;

    RegisterAction<occupancy_t, slot_index_t, bit<8>>(occupancy) occupy_copy0 = {
        void apply(inout occupancy_t cell, out bit<8> was_occupied) {
            was_occupied = cell.copy0;
            cell.copy0 = 1;
        }
    };

    RegisterAction<occupancy_t, slot_index_t, bit<8>>(occupancy) occupy_copy1 = {
        void apply(inout occupancy_t cell, out bit<8> was_occupied) {
            was_occupied = cell.copy1;
            cell.copy1 = 1;
        }
    };

    RegisterAction<occupancy_t, slot_index_t, bit<8>>(occupancy) empty_copies = {
        void apply(inout occupancy_t cell) {
            cell.copy0 = 0;
            cell.copy1 = 0;
        }
    };

    action accept_copy0() {
        meta.accepted = 1;
        meta.was_occupied = occupy_copy0.execute(meta.slot_index);
    }

    action accept_copy1() {
        meta.accepted = 1;
        meta.was_occupied = occupy_copy1.execute(meta.slot_index);
    }

    action accept_flush() {
        meta.accepted = 1;
        empty_copies.execute(meta.slot_index);          /* protocol.md 4.6 */
    }

    /* protocol.md 4.1, in order: the first failing check decides. A ternary table is
     * first-match in entry order, so each row only states how its own check fails; the
     * rows above it have taken every packet that failed an earlier one. No row matches
     * an invalid AGG header (a frame too short for it): the default. */
    table agg_checks {
        key = {
            meta.header_check       : ternary @name("header_check");
            meta.length_ok          : ternary @name("length_ok");
            meta.job_known          : ternary @name("job_known");
            meta.values_gap[15:15]  : ternary @name("values_over");
            hdr.agg.slot[15:13]     : ternary @name("slot_high");
            meta.slot_gap[15:15]    : ternary @name("slot_in_pool");
            meta.is_member          : ternary @name("is_member");
            hdr.agg.expected        : ternary @name("expected");
            hdr.agg.min_count       : ternary @name("min_count");
            meta.in_expected        : ternary @name("in_expected");
            meta.expected_strays    : ternary @name("expected_strays");
            meta.too_few_expected   : ternary @name("too_few_expected");
            meta.members_gap[7:7]   : ternary @name("members_short");
            hdr.agg.round[0:0]      : ternary @name("parity");
            hdr.agg.isValid()       : ternary @name("agg_valid");
        }
        actions = { drop_global; drop_job; accept_copy0; accept_copy1; accept_flush; }
        const default_action = drop_global(GC_DROP_TRUNCATED);
        size = 40;
        const entries = {
            /* hdr len job over high pool mem expected min in stray few short par valid */
            (HEADER_BAD_VERSION, _, _, _, _, _, _, _, _, _, _, _, _, _, true) :
                drop_global(GC_DROP_BAD_VERSION);
            (HEADER_BAD_TYPE, _, _, _, _, _, _, _, _, _, _, _, _, _, true) :
                drop_global(GC_DROP_BAD_TYPE);
            (_, 0, _, _, _, _, _, _, _, _, _, _, _, _, true) : drop_global(GC_DROP_BAD_LENGTH);
            (_, _, 0, _, _, _, _, _, _, _, _, _, _, _, true) : drop_global(GC_DROP_UNKNOWN_JOB);
            /* rule R7: a DATA over the job's values_per_packet (1..64 by now: 16 bits) */
            (HEADER_DATA, _, _, 1, _, _, _, _, _, _, _, _, _, _, true) :
                drop_global(GC_DROP_BAD_LENGTH);
            /* slot >= pool_size: 8192 and up never exist, below that the 16-bit gap */
            (_, _, _, _, 4 &&& 4, _, _, _, _, _, _, _, _, _, true) : drop_job(JC_DROP_BAD_SLOT);
            (_, _, _, _, 2 &&& 2, _, _, _, _, _, _, _, _, _, true) : drop_job(JC_DROP_BAD_SLOT);
            (_, _, _, _, 1 &&& 1, _, _, _, _, _, _, _, _, _, true) : drop_job(JC_DROP_BAD_SLOT);
            (_, _, _, _, _, 0, _, _, _, _, _, _, _, _, true) : drop_job(JC_DROP_BAD_SLOT);
            (_, _, _, _, _, _, 0, _, _, _, _, _, _, _, true) : drop_job(JC_DROP_NOT_MEMBER);
            (HEADER_FLUSH, _, _, _, _, _, _, _, _, _, _, _, _, _, true) : accept_flush();
            /* a DATA from here on. Without an expected set: k of n, 0 < k <= members
             * (k >= 64 first: the 8-bit members gap holds k < 64) */
            (_, _, _, _, _, _, _, 0, 0, _, _, _, _, _, true) : drop_job(JC_DROP_BAD_EXPECTED);
            (_, _, _, _, _, _, _, 0, 0x40 &&& 0x40, _, _, _, _, _, true) :
                drop_job(JC_DROP_UNSATISFIABLE);
            (_, _, _, _, _, _, _, 0, 0x80 &&& 0x80, _, _, _, _, _, true) :
                drop_job(JC_DROP_UNSATISFIABLE);
            (_, _, _, _, _, _, _, 0, _, _, _, _, 1, _, true) : drop_job(JC_DROP_UNSATISFIABLE);
            (_, _, _, _, _, _, _, 0, _, _, _, _, _, 0, true) : accept_copy0();
            (_, _, _, _, _, _, _, 0, _, _, _, _, _, 1, true) : accept_copy1();
            /* with one: it names the sender, members only, and min_count fits it */
            (_, _, _, _, _, _, _, _, _, 0, _, _, _, _, true) : drop_job(JC_DROP_BAD_EXPECTED);
            (_, _, _, _, _, _, _, _, _, _, 1, _, _, _, true) : drop_job(JC_DROP_UNSATISFIABLE);
            (_, _, _, _, _, _, _, _, 0, _, _, _, _, 0, true) : accept_copy0();
            (_, _, _, _, _, _, _, _, 0, _, _, _, _, 1, true) : accept_copy1();
            (_, _, _, _, _, _, _, _, _, _, _, 1, _, _, true) : drop_job(JC_DROP_UNSATISFIABLE);
            (_, _, _, _, _, _, _, _, 0x40 &&& 0x40, _, _, _, _, _, true) :
                drop_job(JC_DROP_UNSATISFIABLE);
            (_, _, _, _, _, _, _, _, 0x80 &&& 0x80, _, _, _, _, _, true) :
                drop_job(JC_DROP_UNSATISFIABLE);
            (_, _, _, _, _, _, _, _, _, _, _, _, _, 0, true) : accept_copy0();
            (_, _, _, _, _, _, _, _, _, _, _, _, _, 1, true) : accept_copy1();
        }
    }

    apply {
        hdr.bridge.setValid();
        hdr.bridge.kind = BRIDGE_FORWARD;
        dlcp_classify.apply(hdr, meta, ig_tm_md);
        switch_address.apply(hdr, meta);
        job_membership.apply(hdr, meta, ig_intr_md.ingress_port);
        validation.apply(hdr, meta, ig_prsr_md);
        /* ---- rule R4, then protocol.md 4.1 (agg_checks) ---- */
        if (meta.agg_fragment == 1 || (meta.is_fragment == 1 && meta.to_switch == 1)) {
            drop_global(GC_DROP_FRAGMENT);
        } else if (meta.to_agg == 0) {
            /* ordinary traffic (other fragments, IPv4 with options, short UDP frames) */
            bool routed;
            ipv4_forwarding.apply(hdr, meta, ig_tm_md, routed);
            if (routed) {
                count_global(GC_FORWARDED);
            } else {
                drop_global(GC_DROP_NOT_ROUTABLE);
            }
        } else {
            agg_checks.apply();
            if (meta.accepted == 1) {
                /* ---- a valid DATA or FLUSH of a member ---- */
                if (hdr.agg.pkt_type == TYPE_FLUSH) {
                    drop_job(JC_FLUSH);                     /* emptied by agg_checks; no reply */
                } else {
                    slot_state.apply(hdr, meta);
                    /* the lookups only read the packet; behind agg_checks they fill the
                     * slot-state stages, which leaves the first stages to the checks */
                    LOOKUP(0)  LOOKUP(1)  LOOKUP(2)  LOOKUP(3)  LOOKUP(4)  LOOKUP(5)
                    LOOKUP(6)  LOOKUP(7)  LOOKUP(8)  LOOKUP(9)  LOOKUP(10) LOOKUP(11)
                    LOOKUP(12) LOOKUP(13) LOOKUP(14) LOOKUP(15) LOOKUP(16) LOOKUP(17)
                    LOOKUP(18) LOOKUP(19) LOOKUP(20) LOOKUP(21) LOOKUP(22) LOOKUP(23)
                    LOOKUP(24) LOOKUP(25) LOOKUP(26) LOOKUP(27) LOOKUP(28) LOOKUP(29)
                    LOOKUP(30) LOOKUP(31)
                    /* the registers of the result right after the decision's last answer */
                    SUM_WORD(0,  0,  1)  SUM_WORD(1,  2,  3)  SUM_WORD(2,  4,  5)
                    SUM_WORD(3,  6,  7)  SUM_WORD(4,  8,  9)  SUM_WORD(5,  10, 11)
                    SUM_WORD(6,  12, 13) SUM_WORD(7,  14, 15) SUM_WORD(8,  16, 17)
                    SUM_WORD(9,  18, 19) SUM_WORD(10, 20, 21) SUM_WORD(11, 22, 23)
                    SUM_WORD(12, 24, 25) SUM_WORD(13, 26, 27) SUM_WORD(14, 28, 29)
                    SUM_WORD(15, 30, 31)
                    result_fields.apply(hdr, meta);
                    if (meta.outcome == OUTCOME_PENDING) {
                        drop_job(JC_PENDING);               /* consumed */
                    } else if (meta.outcome == OUTCOME_DUPLICATE) {
                        drop_job(JC_DUPLICATE);
                    } else {
                        if (meta.outcome == OUTCOME_COMPLETE) {
                            count_job(JC_COMPLETE);
                        } else if (meta.outcome == OUTCOME_RESERVE) {
                            count_job(JC_RESERVED);
                        } else {
                            count_job(JC_STRAGGLER);
                        }
                        build_reply.apply(hdr, meta, ig_intr_md, ig_tm_md);
                    }
                }
            }
        }

        /* exactly one counter cell per packet */
        if (meta.count_job == 1) {
            job_counters.count(meta.job_counter_index);
        } else {
            global_counters.count(meta.global_cell);
        }
    }
}

control SwitchEgress(inout headers_t hdr,
                     inout egress_metadata_t meta,
                     in egress_intrinsic_metadata_t eg_intr_md,
                     in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                     inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                     inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    MemberAddressing() member_addressing;
    ResultShape() result_shape;
    DlcpAdmission() dlcp_admission;
    CeChecksumUpdate() ce_checksum;

    apply {
        if (eg_intr_md.deflection_flag == 0 &&
            (hdr.bridge.kind == BRIDGE_AGG_UNICAST || hdr.bridge.kind == BRIDGE_AGG_MULTICAST)) {
            member_addressing.apply(hdr, meta, eg_intr_md, eg_dprsr_md);
            result_shape.apply(hdr, meta);
        }
        dlcp_admission.apply(hdr, meta, eg_intr_md, eg_dprsr_md);
        /* aggregator packets get a full recompute in the deparser instead */
        if (meta.ce_marked == 1 && hdr.bridge.kind == BRIDGE_FORWARD) {
            ce_checksum.apply(hdr, meta);
        }
    }
}

Pipeline(IngressParser(),
         SwitchIngress(),
         IngressDeparser(),
         EgressParser(),
         SwitchEgress(),
         EgressDeparser()) pipe;

Switch(pipe) main;
