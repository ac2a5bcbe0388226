/* DLCP stage (docs/protocol.md section 6) on the Tofino traffic manager.
 *
 * Classification (ingress): DSCP -> (queue, is_data) by table; the queue is the packet's
 * qid, and the control plane gives the port's eight queues strict priority (queue 7
 * first) in the TM scheduler (bfrt_scripts: TrafficManager).
 *
 * Admission, split between the TM and the egress because the Tofino 1 ingress cannot see
 * queue depths:
 *   - capacity C: the queue's buffer limit in the TM (buffer_only, C * cells-per-packet
 *     cells); the TM tail-drops at enqueue, as the reference does;
 *   - selective drop above K[q]: Not-ECT data packets are coloured YELLOW, everything else
 *     GREEN, and the queue's yellow drop limit is K / C rounded UP to the TM's 12.5% steps,
 *     so the TM drops unimportant packets at enqueue once the queue is (nearly) past K;
 *     the egress then drops the Not-ECT data packets that got in between K and the
 *     rounded limit, deciding on enq_qdepth (the depth this packet met at enqueue), so
 *     the decision is exactly "occupancy > K";
 *   - CE marking: ECT data packets whose enq_qdepth exceeded K leave with ECN = CE, the
 *     checksum updated by rule R5 (checksums.p4) or recomputed for aggregator packets.
 * Counting: every TM drop is deflected (deflect_on_drop) to the pipe's drop-report queue,
 * where the egress counts it as dlcp_selective_drop (yellow) or dlcp_buffer_drop (green)
 * and discards it, so all three DLCP counters keep the protocol's names. See README.md for
 * where this differs from the reference and how Tofino 2 ghost threads close the gap. */
#ifndef _THC_INA_TNA_DLCP_P4_
#define _THC_INA_TNA_DLCP_P4_

control DlcpClassify(inout headers_t hdr,
                     inout ingress_metadata_t meta,
                     inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* Every write of the classification sits in a table action: three tables in the first
     * stages, with no gateway or assignment statement of their own, which the compiler
     * would otherwise place after the aggregation's stages. */
    action set_queue(bit<3> queue, bit<1> is_data) {
        meta.is_data = is_data;
        ig_tm_md.qid = (QueueId_t)queue;
        ig_tm_md.ingress_cos = queue;
        hdr.bridge.queue = queue;
        hdr.bridge.is_data = is_data;
    }

    table dscp_to_queue {
        key = {
            hdr.ipv4.isValid()     : exact @name("ipv4_valid");
            hdr.ipv4.diffserv[7:2] : exact @name("dscp");
        }
        actions = { set_queue; }
        /* unlisted DSCP and frames that are not IPv4: lowest queue, never dropped
         * selectively */
        const default_action = set_queue(0, 0);
        size = 64;
    }

    action set_drop_reporting(bit<1> enabled) {
        ig_tm_md.deflect_on_drop = enabled;
    }

    /* keyless: enabled by the control plane once the drop-report queue is configured */
    table drop_reporting {
        actions = { set_drop_reporting; }
        default_action = set_drop_reporting(0);
        size = 1;
    }

    action color_yellow() {
        ig_tm_md.packet_color = COLOR_YELLOW;       /* unimportant: dropped first */
        hdr.bridge.yellow = 1;
    }

    action color_green() {
        ig_tm_md.packet_color = COLOR_GREEN;
        hdr.bridge.yellow = 0;
    }

    /* Not-ECT data packets are unimportant (docs/protocol.md section 6) */
    table data_color {
        key = {
            meta.is_data           : exact @name("is_data");
            hdr.ipv4.diffserv[1:0] : exact @name("ecn");
        }
        actions = { color_yellow; color_green; }
        const default_action = color_green();
        size = 1;
        const entries = {
            (1, 0) : color_yellow();
        }
    }

    apply {
        dscp_to_queue.apply();
        drop_reporting.apply();
        data_color.apply();
    }
}

control DlcpAdmission(inout headers_t hdr,
                      inout egress_metadata_t meta,
                      in egress_intrinsic_metadata_t eg_intr_md,
                      inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Counter<bit<32>, bit<2>>(DLCP_COUNTER_CELLS, CounterType_t.PACKETS) dlcp_counters;

    action set_threshold(bit<32> mark_cells) {
        meta.mark_threshold = mark_cells;
    }

    /* K[queue] in queue cells, installed per queue by the control plane */
    table queue_thresholds {
        key = { hdr.bridge.queue : exact @name("queue"); }
        actions = { set_threshold; }
        const default_action = set_threshold(0x7FFFFFFF);   /* never: depth < 2^19 */
        size = 8;
    }

    action count_deflected(bit<2> cell) {
        meta.dlcp_count = 1;
        meta.dlcp_cell = cell;
        eg_dprsr_md.drop_ctl = 1;           /* it was dropped: only counted here */
    }

    action selective_drop() {
        meta.dlcp_count = 1;
        meta.dlcp_cell = DC_SELECTIVE_DROP;
        eg_dprsr_md.drop_ctl = 1;
    }

    /* ecn_step: CE (11) minus the ECN it had, 1 from ECT(0) = 10, 2 from ECT(1) = 01 (a
     * constant per call: arithmetic on the 2-bit field would tie its PHV container to the
     * checksum's) */
    action mark_ce(bit<16> ecn_step) {
        meta.dlcp_count = 1;
        meta.dlcp_cell = DC_CE_MARKED;
        meta.ce_marked = 1;
        meta.checksum_delta = ecn_step;
        hdr.ipv4.diffserv[1:0] = 3;
    }

    action pass_unchanged() { }

    /* past K (the room's sign), by the packet's ECN: Not-ECT is unimportant and dropped,
     * ECT(0) / ECT(1) important, kept and marked; CE stays as it is */
    table past_threshold {
        key = {
            meta.depth_room[31:31]  : exact @name("past");
            hdr.ipv4.diffserv[1:0]  : exact @name("ecn");
        }
        actions = { selective_drop; mark_ce; pass_unchanged; }
        const default_action = pass_unchanged();
        size = 4;
        const entries = {
            (1, 0) : selective_drop();
            (1, 2) : mark_ce(1);
            (1, 1) : mark_ce(2);
        }
    }

    apply {
        if (eg_intr_md.deflection_flag == 1) {
            /* a packet the TM refused at enqueue, deflected here to be counted */
            if (hdr.bridge.yellow == 1) {
                count_deflected(DC_SELECTIVE_DROP);
            } else {
                count_deflected(DC_BUFFER_DROP);
            }
        } else if (hdr.bridge.is_data == 1 && hdr.ipv4.isValid()) {
            queue_thresholds.apply();
            /* K < 2^31 (the plan caps it) and depth < 2^19: the sign is exact */
            meta.depth_room = meta.mark_threshold - (bit<32>)eg_intr_md.enq_qdepth;
            past_threshold.apply();
        }
        if (meta.dlcp_count == 1) {
            dlcp_counters.count(meta.dlcp_cell);
        }
    }
}

#endif
