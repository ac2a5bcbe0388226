/* IPv4 header checksums (protocol.md 1, rule R5).
 *
 * Aggregator-built packets (RESULT, STRAGGLER): full recompute over their 20-byte header in
 * the egress deparser (EgressDeparser in parser.p4, when meta.full_checksum is set by
 * MemberAddressing).
 *
 * Forwarded packets marked CE: RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'). Only the ECN bits
 * change, from ECT(1) = 01 or ECT(0) = 10 to CE = 11, so m' = m + d with d = 3 - ECN in
 * the low bits of the version/IHL/ToS word, and eqn. 3 reduces to the ones'-complement
 * subtraction HC - d (plus 0xFFFF, i.e. minus one more, when it borrows: HC < d). It needs
 * neither IHL nor the other header words, and leaves a bad checksum bad by the same amount,
 * as the other planes do. The borrow cases are constant entries of one table, so the update
 * is a single 16-bit subtract of an action constant.
 * tests/tofino/test_tna_source.py checks these entries against eqn. 3 for every HC. */
#ifndef _THC_INA_TNA_CHECKSUMS_P4_
#define _THC_INA_TNA_CHECKSUMS_P4_

control CeChecksumUpdate(inout headers_t hdr, in egress_metadata_t meta) {
    /* adds minus_amount (mod 2^16): Tofino takes action data as the first operand of an
     * add, never as the second of a subtract */
    action subtract(bit<16> minus_amount) {
        hdr.ipv4.hdr_checksum = minus_amount + hdr.ipv4.hdr_checksum;
    }

    table ce_step {
        key = {
            meta.checksum_delta   : exact   @name("delta");
            hdr.ipv4.hdr_checksum : ternary @name("checksum");
        }
        actions = { subtract; }
        const entries = {
            (1, 0)      : subtract(0xFFFE);     /* -2, HC < d: borrow */
            (1, _)      : subtract(0xFFFF);     /* -1 */
            (2, 0)      : subtract(0xFFFD);     /* -3, borrow */
            (2, 1)      : subtract(0xFFFD);     /* borrow */
            (2, _)      : subtract(0xFFFE);     /* -2 */
        }
        const default_action = subtract(0);
        size = 8;
    }

    apply {
        ce_step.apply();
    }
}

#endif
