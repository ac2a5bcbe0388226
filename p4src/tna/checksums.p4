/* IPv4 header checksums (protocol.md 1, rule R5).
 *
 * Aggregator-built packets (RESULT, STRAGGLER): full recompute over their 20-byte header in
 * the egress deparser (EgressDeparser in parser.p4, when meta.full_checksum is set by
 * MemberAddressing).
 *
 * Forwarded packets marked CE: RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'). Only the ECN bits
 * change, from ECT(1) = 01 or ECT(0) = 10 to CE = 11, so m' = m + d with d = 3 - ECN in
 * the low bits of the version/IHL/ToS word, and eqn. 3 reduces to the ones'-complement
 * subtraction HC - d (plus 0xFFFF when it borrows). It needs neither IHL nor the other
 * header words, and leaves a bad checksum bad by the same amount, as the other planes do.
 * tests/tofino/test_tna_source.py checks this reduction against eqn. 3 for every HC. */
#ifndef _THC_INA_TNA_CHECKSUMS_P4_
#define _THC_INA_TNA_CHECKSUMS_P4_

control CeChecksumUpdate(inout headers_t hdr, inout egress_metadata_t meta) {
    action borrow() {
        hdr.ipv4.hdr_checksum = meta.checksum_step[15:0] + 0xFFFF;
    }

    action no_borrow() {
        hdr.ipv4.hdr_checksum = meta.checksum_step[15:0];
    }

    apply {
        meta.checksum_step = (bit<32>)hdr.ipv4.hdr_checksum - (bit<32>)meta.checksum_delta;
        if (meta.checksum_step[31:31] == 1) {
            borrow();
        } else {
            no_borrow();
        }
    }
}

#endif
