/* Parser and deparser.
 * A parse error does not drop the packet in simple_switch: ingress sees
 * standard_metadata.parser_error and decides (drop_truncated / drop_bad_length). */
#ifndef _THC_INA_PARSER_P4_
#define _THC_INA_PARSER_P4_

parser IngressParser(packet_in packet,
                     out headers_t hdr,
                     inout metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    state start {
        meta.to_agg_port = 0;
        meta.idx_bytes_left = 0;
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        /* IPv4 options make a packet ordinary traffic (protocol.md 4.1); a non-first
         * fragment has no UDP header (ingress judges fragments, fragments.p4). */
        transition select(hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.protocol,
                          hdr.ipv4.frag_offset) {
            (4, 5, IP_PROTO_UDP, 0): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            AGG_PORT_BASE &&& AGG_PORT_MASK: parse_agg;
            default: accept;
        }
    }

    state parse_agg {
        /* Set before the extract: a frame too short for the AGG header still
         * shows ingress that it was aimed at the aggregator (drop_truncated). */
        meta.to_agg_port = 1;
        packet.extract(hdr.agg);
        meta.idx_bytes_left = (hdr.agg.num_values + 1) >> 1;
        transition select(hdr.agg.version, hdr.agg.pkt_type) {
            (AGG_VERSION, TYPE_DATA): check_num_values;
            default: accept;          /* FLUSH has no payload; the rest is dropped */
        }
    }

    state check_num_values {
        /* Only a valid value count (1..MAX_VALUES = 64) is extracted; ingress drops
         * the others (drop_bad_length) without touching the stack. Masks, because
         * every BMv2 parser supports them: 0xFFC0 matches 0..63 (0 is caught first). */
        transition select(hdr.agg.num_values) {
            0: accept;
            0x0000 &&& 0xFFC0: parse_index_byte;
            MAX_VALUES: parse_index_byte;
            default: accept;
        }
    }

    state parse_index_byte {
        packet.extract(hdr.idx.next);
        meta.idx_bytes_left = meta.idx_bytes_left - 1;
        transition select(meta.idx_bytes_left) {
            0: accept;
            default: parse_index_byte;
        }
    }
}

control IngressDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.agg);
        packet.emit(hdr.idx);     /* invalid on everything the aggregator emits */
        packet.emit(hdr.sums);    /* valid lanes of a RESULT */
    }
}

#endif
