/* IPv4 fragments (protocol.md 4.1): never aggregated. A fragment aimed at the
 * aggregator is dropped (drop_fragment): a first fragment the parser took to an
 * aggregation UDP port, or any fragment to the switch's own address (a non-first
 * fragment carries no UDP header; the parser does not look past its IPv4 header).
 * Every other fragment is ordinary traffic. */
#ifndef _THC_INA_FRAGMENTS_P4_
#define _THC_INA_FRAGMENTS_P4_

control FragmentFilter(in headers_t hdr,
                       in metadata_t meta,
                       out bool for_aggregator) {
    bool to_switch = false;

    action switch_address() {
        to_switch = true;
    }

    action other_address() {
        to_switch = false;
    }

    /* One entry, installed by the controller: the switch's IPv4 address. */
    table own_address {
        key = { hdr.ipv4.dst_addr : exact; }
        actions = { switch_address; other_address; }
        const default_action = other_address();
        size = 1;
    }

    apply {
        for_aggregator = false;
        if (hdr.ipv4.isValid() && hdr.ipv4.version == 4 &&
            (hdr.ipv4.flags[0:0] == 1 || hdr.ipv4.frag_offset != 0)) {
            own_address.apply();
            /* to_agg_port: offset 0, IHL 5, UDP, a whole UDP header, AGG port */
            for_aggregator = to_switch || meta.to_agg_port == 1;
        }
    }
}

#endif
