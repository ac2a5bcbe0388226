/* THC-INA in-network aggregation for BMv2 simple_switch (v1model).
 * Implements docs/protocol.md v2; limits in p4src/v1model/README.md.
 * Build: p4c --target bmv2 --arch v1model --p4runtime-files build/p4/main.p4info.txtpb \
 *            -o build/p4 p4src/v1model/main.p4
 * Run:   simple_switch_grpc --priority-queues 8 ... build/p4/main.json */
#include <core.p4>
/* the two-parameter register<T, I> of v1model needs this version or later */
#define V1MODEL_VERSION 20200408
#include <v1model.p4>

#include "headers.p4"
#include "counters.p4"
#include "parser.p4"
#include "lookup.p4"
#include "fragments.p4"
#include "aggregation.p4"
#include "dlcp.p4"
#include "forwarding.p4"
#include "checksums.p4"

#define LOOKUP(k) lookup_##k.apply(hdr.idx[k], hdr.agg.job, hdr.agg.num_values, meta.values.p##k);

control SwitchIngress(inout headers_t hdr,
                      inout metadata_t meta,
                      inout standard_metadata_t standard_metadata) {
    /* per job (job_index * JOB_COUNTER_STRIDE + JC_*) and global (GC_*) counters */
    counter<bit<32>>(MAX_JOBS * JOB_COUNTER_STRIDE, CounterType.packets) job_counters;
    counter<bit<32>>(GLOBAL_COUNTER_CELLS, CounterType.packets) global_counters;

    DlcpClassify() dlcp_classify;
    FragmentFilter() fragment_filter;
    Ipv4Forwarding() ipv4_forwarding;
    JobMembership() job_membership;
    SlotAggregation() slot_aggregation;
    BuildAggReply() build_reply;
    ByteLookup(0)  lookup_0;  ByteLookup(1)  lookup_1;  ByteLookup(2)  lookup_2;
    ByteLookup(3)  lookup_3;  ByteLookup(4)  lookup_4;  ByteLookup(5)  lookup_5;
    ByteLookup(6)  lookup_6;  ByteLookup(7)  lookup_7;  ByteLookup(8)  lookup_8;
    ByteLookup(9)  lookup_9;  ByteLookup(10) lookup_10; ByteLookup(11) lookup_11;
    ByteLookup(12) lookup_12; ByteLookup(13) lookup_13; ByteLookup(14) lookup_14;
    ByteLookup(15) lookup_15; ByteLookup(16) lookup_16; ByteLookup(17) lookup_17;
    ByteLookup(18) lookup_18; ByteLookup(19) lookup_19; ByteLookup(20) lookup_20;
    ByteLookup(21) lookup_21; ByteLookup(22) lookup_22; ByteLookup(23) lookup_23;
    ByteLookup(24) lookup_24; ByteLookup(25) lookup_25; ByteLookup(26) lookup_26;
    ByteLookup(27) lookup_27; ByteLookup(28) lookup_28; ByteLookup(29) lookup_29;
    ByteLookup(30) lookup_30; ByteLookup(31) lookup_31;

    action drop_global(bit<32> cell) {
        global_counters.count(cell);
        mark_to_drop(standard_metadata);
    }

    action drop_job(bit<32> cell) {
        job_counters.count(meta.job_index * JOB_COUNTER_STRIDE + cell);
        mark_to_drop(standard_metadata);
    }

    action count_job(bit<32> cell) {
        job_counters.count(meta.job_index * JOB_COUNTER_STRIDE + cell);
    }

    apply {
        meta.emit_agg = 0;
        meta.is_multicast = 0;
        meta.ipv4_changed = 0;
        meta.out_payload_len = 0;
        /* ---- protocol.md 4.1 row 1: a frame over MAX_FRAME, whatever it carries ---- */
        if (standard_metadata.packet_length > MAX_FRAME) {
            drop_global(GC_DROP_OVERSIZE);
            return;
        }
        dlcp_classify.apply(hdr, meta, standard_metadata);

        /* ---- protocol.md 4.1: fragments first (right after "is it IPv4") ---- */
        bool fragment_for_aggregator;
        fragment_filter.apply(hdr, meta, fragment_for_aggregator);
        if (fragment_for_aggregator) {
            drop_global(GC_DROP_FRAGMENT);
            return;
        }
        if (meta.to_agg_port == 0) {
            /* ordinary traffic (including IPv4 with options, other fragments and
             * short UDP frames) */
            bool routed;
            ipv4_forwarding.apply(hdr, meta, standard_metadata, routed);
            if (routed) {
                global_counters.count(GC_FORWARDED);
            } else {
                drop_global(GC_DROP_NOT_ROUTABLE);
            }
            return;
        }

        /* ---- protocol.md 4.1, in order; the first failure decides ---- */
        if (!hdr.agg.isValid()) {
            drop_global(GC_DROP_TRUNCATED);
            return;
        }
        if (hdr.agg.version != AGG_VERSION) {
            drop_global(GC_DROP_BAD_VERSION);
            return;
        }
        if (hdr.agg.pkt_type != TYPE_DATA && hdr.agg.pkt_type != TYPE_FLUSH) {
            drop_global(GC_DROP_BAD_TYPE);
            return;
        }
        bit<16> payload_len = hdr.agg.pkt_type == TYPE_DATA
                              ? (hdr.agg.num_values + 1) >> 1 : 16w0;
        bool bad_length =
            hdr.ipv4.total_len != IPV4_HEADER_LEN + hdr.udp.length ||
            (bit<32>)hdr.udp.length + 34 > standard_metadata.packet_length ||
            hdr.udp.length != UDP_HEADER_LEN + AGG_HEADER_LEN + payload_len ||
            (hdr.agg.pkt_type == TYPE_DATA &&
             (hdr.agg.num_values == 0 || hdr.agg.num_values > MAX_VALUES)) ||
            standard_metadata.parser_error != error.NoError;
        if (bad_length) {
            drop_global(GC_DROP_BAD_LENGTH);
            return;
        }
        job_membership.apply(hdr, meta, standard_metadata);
        if (meta.job_known == 0) {
            drop_global(GC_DROP_UNKNOWN_JOB);
            return;
        }
        /* the job's own values_per_packet: the length row, once the job is known */
        if (hdr.agg.pkt_type == TYPE_DATA && hdr.agg.num_values > meta.values_per_packet) {
            drop_global(GC_DROP_BAD_LENGTH);
            return;
        }
        if ((bit<16>)hdr.agg.slot >= meta.pool_size) {
            drop_job(JC_DROP_BAD_SLOT);
            return;
        }
        if (meta.is_member == 0) {
            drop_job(JC_DROP_NOT_MEMBER);
            return;
        }
        meta.worker_bit = (bit<32>)1 << (bit<8>)hdr.agg.worker;
        if (hdr.agg.pkt_type == TYPE_DATA &&
            ((hdr.agg.expected == 0 && hdr.agg.min_count == 0) ||
             (hdr.agg.expected != 0 && (hdr.agg.expected & meta.worker_bit) == 0))) {
            drop_job(JC_DROP_BAD_EXPECTED);
            return;
        }
        if (hdr.agg.pkt_type == TYPE_DATA && meta.unsatisfiable == 1) {
            drop_job(JC_DROP_UNSATISFIABLE);
            return;
        }
        count_job(JC_RX);

        if (hdr.agg.pkt_type == TYPE_FLUSH) {
            slot_aggregation.apply(hdr, meta);
            count_job(JC_FLUSHES);
            mark_to_drop(standard_metadata);
            return;
        }

        /* ---- DATA: table lookup per byte, then the slot state machine ---- */
        LOOKUP(0)  LOOKUP(1)  LOOKUP(2)  LOOKUP(3)  LOOKUP(4)  LOOKUP(5)  LOOKUP(6)  LOOKUP(7)
        LOOKUP(8)  LOOKUP(9)  LOOKUP(10) LOOKUP(11) LOOKUP(12) LOOKUP(13) LOOKUP(14) LOOKUP(15)
        LOOKUP(16) LOOKUP(17) LOOKUP(18) LOOKUP(19) LOOKUP(20) LOOKUP(21) LOOKUP(22) LOOKUP(23)
        LOOKUP(24) LOOKUP(25) LOOKUP(26) LOOKUP(27) LOOKUP(28) LOOKUP(29) LOOKUP(30) LOOKUP(31)
        slot_aggregation.apply(hdr, meta);

        if (meta.outcome == OUTCOME_PENDING) {
            count_job(JC_AGGREGATED);
            mark_to_drop(standard_metadata);          /* consumed */
        } else if (meta.outcome == OUTCOME_DUPLICATE) {
            drop_job(JC_DROP_DUPLICATE);
        } else {
            build_reply.apply(hdr, meta);
            if (meta.outcome == OUTCOME_COMPLETE) {
                count_job(JC_AGGREGATED);
                count_job(JC_RESULTS_MULTICAST);
                /* one copy per member, worker id as egress_rid (controller) */
                standard_metadata.mcast_grp = (bit<16>)meta.job_index + 1;
                meta.is_multicast = 1;
            } else {
                if (meta.outcome == OUTCOME_STRAGGLER) {
                    count_job(JC_STRAGGLER_NOTICES);
                } else {
                    count_job(JC_RESULTS_RESERVED);
                }
                /* unicast back to the sender, out of its ingress port */
                standard_metadata.egress_spec = standard_metadata.ingress_port;
                meta.dest_worker = hdr.agg.worker;
            }
        }
    }
}

control SwitchEgress(inout headers_t hdr,
                     inout metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    MemberAddressing() member_addressing;
    DlcpAdmission() dlcp_admission;

    apply {
        if (meta.emit_agg == 1) {
            member_addressing.apply(hdr, meta, standard_metadata);
        }
        dlcp_admission.apply(hdr, meta, standard_metadata);
    }
}

V1Switch(IngressParser(),
         NoChecksumVerify(),
         SwitchIngress(),
         SwitchEgress(),
         Ipv4ChecksumUpdate(),
         IngressDeparser()) main;
