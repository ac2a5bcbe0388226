/* Jobs, membership, multicast addressing and ordinary IPv4 forwarding
 * (protocol.md sections 3, 4.1, 5, 7). */
#ifndef _THC_INA_FORWARDING_P4_
#define _THC_INA_FORWARDING_P4_

/* Which jobs exist, where their slots start, and who may contribute. */
control JobMembership(in headers_t hdr,
                      inout metadata_t meta,
                      in standard_metadata_t standard_metadata) {
    action set_job(bit<32> job_index, bit<32> slot_base, bit<16> pool_size,
                   bit<16> values_per_packet, bit<32> member_mask, bit<8> member_count) {
        meta.job_known = 1;
        meta.job_index = job_index;
        meta.slot_base = slot_base;
        meta.pool_size = pool_size;
        meta.values_per_packet = values_per_packet;
        meta.member_mask = member_mask;
        meta.member_count = member_count;
    }

    action unknown_job() {
        meta.job_known = 0;
    }

    table jobs {
        key = { hdr.agg.job : exact; }
        actions = { set_job; unknown_job; }
        const default_action = unknown_job();
        size = MAX_JOBS;
    }

    action member() {
        meta.is_member = 1;
    }

    action not_member() {
        meta.is_member = 0;
    }

    /* A member is bound to its whole address (protocol.md 3, 4.1): (job, worker id)
     * from its switch port, MAC, IPv4 address and UDP port. */
    table members {
        key = {
            hdr.agg.job                    : exact;
            hdr.agg.worker                 : exact;
            standard_metadata.ingress_port : exact;
            hdr.ethernet.src_addr          : exact;
            hdr.ipv4.src_addr              : exact;
            hdr.udp.src_port               : exact;
        }
        actions = { member; not_member; }
        const default_action = not_member();
        size = 32 * MAX_JOBS;
    }

    apply {
        meta.job_known = 0;
        meta.is_member = 0;
        meta.unsatisfiable = 0;
        jobs.apply();
        if (meta.job_known == 1 && hdr.agg.worker < 32) {
            members.apply();
        }
        /* A DATA that could never complete: expected names a non-member, or
         * min_count exceeds the workers who may contribute (popcount(expected), or
         * the job's size when expected is 0). popcount by SWAR arithmetic. */
        bit<32> x = hdr.agg.expected;
        x = x - ((x >> 1) & 0x55555555);
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333);
        x = (x + (x >> 4)) & 0x0F0F0F0F;
        x = x + (x >> 8);
        x = x + (x >> 16);
        bit<8> can_contribute = hdr.agg.expected != 0 ? (bit<8>)(x & 0x3F) : meta.member_count;
        if ((hdr.agg.expected & ~meta.member_mask) != 0 || hdr.agg.min_count > can_contribute) {
            meta.unsatisfiable = 1;
        }
    }
}

#define MAX_ROUTES          1024
#define MAX_NEXT_HOP_SLOTS  8192        /* MAX_ROUTES x 8 next hops per route */

/* Ordinary traffic: longest-prefix match on the destination; a layer-2 rewrite
 * only (the IPv4 header is left as it is, protocol.md 7). A route owns a group of
 * equal-cost next hops (group_base .. group_base + group_size - 1 in next_hops) and
 * sprays its packets over them round-robin: route_turn[route_index] is the group
 * member the next packet takes, 0 at start. */
control Ipv4Forwarding(inout headers_t hdr,
                       inout metadata_t meta,
                       inout standard_metadata_t standard_metadata,
                       out bool routed) {
    register<bit<32>, bit<32>>(MAX_ROUTES) route_turn;
    bit<32> next_hop_index = 0;

    /* Read, advance and write the route's turn in this one action: one BMv2 lock
     * scope, so concurrent packets of a route never take the same turn. */
    action spray(bit<32> route_index, bit<32> group_base, bit<32> group_size,
                 mac_addr_t switch_mac) {
        bit<32> turn;
        route_turn.read(turn, route_index);
        next_hop_index = group_base + turn;
        /* branch-free, like the slot state machine: no control flow inside actions */
        bit<32> next_turn = (turn + 1 >= group_size) ? 32w0 : turn + 1;
        route_turn.write(route_index, next_turn);
        hdr.ethernet.src_addr = switch_mac;
        routed = true;
    }

    action no_route() {
        routed = false;
    }

    table routes {
        key = { hdr.ipv4.dst_addr : lpm; }
        actions = { spray; no_route; }
        const default_action = no_route();
        size = MAX_ROUTES;
    }

    action set_next_hop(port_id_t port, mac_addr_t next_hop_mac) {
        standard_metadata.egress_spec = port;
        hdr.ethernet.dst_addr = next_hop_mac;
    }

    action missing_next_hop() {
        routed = false;
    }

    table next_hops {
        key = { next_hop_index : exact; }
        actions = { set_next_hop; missing_next_hop; }
        const default_action = missing_next_hop();
        size = MAX_NEXT_HOP_SLOTS;
    }

    apply {
        routed = false;
        if (hdr.ipv4.isValid() && hdr.ipv4.version == 4) {
            routes.apply();
            if (routed) {
                next_hops.apply();
            }
        }
    }
}

/* Egress: every RESULT / STRAGGLER copy is addressed to its member (protocol.md 5).
 * Multicast copies carry the member's worker id as egress_rid. */
control MemberAddressing(inout headers_t hdr,
                         inout metadata_t meta,
                         inout standard_metadata_t standard_metadata) {
    action address_member(mac_addr_t switch_mac, ipv4_addr_t switch_ip,
                          mac_addr_t member_mac, ipv4_addr_t member_ip,
                          bit<16> member_udp_port) {
        hdr.ethernet.src_addr = switch_mac;
        hdr.ethernet.dst_addr = member_mac;
        hdr.ipv4.src_addr = switch_ip;
        hdr.ipv4.dst_addr = member_ip;
        hdr.ipv4.ttl = 64;
        hdr.ipv4.identification = 0;
        hdr.ipv4.flags = 2;              /* DF */
        hdr.ipv4.frag_offset = 0;
        hdr.ipv4.protocol = IP_PROTO_UDP;
        hdr.udp.src_port = AGG_PORT_BASE;
        hdr.udp.dst_port = member_udp_port;
        hdr.udp.checksum = 0;
        hdr.agg.worker = meta.dest_worker;
    }

    action unknown_member() {
        mark_to_drop(standard_metadata);
    }

    table member_addresses {
        key = {
            hdr.agg.job      : exact;
            meta.dest_worker : exact;
        }
        actions = { address_member; unknown_member; }
        const default_action = unknown_member();
        size = 32 * MAX_JOBS;
    }

    apply {
        if (meta.is_multicast == 1) {
            meta.dest_worker = (bit<8>)standard_metadata.egress_rid;
        }
        member_addresses.apply();
        /* Anything past the UDP length (trailing bytes of a padded or over-long
         * frame) is unparsed payload: cut it so the frame ends with the header. */
        truncate(L2_TO_AGG_LEN + (bit<32>)meta.out_payload_len);
    }
}

#endif
