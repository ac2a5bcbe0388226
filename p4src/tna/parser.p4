/* Parsers and deparsers.
 *
 * Ingress: Ethernet / IPv4 / UDP / AGG and, for a DATA of 1..MAX_VALUES values, exactly
 * ceil(num_values / 2) index bytes (one state per byte, so the lookup of byte k is its own
 * table). A frame too short for what it claims ends the parse with an error; the ingress
 * reads ig_intr_md_from_prsr.parser_err (which keeps such packets in the pipeline on
 * Tofino) and turns it into drop_truncated / drop_bad_length.
 *
 * Egress: the bridged header says what follows. A RESULT or STRAGGLER is parsed up to its
 * AGG header only: its sums (ceil(num_values / 4) words, see BuildAggReply) pass through
 * as payload. Parsing them here too would take the egress
 * parser past Tofino's maximum parse depth (160 bytes with the intrinsic metadata). */
#ifndef _THC_INA_TNA_PARSER_P4_
#define _THC_INA_TNA_PARSER_P4_

#define PARSE_INDEX_BYTE(k, next)                                   \
    state parse_idx_##k {                                           \
        pkt.extract(hdr.idx[k]);                                    \
        transition select(hdr.agg.num_values) {                     \
            (2 * k + 1): accept;                                    \
            (2 * k + 2): accept;                                    \
            default: next;                                          \
        }                                                           \
    }

parser IngressParser(packet_in pkt,
                     out headers_t hdr,
                     out ingress_metadata_t meta,
                     out ingress_intrinsic_metadata_t ig_intr_md) {
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);        /* phase-0 port metadata: unused */
        /* flags the controls test on paths that do not set them (@pa_auto_init_metadata
         * zeroes metadata too; these do not depend on it) */
        meta.to_agg = 0;
        meta.is_fragment = 0;
        meta.agg_fragment = 0;
        meta.accepted = 0;
        meta.count_job = 0;
        meta.fresh = 0;
        meta.same_round = 0;
        meta.already_seen = 0;
        meta.left_before = 0;
        meta.outcome = OUTCOME_NONE;
        transition parse_ethernet;
    }

    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        /* version, IHL, MF, fragment offset, protocol: options or another protocol make a
         * packet ordinary traffic; a fragment is never aggregated (rule R4), but the UDP
         * header of a first fragment is read to see whether it was aimed at us. */
        transition select(hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.flags[0:0],
                          hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (4, 5, 0, 0, IP_PROTO_UDP): parse_udp;
            (4, _, 0, 0, _): accept;
            (4, 5, 1, 0, IP_PROTO_UDP): parse_first_fragment;
            (4, _, _, _, _): parse_fragment;
            default: accept;
        }
    }

    state parse_first_fragment {
        meta.is_fragment = 1;
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            AGG_PORT_BASE &&& AGG_PORT_MASK: agg_fragment;
            default: accept;
        }
    }

    state agg_fragment {
        meta.agg_fragment = 1;
        transition accept;
    }

    state parse_fragment {
        meta.is_fragment = 1;
        transition accept;
    }

    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            AGG_PORT_BASE &&& AGG_PORT_MASK: parse_agg;
            default: accept;
        }
    }

    state parse_agg {
        /* Set before the extract: a frame too short for the AGG header still tells the
         * ingress that it was aimed at the aggregator (drop_truncated). */
        meta.to_agg = 1;
        pkt.extract(hdr.agg);
        transition select(hdr.agg.version, hdr.agg.pkt_type, hdr.agg.num_values) {
            (AGG_VERSION, TYPE_DATA, 0): accept;                /* drop_bad_length */
            (AGG_VERSION, TYPE_DATA, 0x0000 &&& 0xFFC0): parse_idx_0;   /* 1..63 */
            (AGG_VERSION, TYPE_DATA, MAX_VALUES): parse_idx_0;
            default: accept;          /* FLUSH has no payload; the rest is dropped */
        }
    }

    PARSE_INDEX_BYTE(0,  parse_idx_1)  PARSE_INDEX_BYTE(1,  parse_idx_2)
    PARSE_INDEX_BYTE(2,  parse_idx_3)  PARSE_INDEX_BYTE(3,  parse_idx_4)
    PARSE_INDEX_BYTE(4,  parse_idx_5)  PARSE_INDEX_BYTE(5,  parse_idx_6)
    PARSE_INDEX_BYTE(6,  parse_idx_7)  PARSE_INDEX_BYTE(7,  parse_idx_8)
    PARSE_INDEX_BYTE(8,  parse_idx_9)  PARSE_INDEX_BYTE(9,  parse_idx_10)
    PARSE_INDEX_BYTE(10, parse_idx_11) PARSE_INDEX_BYTE(11, parse_idx_12)
    PARSE_INDEX_BYTE(12, parse_idx_13) PARSE_INDEX_BYTE(13, parse_idx_14)
    PARSE_INDEX_BYTE(14, parse_idx_15) PARSE_INDEX_BYTE(15, parse_idx_16)
    PARSE_INDEX_BYTE(16, parse_idx_17) PARSE_INDEX_BYTE(17, parse_idx_18)
    PARSE_INDEX_BYTE(18, parse_idx_19) PARSE_INDEX_BYTE(19, parse_idx_20)
    PARSE_INDEX_BYTE(20, parse_idx_21) PARSE_INDEX_BYTE(21, parse_idx_22)
    PARSE_INDEX_BYTE(22, parse_idx_23) PARSE_INDEX_BYTE(23, parse_idx_24)
    PARSE_INDEX_BYTE(24, parse_idx_25) PARSE_INDEX_BYTE(25, parse_idx_26)
    PARSE_INDEX_BYTE(26, parse_idx_27) PARSE_INDEX_BYTE(27, parse_idx_28)
    PARSE_INDEX_BYTE(28, parse_idx_29) PARSE_INDEX_BYTE(29, parse_idx_30)
    PARSE_INDEX_BYTE(30, parse_idx_31)

    state parse_idx_31 {                /* num_values 63 or 64 */
        pkt.extract(hdr.idx[31]);
        transition accept;
    }
}

control IngressDeparser(packet_out pkt,
                        inout headers_t hdr,
                        in ingress_metadata_t meta,
                        in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(hdr.bridge);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.agg);
        pkt.emit(hdr.idx);      /* invalid on everything the aggregator emits */
        pkt.emit(hdr.sums);     /* RESULT: ceil(num_values / 4) words */
    }
}

parser EgressParser(packet_in pkt,
                    out headers_t hdr,
                    out egress_metadata_t meta,
                    out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        meta.full_checksum = 0;
        meta.dlcp_count = 0;
        meta.ce_marked = 0;
        transition select(eg_intr_md.deflection_flag, hdr.bridge.kind) {
            (1, _): accept;                     /* a TM drop, deflected to be counted */
            (0, BRIDGE_FORWARD): parse_forwarded;
            (0, BRIDGE_AGG_UNICAST): parse_reply;
            (0, BRIDGE_AGG_MULTICAST): parse_reply;
            default: accept;
        }
    }

    /* ordinary traffic: only the IPv4 header matters (CE marking) */
    state parse_forwarded {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_forwarded_ipv4;
            default: accept;
        }
    }

    state parse_forwarded_ipv4 {
        pkt.extract(hdr.ipv4);
        transition accept;
    }

    /* RESULT or STRAGGLER built by the ingress: no options, no fragments; the sums
     * stay payload */
    state parse_reply {
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.agg);
        transition accept;
    }
}

control EgressDeparser(packet_out pkt,
                       inout headers_t hdr,
                       in egress_metadata_t meta,
                       in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        /* Packets the aggregator builds get a full recompute over their 20-byte header
         * (rule R5); a forwarded packet marked CE was updated incrementally in the egress
         * (dlcp.p4), everything else leaves its checksum untouched. */
        if (meta.full_checksum == 1) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv,
                hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
                hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
                hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        }
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.agg);
    }
}

#endif
