/* The inputs of the ordered checks of protocol.md 4.1; the checks themselves are one
 * priority-ordered ternary table (agg_checks, thc_ina.p4). Tofino's gateways read at most
 * 4 bytes + 12 bits of PHV, and a chain of ifs over a dozen fields does not fit, so every
 * comparison here ends in a flag or a sign bit that agg_checks matches:
 *
 *   - "a > b" of two fields: subtracted in one stage (*_gap), the sign bit matched later;
 *   - "field != constant": a constant table (header_checks, worker_in_expected);
 *   - expected & ~members != 0: one ternary entry per job (expected_in_job);
 *   - popcount(expected) (rule R3, the expected-set completion): three exact tables on
 *     11/11/10-bit chunks of expected; "min_count > popcount(expected)" is one range
 *     table on the three chunk counts.
 *
 * The tables that are not constant hold protocol constants or per-job values installed by
 * the control plane (bfrt_scripts/tofino_plan.py: validation_entries, job_entries). */
#ifndef _THC_INA_TNA_VALIDATION_P4_
#define _THC_INA_TNA_VALIDATION_P4_

control AggValidation(in headers_t hdr,
                      inout ingress_metadata_t meta,
                      in ingress_intrinsic_metadata_from_parser_t ig_prsr_md) {
    /* (round & 1) ++ slot_index through the hash unit: an ALU concatenation would tie the
     * round's bit 0 and the slot index to one container layout */
    Hash<copy_index_t>(HashAlgorithm_t.IDENTITY) copy_of_slot;

    action set_header_check(bit<2> check) {
        meta.header_check = check;
    }

    /* version first, then the type (protocol.md 4.1 order) */
    table header_checks {
        key = {
            hdr.agg.version  : ternary @name("version");
            hdr.agg.pkt_type : ternary @name("pkt_type");
        }
        actions = { set_header_check; }
        const default_action = set_header_check(HEADER_BAD_VERSION);
        size = 4;
        const entries = {
            (AGG_VERSION, TYPE_DATA)  : set_header_check(HEADER_DATA);
            (AGG_VERSION, TYPE_FLUSH) : set_header_check(HEADER_FLUSH);
            (AGG_VERSION, _)          : set_header_check(HEADER_BAD_TYPE);
        }
    }

    /* IPv4 total length == 20 + UDP length == 20 + 8 + 32 + payload: DATA
     * ceil(num_values / 2) for 1..MAX_VALUES values, FLUSH 0 (its num_values ignored);
     * and the frame held it all (no parser error). */
    action length_fits() {
        meta.length_ok = 1;
    }

    action length_wrong() {
        meta.length_ok = 0;
    }

    table agg_lengths {
        key = {
            hdr.agg.pkt_type      : ternary @name("pkt_type");
            hdr.agg.num_values    : ternary @name("num_values");
            hdr.udp.length        : ternary @name("udp_length");
            hdr.ipv4.total_len    : ternary @name("ip_length");
            ig_prsr_md.parser_err : ternary @name("parser_err");
        }
        actions = { length_fits; @defaultonly length_wrong; }
        const default_action = length_wrong();
        size = 128;
    }

    action set_in_expected(bit<1> named) {
        meta.in_expected = named;
    }

#define WORKER_IN_EXPECTED(w) (w, (32w1 << w) &&& (32w1 << w)): set_in_expected(1);
    /* expected & (1 << worker) != 0 (Tofino has no shift by a field) */
    table worker_in_expected {
        key = {
            hdr.agg.worker   : exact @name("worker");
            hdr.agg.expected : ternary @name("expected");
        }
        actions = { set_in_expected; }
        const default_action = set_in_expected(0);
        size = 32;
        const entries = {
            WORKER_IN_EXPECTED(0)  WORKER_IN_EXPECTED(1)  WORKER_IN_EXPECTED(2)
            WORKER_IN_EXPECTED(3)  WORKER_IN_EXPECTED(4)  WORKER_IN_EXPECTED(5)
            WORKER_IN_EXPECTED(6)  WORKER_IN_EXPECTED(7)  WORKER_IN_EXPECTED(8)
            WORKER_IN_EXPECTED(9)  WORKER_IN_EXPECTED(10) WORKER_IN_EXPECTED(11)
            WORKER_IN_EXPECTED(12) WORKER_IN_EXPECTED(13) WORKER_IN_EXPECTED(14)
            WORKER_IN_EXPECTED(15) WORKER_IN_EXPECTED(16) WORKER_IN_EXPECTED(17)
            WORKER_IN_EXPECTED(18) WORKER_IN_EXPECTED(19) WORKER_IN_EXPECTED(20)
            WORKER_IN_EXPECTED(21) WORKER_IN_EXPECTED(22) WORKER_IN_EXPECTED(23)
            WORKER_IN_EXPECTED(24) WORKER_IN_EXPECTED(25) WORKER_IN_EXPECTED(26)
            WORKER_IN_EXPECTED(27) WORKER_IN_EXPECTED(28) WORKER_IN_EXPECTED(29)
            WORKER_IN_EXPECTED(30) WORKER_IN_EXPECTED(31)
        }
    }

    action members_only() {
        meta.expected_strays = 0;
    }

    action names_strays() {
        meta.expected_strays = 1;
    }

    /* one entry per job: (job, 0 &&& ~member_mask), i.e. no bit outside the members */
    table expected_in_job {
        key = {
            hdr.agg.job      : exact @name("job");
            hdr.agg.expected : ternary @name("expected");
        }
        actions = { members_only; @defaultonly names_strays; }
        const default_action = names_strays();
        size = MAX_JOBS;
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
        header_checks.apply();
        agg_lengths.apply();
        worker_in_expected.apply();
        expected_in_job.apply();
        expected_bits_high.apply();
        expected_bits_mid.apply();
        expected_bits_low.apply();
        expected_too_few.apply();     /* min_count >= 64 is matched on the packet field */
        /* 16/16/8-bit differences: operands and result share a container size (PHV);
         * agg_checks matches them only where their sign is right (see its rows) */
        meta.slot_gap = hdr.agg.slot - meta.pool_size;
        meta.values_gap = meta.values_per_packet - hdr.agg.num_values;
        meta.members_gap = meta.member_count - hdr.agg.min_count;
        expected_size_ab.apply();
        expected_size_abc.apply();
        /* the slot state's inputs, for every packet: agg_checks' accepting actions use
         * slot_index in the stage right after this one, copy_round the copy index in the
         * stage after that (computed behind no gateway, so without a stage of its own) */
        meta.slot_index = meta.slot_base + (slot_index_t)hdr.agg.slot;
        meta.copy_index = copy_of_slot.get({hdr.agg.round[0:0], meta.slot_index});
    }
}

#endif
