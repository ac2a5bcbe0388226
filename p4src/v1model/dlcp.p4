/* DLCP stage (docs/protocol.md section 6).
 *
 * Classification (ingress): DSCP -> (queue, is_data) by table; the queue goes to
 * standard_metadata.priority, which simple_switch --priority-queues 8 serves with
 * strict priority (queue 7 first).
 *
 * Admission (egress, the enq_qdepth variant): the occupancy seen by a packet is
 * the depth of its (port, priority) queue when it was enqueued, as the reference
 * counts it: standard_metadata.enq_qdepth less the packets ahead of it that this
 * stage dropped (they held a BMv2 queue place until dequeued; admit() below).
 * Why not the ingress occupancy register (increment in ingress, decrement in egress):
 * RESULT multicast copies get their egress port only after ingress, in the
 * replication engine, so an ingress register cannot charge the right (port, queue)
 * for them; egress sees every copy with its own port and queue. Needs a simple_switch
 * whose enq_qdepth is per priority queue (behavioral-model PR #1270, Oct 2024), and a
 * BMv2 queue depth below DLCP_HISTORY and above the capacity (p4control sets and
 * checks both), so BMv2 never tail-drops uncounted. */
#ifndef _THC_INA_DLCP_P4_
#define _THC_INA_DLCP_P4_

control DlcpClassify(in headers_t hdr,
                     inout metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    action set_queue(bit<3> queue, bit<1> is_data) {
        meta.queue = queue;
        meta.is_data = is_data;
    }

    table dscp_to_queue {
        key = { hdr.ipv4.dscp : exact; }
        actions = { set_queue; }
        /* unlisted DSCP: lowest queue, never dropped selectively */
        default_action = set_queue(0, 0);
        size = 64;
    }

    apply {
        meta.queue = 0;
        meta.is_data = 0;
        if (hdr.ipv4.isValid()) {
            dscp_to_queue.apply();
        }
        standard_metadata.priority = meta.queue;
    }
}

control DlcpAdmission(inout headers_t hdr,
                      inout metadata_t meta,
                      inout standard_metadata_t standard_metadata) {
    counter<bit<32>>(3, CounterType.packets) dlcp_counters;   /* DC_* cells */
    /* packets through this stage per (port, queue): a drained queue stops counting */
    counter<bit<32>>(DLCP_QUEUES, CounterType.packets) queue_departures;
    /* Per (port, queue): packets that went through this stage, DLCP drops among them
     * (cumulative), and the drop count after each of the last DLCP_HISTORY packets. */
    register<bit<32>, bit<32>>(DLCP_QUEUES) seen;
    register<bit<32>, bit<32>>(DLCP_QUEUES) dropped;
    register<bit<32>, bit<32>>(DLCP_QUEUES * DLCP_HISTORY) dropped_after;
    bit<32> threshold = 0;
    bit<32> capacity = 0;
    bit<32> occupancy = 0;
    bit<2>  verdict = VERDICT_PASS;
    bit<32> queue_cell = 0;

    action set_limits(bit<32> selective_threshold, bit<32> queue_capacity) {
        threshold = selective_threshold;
        capacity = queue_capacity;
    }

    /* K[queue] and the capacity C, installed per queue by the controller. */
    table queue_limits {
        key = { meta.queue : exact; }
        actions = { set_limits; }
        default_action = set_limits(0xFFFFFFFF, 0xFFFFFFFF);
        size = 8;
    }

    /* The occupancy the reference sees (protocol.md 6): admitted packets in the queue.
     * enq_qdepth also counts packets ahead that this stage drops later (BMv2 queues
     * before egress), so subtract the drops among those enq_qdepth packets: a queue is
     * FIFO, so they are exactly the last enq_qdepth packets seen here, and their drops
     * are dropped - dropped_after[seen - enq_qdepth]. Then decide, and record this
     * packet. One action: one BMv2 lock scope over the three registers. */
    action admit() {
        /* the (port, queue) cell: the controller keeps ports below DLCP_PORTS */
        bit<32> q = ((bit<32>)standard_metadata.egress_port & (DLCP_PORTS - 1)) * 8
                    + (bit<32>)meta.queue;
        queue_cell = q;
        bit<32> depth = (bit<32>)standard_metadata.enq_qdepth;
        bit<32> n_seen;  seen.read(n_seen, q);
        bit<32> n_drop;  dropped.read(n_drop, q);
        bit<32> drops_before;
        dropped_after.read(drops_before,
                           q * DLCP_HISTORY + ((n_seen - depth) & (DLCP_HISTORY - 1)));
        occupancy = depth - (n_drop - drops_before);
        bool above = meta.is_data == 1 && occupancy > threshold && hdr.ipv4.isValid();
        verdict = occupancy >= capacity ? VERDICT_BUFFER_DROP :
                  (above ? (hdr.ipv4.ecn == 0 ? VERDICT_SELECTIVE_DROP : VERDICT_MARK) :
                   VERDICT_PASS);
        n_seen = n_seen + 1;
        n_drop = n_drop + ((verdict == VERDICT_BUFFER_DROP ||
                            verdict == VERDICT_SELECTIVE_DROP) ? 32w1 : 32w0);
        seen.write(q, n_seen);
        dropped.write(q, n_drop);
        dropped_after.write(q * DLCP_HISTORY + (n_seen & (DLCP_HISTORY - 1)), n_drop);
    }

    apply {
        queue_limits.apply();
        admit();
        queue_departures.count(queue_cell);
        if (verdict == VERDICT_BUFFER_DROP) {
            mark_to_drop(standard_metadata);
            dlcp_counters.count(DC_BUFFER_DROP);
        } else if (verdict == VERDICT_SELECTIVE_DROP) {
            /* Not-ECT above the threshold: unimportant, dropped first */
            mark_to_drop(standard_metadata);
            dlcp_counters.count(DC_SELECTIVE_DROP);
        } else if (verdict == VERDICT_MARK && hdr.ipv4.ecn != 3) {
            /* ECT: important, kept and marked Congestion Experienced. The
             * checksum is updated incrementally (RFC 1624 eqn. 3, protocol.md 1):
             * right for any IHL, a bad checksum stays bad by as much. */
            bit<16> old_word = hdr.ipv4.version ++ hdr.ipv4.ihl ++ hdr.ipv4.dscp
                               ++ hdr.ipv4.ecn;
            hdr.ipv4.ecn = 3;
            bit<16> new_word = hdr.ipv4.version ++ hdr.ipv4.ihl ++ hdr.ipv4.dscp
                               ++ hdr.ipv4.ecn;
            bit<32> sum = (bit<32>)(~hdr.ipv4.hdr_checksum) + (bit<32>)(~old_word)
                          + (bit<32>)new_word;
            sum = (sum & 0xFFFF) + (sum >> 16);
            sum = (sum & 0xFFFF) + (sum >> 16);
            hdr.ipv4.hdr_checksum = ~sum[15:0];
            dlcp_counters.count(DC_CE_MARKED);
        }
    }
}

#endif
