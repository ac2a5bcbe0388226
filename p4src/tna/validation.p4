/* The numbers the checks of protocol.md 4.1 compare (the ordered checks themselves are in
 * thc_ina.p4). Tofino compares two fields by subtracting them in one stage and testing the
 * sign bit in the next, so every "a > b" of the protocol becomes a *_gap field here.
 *
 * popcount(expected) (rule R3 and the expected-set completion) comes from three exact
 * tables on 11/11/10-bit chunks of expected; "min_count > popcount(expected)" is one range
 * table on the three chunk counts, so the verdict is ready one stage after the lookups
 * (the slot registers start right after the checks; every stage saved here is a stage
 * for the sum registers). All of these tables hold protocol constants, installed by the
 * control plane (bfrt_scripts/tofino_plan.py: validation_entries). */
#ifndef _THC_INA_TNA_VALIDATION_P4_
#define _THC_INA_TNA_VALIDATION_P4_

control AggValidation(in headers_t hdr, inout ingress_metadata_t meta) {
    /* UDP length == 8 + 32 + payload: DATA ceil(num_values / 2) for 1..MAX_VALUES
     * values, FLUSH 0 (its num_values ignored). */
    action length_fits() {
        meta.length_ok = 1;
    }

    action length_wrong() {
        meta.length_ok = 0;
    }

    table agg_lengths {
        key = {
            hdr.agg.pkt_type   : ternary @name("pkt_type");
            hdr.agg.num_values : ternary @name("num_values");
            hdr.udp.length     : ternary @name("udp_length");
        }
        actions = { length_fits; @defaultonly length_wrong; }
        const default_action = length_wrong();
        size = 128;
    }

    action set_bits_a(bit<8> bits) { meta.expected_bits_a = bits; }
    action set_bits_b(bit<8> bits) { meta.expected_bits_b = bits; }
    action set_bits_c(bit<8> bits) { meta.expected_bits_c = bits; }

    table expected_bits_high {
        key = { hdr.agg.expected[31:21] : exact @name("chunk"); }
        actions = { set_bits_a; }
        const default_action = set_bits_a(0);
        size = 2048;
    }

    table expected_bits_mid {
        key = { hdr.agg.expected[20:10] : exact @name("chunk"); }
        actions = { set_bits_b; }
        const default_action = set_bits_b(0);
        size = 2048;
    }

    table expected_bits_low {
        key = { hdr.agg.expected[9:0] : exact @name("chunk"); }
        actions = { set_bits_c; }
        const default_action = set_bits_c(0);
        size = 1024;
    }

    action too_few_expected() {
        meta.too_few_expected = 1;
    }

    action enough_expected() {
        meta.too_few_expected = 0;
    }

    /* one entry per (a, b, c): min_count in [a + b + c + 1, 63] is too many */
    table expected_too_few {
        key = {
            meta.expected_bits_a   : exact @name("bits_a");
            meta.expected_bits_b   : exact @name("bits_b");
            meta.expected_bits_c   : exact @name("bits_c");
            hdr.agg.min_count[5:0] : range @name("min_count");
        }
        actions = { too_few_expected; @defaultonly enough_expected; }
        const default_action = enough_expected();
        size = 2048;
    }

    /* popcount(expected) = a + b + c: two dependent adds, so two tables (one action
     * cannot span stages, and the compiler merges plain assignments into one) */
    action add_bits_ab() { meta.expected_bits_ab = meta.expected_bits_a + meta.expected_bits_b; }
    action add_bits_c() { meta.expected_size = meta.expected_bits_ab + meta.expected_bits_c; }

    table expected_size_ab {
        actions = { add_bits_ab; }
        const default_action = add_bits_ab();
        size = 1;
    }

    table expected_size_abc {
        actions = { add_bits_c; }
        const default_action = add_bits_c();
        size = 1;
    }

    apply {
        agg_lengths.apply();
        expected_bits_high.apply();
        expected_bits_mid.apply();
        expected_bits_low.apply();
        meta.ip_len_gap = hdr.ipv4.total_len - hdr.udp.length;
        expected_too_few.apply();     /* min_count >= 64 is tested on the packet field */
        meta.slot_gap = (bit<32>)hdr.agg.slot - (bit<32>)meta.pool_size;
        meta.values_gap = (bit<32>)meta.values_per_packet - (bit<32>)hdr.agg.num_values;
        meta.members_gap = (bit<16>)meta.member_count - (bit<16>)hdr.agg.min_count;
        meta.stray_workers = hdr.agg.expected & meta.nonmember_mask;
        meta.worker_expected = hdr.agg.expected & meta.worker_bit;
        expected_size_ab.apply();
        expected_size_abc.apply();
        /* Rule R3 as single tests: the whole condition in one if is more than one gateway
         * can evaluate. */
        meta.unsatisfiable = 0;
        if (meta.stray_workers != 0) {
            meta.unsatisfiable = 1;                   /* expected names non-members */
        }
        if (hdr.agg.min_count != 0) {
            if (hdr.agg.expected != 0) {
                if (meta.too_few_expected == 1) {
                    meta.unsatisfiable = 1;           /* min_count > popcount(expected) */
                }
                if (hdr.agg.min_count[7:6] != 0) {
                    meta.unsatisfiable = 1;           /* min_count >= 64 */
                }
            } else if (meta.members_gap[15:15] == 1) {
                meta.unsatisfiable = 1;               /* min_count > the job's members */
            }
        }
    }
}

#endif
