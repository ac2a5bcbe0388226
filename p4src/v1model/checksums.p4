/* IPv4 header checksum (protocol.md 1): aggregation packets are not verified (the
 * reference aggregator does not check them either); the checksum is recomputed over
 * the 20-byte header of every RESULT/STRAGGLER this program builds (addressing and
 * lengths). The DLCP CE mark updates it incrementally in egress (dlcp.p4), which is
 * right for headers with options too. The UDP checksum of emitted packets is 0. */
#ifndef _THC_INA_CHECKSUMS_P4_
#define _THC_INA_CHECKSUMS_P4_

control NoChecksumVerify(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control Ipv4ChecksumUpdate(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid() && meta.ipv4_changed == 1,
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn,
              hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
              hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

#endif
