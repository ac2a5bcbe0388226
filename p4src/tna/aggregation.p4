/* Slot state machine (protocol.md section 4), the RESULT / STRAGGLER it emits (section 5).
 *
 * Storage. Every (job, slot) owns two copies selected by round parity: register cell
 * copy_index = (round & 1) ++ (slot_base + slot) of every per-copy register below. Sums are
 * 8-bit lanes packed four to a 32-bit cell; a RegisterAction adds the packet's four table
 * values with ONE 32-bit add: set-up refuses n * max(T) > 255 (tofino_plan.py), so no lane
 * ever carries into the next one and the 32-bit add is the per-lane add of the reference.
 *
 * Tofino's rules shape the state machine: a register is read-modified-written at most once
 * per pass, by one stateful ALU with two comparisons and (Tofino 1) ONE 32-bit result.
 * So the state of a copy is split over registers in consecutive stages, each answering one
 * question for the next:
 *
 *   occupancy[slot]        {copy0, copy1}: 1 once a round started in the copy, 0 after a
 *                          FLUSH. One cell holds both copies, so a FLUSH clears the whole
 *                          slot in one pass: an unoccupied copy is "empty" (protocol 4.2),
 *                          and every other register of it is rewritten by the next round
 *                          before anything reads it. It is run by agg_checks' accepting
 *                          actions (thc_ina.p4), in the stage that accepts the packet.
 *   copy_round[copy]       the copy's round; answers r - R (rule R1: r newer iff that
 *                          32-bit difference is nonzero with the top bit clear).
 *   copy_seen[copy]        workers that sent this round (late workers included); answers
 *                          "did this worker send already".
 *   copy_left[copy]        contributions still missing before the round completes: set to
 *                          target - 1 by the first one, target = min_count, or
 *                          popcount(expected) under the expected-set rule (the protocol lets
 *                          only expected workers contribute, so bitmap == expected exactly
 *                          when popcount(expected) of them did). 0 means done.
 *   copy_contributors[copy] the protocol's bitmap (late workers excluded).
 *   result_*[copy]         the completing packet's expected, min_count, tensor, offset,
 *                          num_values, for re-serves.
 *   sums_k[copy]           lanes 4k..4k+3, k = 0..15.
 *
 * Each register has one RegisterAction per thing a packet may do to it (start a round,
 * join it, read it) and every pass executes at most one of them (tests/tofino checks it).
 *
 * Decisions. What a packet does to the contributor bitmap, the result fields and the sum
 * words, and its outcome, follow from four answers: fresh, same_round (copy_round),
 * already_seen (copy_seen), left_before (copy_left), and the round's target_left. Every
 * register after copy_left is ONE constant ternary table on those answers (DECISION_KEY),
 * rows in the order of protocol.md 4.2: no stage spent first storing a verdict, and the
 * 22 stateful ALUs of the result start right after copy_left. */
#ifndef _THC_INA_TNA_AGGREGATION_P4_
#define _THC_INA_TNA_AGGREGATION_P4_

/* The answers every decision table keys on (rows: `fresh, same, seen, left, target_left`).
 * already_seen is the worker's bit of the seen bitmap (0 = first packet of this worker). */
#define DECISION_KEY                                        \
    meta.fresh        : ternary @name("fresh");             \
    meta.same_round   : ternary @name("same_round");        \
    meta.already_seen : ternary @name("already_seen");      \
    meta.left_before  : ternary @name("left_before");       \
    meta.target_left  : ternary @name("target_left");

struct occupancy_t {
    bit<8> copy0;
    bit<8> copy1;
}

/* Round classification and contribution tracking: the answers the decisions key on. */
control SlotState(in headers_t hdr, inout ingress_metadata_t meta) {
    Register<bit<32>, copy_index_t>(SLOT_COPIES) copy_round;

    /* r - R from the old R (the alu_hi output of a 32-bit cell); the copy takes round r
     * when r is newer (rule R1) or the copy was empty. */
    RegisterAction<bit<32>, copy_index_t, bit<32>>(copy_round) advance_round = {
        void apply(inout bit<32> round, out bit<32> distance) {
            distance = hdr.agg.round - round;
            if (meta.was_occupied == 0 || (int<32>)(hdr.agg.round - round) > 0) {
                round = hdr.agg.round;
            }
        }
    };

    Register<bit<32>, copy_index_t>(SLOT_COPIES) copy_seen;

    RegisterAction<bit<32>, copy_index_t, bit<32>>(copy_seen) start_seen = {
        void apply(inout bit<32> seen) {
            seen = meta.worker_bit;
        }
    };

    RegisterAction<bit<32>, copy_index_t, bit<32>>(copy_seen) join_seen = {
        void apply(inout bit<32> seen, out bit<32> before) {
            before = seen & meta.worker_bit;
            seen = seen | meta.worker_bit;
        }
    };

    Register<bit<8>, copy_index_t>(SLOT_COPIES) copy_left;

    RegisterAction<bit<8>, copy_index_t, bit<8>>(copy_left) start_left = {
        void apply(inout bit<8> left) {
            left = meta.target_left;
        }
    };

    RegisterAction<bit<8>, copy_index_t, bit<8>>(copy_left) join_left = {
        void apply(inout bit<8> left, out bit<8> before) {
            before = left;
            if (left != 0) {
                left = left - 1;
            }
        }
    };

    RegisterAction<bit<8>, copy_index_t, bit<8>>(copy_left) read_left = {
        void apply(inout bit<8> left, out bit<8> before) {
            before = left;
        }
    };

    action take_round() { meta.round_distance = advance_round.execute(meta.copy_index); }

    action begin_round() {
        meta.fresh = 1;
        start_seen.execute(meta.copy_index);
    }

    action join_round() {
        meta.same_round = 1;
        meta.already_seen = join_seen.execute(meta.copy_index);
    }

    action count_first() { start_left.execute(meta.copy_index); }
    action count_join() { meta.left_before = join_left.execute(meta.copy_index); }
    action count_read() { meta.left_before = read_left.execute(meta.copy_index); }

    action target_from_min_count() {
        meta.target_left = hdr.agg.min_count - 1;           /* k of n */
    }

    action target_from_expected() {
        meta.target_left = meta.expected_size - 1;          /* the expected set */
    }

    /* target - 1 for copy_left: min_count, or popcount(expected) when min_count is 0 and
     * expected is not. Here, behind agg_checks, and a table, not an if: in front of the
     * 4.1 checks it held agg_checks (and the whole chain) back to its own stage, as the
     * checks may rewrite min_count (a re-serve loads it) only after it was read. */
    table round_target {
        key = {
            meta.expected_size : ternary @name("expected_size");
            hdr.agg.min_count  : ternary @name("min_count");
        }
        actions = { target_from_min_count; target_from_expected; }
        const default_action = target_from_min_count();
        size = 2;
        const entries = {
            (0, _) : target_from_min_count();           /* no expected set: k of n */
            (_, 0) : target_from_expected();
        }
    }

    action set_outcome(bit<3> outcome) {
        meta.outcome = outcome;
    }

    /* protocol.md 4.2 step 3 and 4.3, first matching row (fresh, same, seen, left, tl) */
    table packet_outcome {
        key = { DECISION_KEY }
        actions = { set_outcome; }
        const default_action = set_outcome(OUTCOME_NONE);
        size = 8;
        const entries = {
            (1, _, _, _, 0) : set_outcome(OUTCOME_COMPLETE);    /* a target of one */
            (1, _, _, _, _) : set_outcome(OUTCOME_PENDING);
            (_, 1, _, 0, _) : set_outcome(OUTCOME_RESERVE);     /* done: the stored result */
            (_, 1, 0, 1, _) : set_outcome(OUTCOME_COMPLETE);    /* the last contribution */
            (_, 1, 0, _, _) : set_outcome(OUTCOME_PENDING);
            (_, 1, _, _, _) : set_outcome(OUTCOME_DUPLICATE);
            (0, 0, _, _, _) : set_outcome(OUTCOME_STRAGGLER);   /* an older round */
        }
    }

    apply {
        round_target.apply();
        take_round();
        /* protocol.md 4.2 with rule R1, straight from the two registers' answers (a
         * stage that first stored the verdict would cost the sums a stage) */
        if (meta.was_occupied == 0 ||
            (meta.round_distance != 0 && meta.round_distance[31:31] == 0)) {
            begin_round();
        } else if (meta.round_distance == 0) {
            join_round();
        }                       /* else an older round: neither, a STRAGGLER (packet_outcome) */
        if (meta.fresh == 1) {
            count_first();
        } else if (meta.same_round == 1) {
            if (meta.already_seen == 0) {
                count_join();
            } else {
                count_read();
            }
        }
        packet_outcome.apply();
    }
}

/* One aggregation block: lanes 4k..4k+3 of every copy (THC: four 8-bit values added by
 * one 32-bit register ALU pass). The output is the copy's sum after this packet: the
 * RESULT payload of a completing packet or of a re-serve. */
control SumWord(in ingress_metadata_t meta,
                in bit<32> values,
                inout bit<32> sums) {
    Register<bit<32>, copy_index_t>(SLOT_COPIES) lanes;

    RegisterAction<bit<32>, copy_index_t, bit<32>>(lanes) first_values = {
        void apply(inout bit<32> cell, out bit<32> result) {
            cell = values;
            result = cell;
        }
    };

    RegisterAction<bit<32>, copy_index_t, bit<32>>(lanes) add_values = {
        void apply(inout bit<32> cell, out bit<32> result) {
            cell = cell + values;
            result = cell;
        }
    };

    RegisterAction<bit<32>, copy_index_t, bit<32>>(lanes) read_values = {
        void apply(inout bit<32> cell, out bit<32> result) {
            result = cell;
        }
    };

    action start_sum() { sums = first_values.execute(meta.copy_index); }
    action add_sum() { sums = add_values.execute(meta.copy_index); }
    action read_sum() { sums = read_values.execute(meta.copy_index); }
    action leave_sum() { }

    table sum_word {
        key = { DECISION_KEY }
        actions = { start_sum; add_sum; read_sum; leave_sum; }
        const default_action = leave_sum();             /* duplicate, STRAGGLER */
        size = 4;
        const entries = {
            (1, _, _, _, _) : start_sum();
            (_, 1, _, 0, _) : read_sum();               /* re-serve, late worker */
            (_, 1, 0, _, _) : add_sum();                /* aggregate */
        }
    }

    apply {
        sum_word.apply();
    }
}

/* The contributor bitmap and the completing packet's header fields (for re-serves,
 * protocol.md 5.2). A STRAGGLER reads the bitmap (5.3). */
control ResultFields(inout headers_t hdr, in ingress_metadata_t meta) {
    Register<bit<32>, copy_index_t>(SLOT_COPIES) copy_contributors;

    RegisterAction<bit<32>, copy_index_t, bit<32>>(copy_contributors) first_contributor = {
        void apply(inout bit<32> bitmap, out bit<32> result) {
            bitmap = meta.worker_bit;
            result = bitmap;
        }
    };

    RegisterAction<bit<32>, copy_index_t, bit<32>>(copy_contributors) add_contributor = {
        void apply(inout bit<32> bitmap, out bit<32> result) {
            bitmap = bitmap | meta.worker_bit;
            result = bitmap;
        }
    };

    RegisterAction<bit<32>, copy_index_t, bit<32>>(copy_contributors) read_contributors = {
        void apply(inout bit<32> bitmap, out bit<32> result) {
            result = bitmap;
        }
    };

    Register<bit<32>, copy_index_t>(SLOT_COPIES) result_expected;
    Register<bit<32>, copy_index_t>(SLOT_COPIES) result_tensor;
    Register<bit<32>, copy_index_t>(SLOT_COPIES) result_offset;
    Register<bit<16>, copy_index_t>(SLOT_COPIES) result_num_values;
    Register<bit<8>,  copy_index_t>(SLOT_COPIES) result_min_count;

    RegisterAction<bit<32>, copy_index_t, bit<32>>(result_expected) store_expected = {
        void apply(inout bit<32> value) { value = hdr.agg.expected; } };
    RegisterAction<bit<32>, copy_index_t, bit<32>>(result_expected) load_expected = {
        void apply(inout bit<32> value, out bit<32> stored) { stored = value; } };
    RegisterAction<bit<32>, copy_index_t, bit<32>>(result_tensor) store_tensor = {
        void apply(inout bit<32> value) { value = hdr.agg.tensor; } };
    RegisterAction<bit<32>, copy_index_t, bit<32>>(result_tensor) load_tensor = {
        void apply(inout bit<32> value, out bit<32> stored) { stored = value; } };
    RegisterAction<bit<32>, copy_index_t, bit<32>>(result_offset) store_offset = {
        void apply(inout bit<32> value) { value = hdr.agg.offset; } };
    RegisterAction<bit<32>, copy_index_t, bit<32>>(result_offset) load_offset = {
        void apply(inout bit<32> value, out bit<32> stored) { stored = value; } };
    RegisterAction<bit<16>, copy_index_t, bit<16>>(result_num_values) store_num_values = {
        void apply(inout bit<16> value) { value = hdr.agg.num_values; } };
    RegisterAction<bit<16>, copy_index_t, bit<16>>(result_num_values) load_num_values = {
        void apply(inout bit<16> value, out bit<16> stored) { stored = value; } };
    RegisterAction<bit<8>, copy_index_t, bit<8>>(result_min_count) store_min_count = {
        void apply(inout bit<8> value) { value = hdr.agg.min_count; } };
    RegisterAction<bit<8>, copy_index_t, bit<8>>(result_min_count) load_min_count = {
        void apply(inout bit<8> value, out bit<8> stored) { stored = value; } };

    action start_bitmap() { hdr.agg.contributors = first_contributor.execute(meta.copy_index); }
    action join_bitmap() { hdr.agg.contributors = add_contributor.execute(meta.copy_index); }
    action read_bitmap() { hdr.agg.contributors = read_contributors.execute(meta.copy_index); }

    /* one action per register: each stateful ALU is placed in its own stage slot */
    action store_expected_field()   { store_expected.execute(meta.copy_index); }
    action store_tensor_field()     { store_tensor.execute(meta.copy_index); }
    action store_offset_field()     { store_offset.execute(meta.copy_index); }
    action store_num_values_field() { store_num_values.execute(meta.copy_index); }
    action store_min_count_field()  { store_min_count.execute(meta.copy_index); }
    action load_expected_field()    { hdr.agg.expected = load_expected.execute(meta.copy_index); }
    action load_tensor_field()      { hdr.agg.tensor = load_tensor.execute(meta.copy_index); }
    action load_offset_field()      { hdr.agg.offset = load_offset.execute(meta.copy_index); }
    action load_num_values_field() {
        hdr.agg.num_values = load_num_values.execute(meta.copy_index);
    }
    action load_min_count_field() {
        hdr.agg.min_count = load_min_count.execute(meta.copy_index);
    }

    action leave_fields() { }

    table contributor_bitmap {
        key = { DECISION_KEY }
        actions = { start_bitmap; join_bitmap; read_bitmap; leave_fields; }
        const default_action = leave_fields();
        size = 4;
        const entries = {
            (1, _, _, _, _) : start_bitmap();
            (_, 1, _, 0, _) : read_bitmap();            /* re-serve, late worker */
            (_, 1, 0, _, _) : join_bitmap();            /* aggregate */
            (0, 0, _, _, _) : read_bitmap();            /* STRAGGLER (5.3) */
        }
    }

    /* a completion stores the field, a re-serve loads it back into the header */
#define RESULT_FIELD(field)                                                         \
    table keep_##field {                                                            \
        key = { DECISION_KEY }                                                      \
        actions = { store_##field##_field; load_##field##_field; leave_fields; }    \
        const default_action = leave_fields();                                      \
        size = 4;                                                                   \
        const entries = {                                                           \
            (1, _, _, _, 0) : store_##field##_field();  /* completes at once */     \
            (_, 1, _, 0, _) : load_##field##_field();   /* re-serve */              \
            (_, 1, 0, 1, _) : store_##field##_field();  /* the last contribution */ \
        }                                                                           \
    }
    RESULT_FIELD(num_values)
    RESULT_FIELD(expected)
    RESULT_FIELD(tensor)
    RESULT_FIELD(offset)
    RESULT_FIELD(min_count)

    apply {
        /* one table per register: one call site per register action */
        contributor_bitmap.apply();
        keep_num_values.apply();      /* first: the RESULT's word count waits for it */
        keep_expected.apply();
        keep_tensor.apply();
        keep_offset.apply();
        keep_min_count.apply();
    }
}

/* words_k: the first k sum words go out; the RESULT's last word may be partial
 * (num_values % 4 != 0), its unused lanes trail the datagram as link-layer padding
 * (protocol.md 5.1; Tofino cannot cut a container short). */
#define RESULT_WORDS_ACTION(k, prev) \
    action words_##k() { words_##prev(); hdr.sums[k - 1].setValid(); }
#define RESULT_WORDS_ENTRIES(k) \
    (4 * k - 3): words_##k(); (4 * k - 2): words_##k(); \
    (4 * k - 1): words_##k(); (4 * k): words_##k();

/* Turns the DATA packet into the RESULT or STRAGGLER of protocol.md section 5 and sends it
 * on: the TM multicasts a completion to the job's group, re-serves and notices go back out
 * of the ingress port. Addressing, count, LATE and lengths are set per copy in egress. */
control BuildAggReply(inout headers_t hdr,
                      inout ingress_metadata_t meta,
                      in ingress_intrinsic_metadata_t ig_intr_md,
                      inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    action invalidate_indices() {
        hdr.idx[0].setInvalid();  hdr.idx[1].setInvalid();  hdr.idx[2].setInvalid();
        hdr.idx[3].setInvalid();  hdr.idx[4].setInvalid();  hdr.idx[5].setInvalid();
        hdr.idx[6].setInvalid();  hdr.idx[7].setInvalid();  hdr.idx[8].setInvalid();
        hdr.idx[9].setInvalid();  hdr.idx[10].setInvalid(); hdr.idx[11].setInvalid();
        hdr.idx[12].setInvalid(); hdr.idx[13].setInvalid(); hdr.idx[14].setInvalid();
        hdr.idx[15].setInvalid(); hdr.idx[16].setInvalid(); hdr.idx[17].setInvalid();
        hdr.idx[18].setInvalid(); hdr.idx[19].setInvalid(); hdr.idx[20].setInvalid();
        hdr.idx[21].setInvalid(); hdr.idx[22].setInvalid(); hdr.idx[23].setInvalid();
        hdr.idx[24].setInvalid(); hdr.idx[25].setInvalid(); hdr.idx[26].setInvalid();
        hdr.idx[27].setInvalid(); hdr.idx[28].setInvalid(); hdr.idx[29].setInvalid();
        hdr.idx[30].setInvalid(); hdr.idx[31].setInvalid();
    }

    action words_0() { }
    RESULT_WORDS_ACTION(1, 0)   RESULT_WORDS_ACTION(2, 1)   RESULT_WORDS_ACTION(3, 2)
    RESULT_WORDS_ACTION(4, 3)   RESULT_WORDS_ACTION(5, 4)   RESULT_WORDS_ACTION(6, 5)
    RESULT_WORDS_ACTION(7, 6)   RESULT_WORDS_ACTION(8, 7)   RESULT_WORDS_ACTION(9, 8)
    RESULT_WORDS_ACTION(10, 9)  RESULT_WORDS_ACTION(11, 10) RESULT_WORDS_ACTION(12, 11)
    RESULT_WORDS_ACTION(13, 12) RESULT_WORDS_ACTION(14, 13) RESULT_WORDS_ACTION(15, 14)
    RESULT_WORDS_ACTION(16, 15)

    /* ceil(num_values / 4) words (a STRAGGLER's num_values is 0: none). A table, not a
     * chain of "num_values > 4k" tests: a gateway compares at most 12 bits by range. */
    table result_words {
        key = { hdr.agg.num_values : exact @name("num_values"); }
        actions = {
            words_0;  words_1;  words_2;  words_3;  words_4;  words_5;  words_6;  words_7;
            words_8;  words_9;  words_10; words_11; words_12; words_13; words_14; words_15;
            words_16;
        }
        const default_action = words_0();
        size = MAX_VALUES;
        const entries = {
            RESULT_WORDS_ENTRIES(1)  RESULT_WORDS_ENTRIES(2)  RESULT_WORDS_ENTRIES(3)
            RESULT_WORDS_ENTRIES(4)  RESULT_WORDS_ENTRIES(5)  RESULT_WORDS_ENTRIES(6)
            RESULT_WORDS_ENTRIES(7)  RESULT_WORDS_ENTRIES(8)  RESULT_WORDS_ENTRIES(9)
            RESULT_WORDS_ENTRIES(10) RESULT_WORDS_ENTRIES(11) RESULT_WORDS_ENTRIES(12)
            RESULT_WORDS_ENTRIES(13) RESULT_WORDS_ENTRIES(14) RESULT_WORDS_ENTRIES(15)
            RESULT_WORDS_ENTRIES(16)
        }
    }

    action multicast_result() {
        hdr.agg.pkt_type = TYPE_RESULT;
        hdr.agg.flags = 0;
        hdr.agg.reserved = 0;
        ig_tm_md.mcast_grp_a = meta.group;      /* one PRE node per member, rid = worker */
        hdr.bridge.kind = BRIDGE_AGG_MULTICAST;
    }

    action reserve_result() {
        hdr.agg.pkt_type = TYPE_RESULT;
        hdr.agg.flags = FLAG_RESERVE;           /* LATE added in egress (contributors) */
        hdr.agg.reserved = 0;
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
        hdr.bridge.kind = BRIDGE_AGG_UNICAST;
        hdr.bridge.dest_worker = hdr.agg.worker;
    }

    action straggler_notice() {
        /* the received header otherwise (flags, reserved included), 5.3 */
        hdr.agg.pkt_type = TYPE_STRAGGLER;
        hdr.agg.num_values = 0;
        /* the copy's round is round - round_distance, subtracted in egress: here the
         * operands are sliced for the parity and the R1 sign, more sources than one
         * ingress action may read */
        hdr.bridge.round_back = meta.round_distance;
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
        hdr.bridge.kind = BRIDGE_AGG_UNICAST;
        hdr.bridge.dest_worker = hdr.agg.worker;
    }

    apply {
        invalidate_indices();                   /* the indices never leave the switch */
        if (meta.outcome == OUTCOME_COMPLETE) {
            multicast_result();
        } else if (meta.outcome == OUTCOME_RESERVE) {
            reserve_result();
        } else {
            straggler_notice();
        }
        result_words.apply();
    }
}

/* Egress, per copy: count = popcount(contributors) (four byte tables), the LATE flag of a
 * re-serve for a worker whose values are not in the sums, and the lengths. */
control ResultShape(inout headers_t hdr, inout egress_metadata_t meta) {
    action set_bits_a(bit<8> bits) { meta.contributors_a = bits; }
    action set_bits_b(bit<8> bits) { meta.contributors_b = bits; }
    action set_bits_c(bit<8> bits) { meta.contributors_c = bits; }
    action set_bits_d(bit<8> bits) { meta.contributors_d = bits; }

    table contributor_bits_0 {
        key = { hdr.agg.contributors[31:24] : exact @name("byte"); }
        actions = { set_bits_a; }
        const default_action = set_bits_a(0);
        size = 256;
    }

    table contributor_bits_1 {
        key = { hdr.agg.contributors[23:16] : exact @name("byte"); }
        actions = { set_bits_b; }
        const default_action = set_bits_b(0);
        size = 256;
    }

    table contributor_bits_2 {
        key = { hdr.agg.contributors[15:8] : exact @name("byte"); }
        actions = { set_bits_c; }
        const default_action = set_bits_c(0);
        size = 256;
    }

    table contributor_bits_3 {
        key = { hdr.agg.contributors[7:0] : exact @name("byte"); }
        actions = { set_bits_d; }
        const default_action = set_bits_d(0);
        size = 256;
    }

    /* count = (a + b) + (c + d): dependent adds in separate tables (separate stages) */
    action add_pairs() {
        meta.contributors_ab = meta.contributors_a + meta.contributors_b;
        meta.contributors_cd = meta.contributors_c + meta.contributors_d;
    }
    action add_count() { hdr.agg.count = meta.contributors_ab + meta.contributors_cd; }

    table contributor_pairs {
        actions = { add_pairs; }
        const default_action = add_pairs();
        size = 1;
    }

    table contributor_count {
        actions = { add_count; }
        const default_action = add_count();
        size = 1;
    }

    action set_dest_in_sums(bit<1> named) {
        meta.dest_in_sums = named;
    }

#define DEST_CONTRIBUTED(w) (w, (32w1 << w) &&& (32w1 << w)): set_dest_in_sums(1);
    /* contributors & (1 << dest worker) != 0 (Tofino has no shift by a field) */
    table dest_contributed {
        key = {
            meta.dest_worker     : exact @name("worker");
            hdr.agg.contributors : ternary @name("contributors");
        }
        actions = { set_dest_in_sums; }
        const default_action = set_dest_in_sums(0);
        size = 32;
        const entries = {
            DEST_CONTRIBUTED(0)  DEST_CONTRIBUTED(1)  DEST_CONTRIBUTED(2)  DEST_CONTRIBUTED(3)
            DEST_CONTRIBUTED(4)  DEST_CONTRIBUTED(5)  DEST_CONTRIBUTED(6)  DEST_CONTRIBUTED(7)
            DEST_CONTRIBUTED(8)  DEST_CONTRIBUTED(9)  DEST_CONTRIBUTED(10) DEST_CONTRIBUTED(11)
            DEST_CONTRIBUTED(12) DEST_CONTRIBUTED(13) DEST_CONTRIBUTED(14) DEST_CONTRIBUTED(15)
            DEST_CONTRIBUTED(16) DEST_CONTRIBUTED(17) DEST_CONTRIBUTED(18) DEST_CONTRIBUTED(19)
            DEST_CONTRIBUTED(20) DEST_CONTRIBUTED(21) DEST_CONTRIBUTED(22) DEST_CONTRIBUTED(23)
            DEST_CONTRIBUTED(24) DEST_CONTRIBUTED(25) DEST_CONTRIBUTED(26) DEST_CONTRIBUTED(27)
            DEST_CONTRIBUTED(28) DEST_CONTRIBUTED(29) DEST_CONTRIBUTED(30) DEST_CONTRIBUTED(31)
        }
    }

    apply {
        contributor_bits_0.apply();
        contributor_bits_1.apply();
        contributor_bits_2.apply();
        contributor_bits_3.apply();
        contributor_pairs.apply();
        contributor_count.apply();
        if (hdr.agg.pkt_type == TYPE_STRAGGLER) {
            hdr.agg.round = hdr.agg.round - hdr.bridge.round_back;
        }
        dest_contributed.apply();
        if (hdr.agg.pkt_type == TYPE_RESULT && hdr.agg.flags == FLAG_RESERVE &&
            meta.dest_in_sums == 0) {
            hdr.agg.flags = FLAG_RESERVE | FLAG_LATE;
        }
        hdr.udp.length = UDP_HEADER_LEN + AGG_HEADER_LEN + hdr.agg.num_values;
        hdr.ipv4.total_len = IPV4_HEADER_LEN + hdr.udp.length;
    }
}

#endif
