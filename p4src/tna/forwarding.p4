/* Jobs, membership, per-member egress addressing and ordinary IPv4 forwarding
 * (protocol.md sections 3, 4.1, 5, 7). */
#ifndef _THC_INA_TNA_FORWARDING_P4_
#define _THC_INA_TNA_FORWARDING_P4_

#define WORKER_BIT(w) w: set_worker_bit(32w1 << w);

/* Which jobs exist, where their slots start, and who may contribute. All three tables key
 * on packet fields only, so they share the first stage. */
control JobMembership(in headers_t hdr,
                      inout ingress_metadata_t meta,
                      in PortId_t ingress_port) {
    action set_job(job_index_t job_index, bit<16> counter_base, slot_index_t slot_base,
                   bit<16> pool_size, bit<16> values_per_packet, bit<8> member_count,
                   bit<16> group) {
        meta.job_known = 1;
        meta.job_index = job_index;
        meta.counter_base = counter_base;
        meta.slot_base = slot_base;
        meta.pool_size = pool_size;
        meta.values_per_packet = values_per_packet;
        meta.member_count = member_count;
        meta.group = group;
    }

    action unknown_job() {
        meta.job_known = 0;
    }

    table jobs {
        key = { hdr.agg.job : exact @name("job"); }
        actions = { set_job; @defaultonly unknown_job; }
        const default_action = unknown_job();
        size = MAX_JOBS;
    }

    action member() {
        meta.is_member = 1;
    }

    action not_member() {
        meta.is_member = 0;
    }

    /* rule R2: a member is bound to its switch port and its source addresses */
    table members {
        key = {
            hdr.agg.job            : exact @name("job");
            hdr.agg.worker         : exact @name("worker");
            ingress_port           : exact @name("port");
            hdr.ethernet.src_addr  : exact @name("mac");
            hdr.ipv4.src_addr      : exact @name("ip");
            hdr.udp.src_port       : exact @name("udp_port");
        }
        actions = { member; @defaultonly not_member; }
        const default_action = not_member();
        size = 32 * MAX_JOBS;
    }

    action set_worker_bit(bit<32> bit_of_worker) {
        meta.worker_bit = bit_of_worker;
    }

    /* Tofino has no shift by a field: 1 << worker is a constant table (0 for >= 32) */
    table worker_bits {
        key = { hdr.agg.worker : exact @name("worker"); }
        actions = { set_worker_bit; }
        const default_action = set_worker_bit(0);
        size = 32;
        const entries = {
            WORKER_BIT(0)  WORKER_BIT(1)  WORKER_BIT(2)  WORKER_BIT(3)
            WORKER_BIT(4)  WORKER_BIT(5)  WORKER_BIT(6)  WORKER_BIT(7)
            WORKER_BIT(8)  WORKER_BIT(9)  WORKER_BIT(10) WORKER_BIT(11)
            WORKER_BIT(12) WORKER_BIT(13) WORKER_BIT(14) WORKER_BIT(15)
            WORKER_BIT(16) WORKER_BIT(17) WORKER_BIT(18) WORKER_BIT(19)
            WORKER_BIT(20) WORKER_BIT(21) WORKER_BIT(22) WORKER_BIT(23)
            WORKER_BIT(24) WORKER_BIT(25) WORKER_BIT(26) WORKER_BIT(27)
            WORKER_BIT(28) WORKER_BIT(29) WORKER_BIT(30) WORKER_BIT(31)
        }
    }

    apply {
        /* the default actions clear job_known / is_member: no write before the tables */
        jobs.apply();
        members.apply();
        worker_bits.apply();
    }
}

/* Rule R4 needs the aggregator's own IPv4 address: one entry, installed per switch. */
control SwitchAddress(in headers_t hdr, inout ingress_metadata_t meta) {
    action aggregator_address() {
        meta.to_switch = 1;
    }

    action other_address() {
        meta.to_switch = 0;
    }

    table switch_address {
        key = { hdr.ipv4.dst_addr : exact @name("dst_addr"); }
        actions = { aggregator_address; @defaultonly other_address; }
        const default_action = other_address();
        size = 4;
    }

    apply {
        if (hdr.ipv4.isValid()) {
            switch_address.apply();
        } else {
            meta.to_switch = 0;
        }
    }
}

/* Ordinary traffic: longest-prefix match on the destination, a layer-2 rewrite only (the
 * IPv4 header is left as it is, protocol.md 7). A route owns a group of equal-cost next
 * hops (next_hop_base .. next_hop_base + k - 1 in next_hops) and sprays its packets over
 * them round-robin: route_turn[route_index] is the group member the next packet takes. */
control Ipv4Forwarding(inout headers_t hdr,
                       inout ingress_metadata_t meta,
                       inout ingress_intrinsic_metadata_for_tm_t ig_tm_md,
                       out bool routed) {
    Register<bit<8>, route_index_t>(MAX_ROUTES, 0) route_turn;

    /* Read and advance the route's turn in one stateful ALU pass: packets of a route
     * never take the same turn. */
    RegisterAction<bit<8>, route_index_t, bit<8>>(route_turn) take_turn = {
        void apply(inout bit<8> turn, out bit<8> taken) {
            taken = turn;
            if (turn >= meta.next_hop_last) {
                turn = 0;
            } else {
                turn = turn + 1;
            }
        }
    };

    action spray(route_index_t route_index, next_hop_index_t next_hop_base,
                 bit<8> next_hop_last, mac_addr_t switch_mac) {
        meta.route_index = route_index;
        meta.next_hop_base = next_hop_base;
        meta.next_hop_last = next_hop_last;
        hdr.ethernet.src_addr = switch_mac;
    }

    action no_route() {
    }

    table routes {
        key = { hdr.ipv4.dst_addr : lpm @name("dst_addr"); }
        actions = { spray; @defaultonly no_route; }
        const default_action = no_route();
        size = MAX_ROUTES;
    }

    action advance_turn() {
        meta.next_hop_turn = take_turn.execute(meta.route_index);
    }

    action set_next_hop(PortId_t port, mac_addr_t next_hop_mac) {
        ig_tm_md.ucast_egress_port = port;
        hdr.ethernet.dst_addr = next_hop_mac;
        routed = true;
    }

    action missing_next_hop() {
        routed = false;
    }

    table next_hops {
        key = { meta.next_hop_index : exact @name("next_hop_index"); }
        actions = { set_next_hop; @defaultonly missing_next_hop; }
        const default_action = missing_next_hop();
        size = MAX_NEXT_HOP_SLOTS;
    }

    apply {
        routed = false;
        if (hdr.ipv4.isValid() && hdr.ipv4.version == 4) {
            if (routes.apply().hit) {
                advance_turn();
                meta.next_hop_index = meta.next_hop_base + (next_hop_index_t)meta.next_hop_turn;
                next_hops.apply();
            }
        }
    }
}

/* Egress: every RESULT / STRAGGLER copy is addressed to its member (protocol.md 5).
 * Multicast replicas carry the member's worker id as egress_rid (the PRE node's rid). */
control MemberAddressing(inout headers_t hdr,
                         inout egress_metadata_t meta,
                         in egress_intrinsic_metadata_t eg_intr_md,
                         inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
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
        eg_dprsr_md.drop_ctl = 1;
    }

    table member_addresses {
        key = {
            hdr.agg.job      : exact @name("job");
            meta.dest_worker : exact @name("worker");
        }
        actions = { address_member; @defaultonly unknown_member; }
        const default_action = unknown_member();
        size = 32 * MAX_JOBS;
    }

    apply {
        if (hdr.bridge.kind == BRIDGE_AGG_MULTICAST) {
            meta.dest_worker = eg_intr_md.egress_rid[7:0];
        } else {
            meta.dest_worker = hdr.bridge.dest_worker;
        }
        member_addresses.apply();
        meta.full_checksum = 1;
    }
}

#endif
