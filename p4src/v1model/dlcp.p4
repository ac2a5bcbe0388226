/* DLCP stage (protocol.md section 6, notes/dlcp.md 7.3).
 *
 * Classification (ingress): DSCP -> (queue, is_data) by table; the queue goes to
 * standard_metadata.priority, which simple_switch --priority-queues 8 serves with
 * strict priority (queue 7 first).
 *
 * Admission (egress, the enq_qdepth variant): the occupancy seen by a packet is
 * standard_metadata.enq_qdepth, the depth of its (port, priority) queue when it was
 * enqueued. Why not the ingress occupancy register (increment in ingress, decrement
 * in egress): RESULT multicast copies get their egress port only after ingress, in
 * the replication engine, so an ingress register cannot charge the right
 * (port, queue) for them; egress sees every copy with its own port and queue.
 * Deviation (README.md): a packet dropped here has already held a queue place, so
 * occupancy counts it until it is dequeued; selective drop and CE marking decide the
 * same as the reference while the queue only grows (a paused port), the capacity
 * drop can come earlier once packets were dropped selectively. Needs a simple_switch
 * whose enq_qdepth is per priority queue (behavioral-model PR #1270, Oct 2024), and
 * BMv2 queue depths above the capacity so BMv2 never tail-drops uncounted. */
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
    bit<32> threshold = 0;
    bit<32> capacity = 0;

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

    apply {
        queue_limits.apply();
        bit<32> occupancy = (bit<32>)standard_metadata.enq_qdepth;
        if (occupancy >= capacity) {
            mark_to_drop(standard_metadata);
            dlcp_counters.count(DC_BUFFER_DROP);
        } else if (meta.is_data == 1 && occupancy > threshold && hdr.ipv4.isValid()) {
            if (hdr.ipv4.ecn == 0) {
                /* Not-ECT: unimportant, dropped first */
                mark_to_drop(standard_metadata);
                dlcp_counters.count(DC_SELECTIVE_DROP);
            } else if (hdr.ipv4.ecn != 3) {
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
}

#endif
