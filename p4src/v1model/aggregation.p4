/* Slot state machine (protocol.md section 4) and the RESULT / STRAGGLER it emits (section 5).
 *
 * Storage: every (job, slot) owns two copies selected by round parity; cell
 * copy_index = (slot_base + slot) * 2 + (round & 1) of every register below.
 * Sums are 8-bit lanes packed eight to a 64-bit word (lane 8j+i = byte i of word j
 * from the top), added lane-wise modulo 256 without carries between lanes.
 *
 * BMv2 ignores @atomic and instead locks every register an action touches for the
 * whole action, so the entire read-modify-write of a copy is ONE branch-free action
 * (p4c's BMv2 back end does not allow extern calls under a condition inside an action). */
#ifndef _THC_INA_AGGREGATION_P4_
#define _THC_INA_AGGREGATION_P4_

#define LANE_LOW7  64w0x7F7F7F7F7F7F7F7F
#define LANE_HIGH1 64w0x8080808080808080
/* Per-lane (a + b) mod 256: add the low 7 bits (no carry can leave a lane),
 * then fix each lane's top bit with an xor. */
#define LANE_ADD(a, b) ((((a) & LANE_LOW7) + ((b) & LANE_LOW7)) ^ (((a) ^ (b)) & LANE_HIGH1))

#define VALUE_WORD(a, b, c, d) \
    (meta.values.p##a ++ meta.values.p##b ++ meta.values.p##c ++ meta.values.p##d)

#define READ_WORD(k)  bit<64> s##k; sums_##k.read(s##k, i); s##k = fresh ? 64w0 : s##k;
#define ADD_WORD(k, a, b, c, d) \
    s##k = aggregate ? LANE_ADD(s##k, VALUE_WORD(a, b, c, d)) : s##k; \
    sums_##k.write(i, s##k); meta.sums.w##k = s##k;
#define CLEAR_WORD(k) sums_##k.write(first, 0); sums_##k.write(first + 1, 0);

control SlotAggregation(inout headers_t hdr, inout metadata_t meta) {
    register<bit<32>, bit<32>>(SLOT_COPIES) copy_round;
    register<bit<32>, bit<32>>(SLOT_COPIES) copy_bitmap;
    register<bit<8>,  bit<32>>(SLOT_COPIES) copy_count;
    register<bit<1>,  bit<32>>(SLOT_COPIES) copy_done;
    /* header fields of the completing packet, for re-serves (protocol.md 5.2) */
    register<bit<32>, bit<32>>(SLOT_COPIES) result_expected;
    register<bit<8>,  bit<32>>(SLOT_COPIES) result_min_count;
    register<bit<32>, bit<32>>(SLOT_COPIES) result_tensor;
    register<bit<32>, bit<32>>(SLOT_COPIES) result_offset;
    register<bit<16>, bit<32>>(SLOT_COPIES) result_num_values;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_0;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_1;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_2;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_3;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_4;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_5;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_6;
    register<bit<64>, bit<32>>(SLOT_COPIES) sums_7;

    /* DATA on one copy: new-round reset, obsolete check, duplicate / re-serve,
     * aggregate and completion, all in one action (one lock scope in BMv2). */
    action run_state_machine() {
        bit<32> i = meta.copy_index;
        bit<32> round;  copy_round.read(round, i);
        bit<32> bitmap; copy_bitmap.read(bitmap, i);
        bit<8>  count;  copy_count.read(count, i);
        bit<1>  done;   copy_done.read(done, i);
        bit<32> r_expected;   result_expected.read(r_expected, i);
        bit<8>  r_min_count;  result_min_count.read(r_min_count, i);
        bit<32> r_tensor;     result_tensor.read(r_tensor, i);
        bit<32> r_offset;     result_offset.read(r_offset, i);
        bit<16> r_num_values; result_num_values.read(r_num_values, i);

        /* 4.2: rounds in serial-number order (newer: the 32-bit difference is
         * nonzero with its top bit clear); step 1: a newer round, or an empty
         * copy, starts afresh */
        bit<32> d = hdr.agg.round - round;
        bool newer = d != 0 && d[31:31] == 0;
        bool fresh = newer || bitmap == 0;
        /* 4.2 step 2: any other round is older, obsolete (never changes the copy) */
        bool obsolete = !fresh && hdr.agg.round != round;
        round  = fresh ? hdr.agg.round : round;
        bitmap = fresh ? 32w0 : bitmap;
        count  = fresh ? 8w0 : count;
        done   = fresh ? 1w0 : done;

        /* 4.2 step 3 */
        bool already_in = (bitmap & meta.worker_bit) != 0;
        bool aggregate = !obsolete && !already_in && done == 0;
        bitmap = aggregate ? (bitmap | meta.worker_bit) : bitmap;
        count  = aggregate ? count + 1 : count;
        /* 4.3: k of n when min_count > 0, else the expected set */
        bool complete = aggregate &&
            ((hdr.agg.min_count != 0 && count >= hdr.agg.min_count) ||
             (hdr.agg.min_count == 0 && bitmap == hdr.agg.expected));
        done = complete ? 1w1 : done;
        r_expected   = complete ? hdr.agg.expected   : r_expected;
        r_min_count  = complete ? hdr.agg.min_count  : r_min_count;
        r_tensor     = complete ? hdr.agg.tensor     : r_tensor;
        r_offset     = complete ? hdr.agg.offset     : r_offset;
        r_num_values = complete ? hdr.agg.num_values : r_num_values;

        READ_WORD(0) READ_WORD(1) READ_WORD(2) READ_WORD(3)
        READ_WORD(4) READ_WORD(5) READ_WORD(6) READ_WORD(7)
        ADD_WORD(0,  0,  1,  2,  3)
        ADD_WORD(1,  4,  5,  6,  7)
        ADD_WORD(2,  8,  9, 10, 11)
        ADD_WORD(3, 12, 13, 14, 15)
        ADD_WORD(4, 16, 17, 18, 19)
        ADD_WORD(5, 20, 21, 22, 23)
        ADD_WORD(6, 24, 25, 26, 27)
        ADD_WORD(7, 28, 29, 30, 31)

        copy_round.write(i, round);
        copy_bitmap.write(i, bitmap);
        copy_count.write(i, count);
        copy_done.write(i, done);
        result_expected.write(i, r_expected);
        result_min_count.write(i, r_min_count);
        result_tensor.write(i, r_tensor);
        result_offset.write(i, r_offset);
        result_num_values.write(i, r_num_values);

        meta.copy_round = round;
        meta.bitmap = bitmap;
        meta.count = count;
        meta.res_expected = r_expected;
        meta.res_min_count = r_min_count;
        meta.res_tensor = r_tensor;
        meta.res_offset = r_offset;
        meta.res_num_values = r_num_values;
        /* p4c does not chain ?: the way C does: every else branch is parenthesized */
        meta.outcome =
            obsolete   ? OUTCOME_STRAGGLER :
            (already_in ? (done == 1 ? OUTCOME_RESERVE : OUTCOME_DUPLICATE) :
            (done == 1  ? (complete ? OUTCOME_COMPLETE : OUTCOME_RESERVE_LATE) :
                          OUTCOME_PENDING));
    }

    /* FLUSH (protocol.md 4.6): both copies of the slot back to zero. */
    action flush_slot() {
        bit<32> first = meta.copy_index & 0xFFFFFFFE;
        copy_round.write(first, 0);        copy_round.write(first + 1, 0);
        copy_bitmap.write(first, 0);       copy_bitmap.write(first + 1, 0);
        copy_count.write(first, 0);        copy_count.write(first + 1, 0);
        copy_done.write(first, 0);         copy_done.write(first + 1, 0);
        result_expected.write(first, 0);   result_expected.write(first + 1, 0);
        result_min_count.write(first, 0);  result_min_count.write(first + 1, 0);
        result_tensor.write(first, 0);     result_tensor.write(first + 1, 0);
        result_offset.write(first, 0);     result_offset.write(first + 1, 0);
        result_num_values.write(first, 0); result_num_values.write(first + 1, 0);
        CLEAR_WORD(0) CLEAR_WORD(1) CLEAR_WORD(2) CLEAR_WORD(3)
        CLEAR_WORD(4) CLEAR_WORD(5) CLEAR_WORD(6) CLEAR_WORD(7)
    }

    apply {
        meta.copy_index = (meta.slot_base + (bit<32>)hdr.agg.slot) * 2
                          + (bit<32>)hdr.agg.round[0:0];
        if (hdr.agg.pkt_type == TYPE_FLUSH) {
            flush_slot();
        } else {
            run_state_machine();
        }
    }
}

/* Result lanes: lane `lane` is byte [hi:lo] of sum word `word`. */
#define EMIT_LANE(lane, word, hi, lo) \
    if (meta.res_num_values > lane) { \
        hdr.sums[lane].setValid(); \
        hdr.sums[lane].value = meta.sums.word[hi:lo]; \
    }
#define EMIT_WORD(word, l0, l1, l2, l3, l4, l5, l6, l7) \
    EMIT_LANE(l0, word, 63, 56) EMIT_LANE(l1, word, 55, 48) \
    EMIT_LANE(l2, word, 47, 40) EMIT_LANE(l3, word, 39, 32) \
    EMIT_LANE(l4, word, 31, 24) EMIT_LANE(l5, word, 23, 16) \
    EMIT_LANE(l6, word, 15,  8) EMIT_LANE(l7, word,  7,  0)

/* Turns the DATA packet into the RESULT or STRAGGLER of protocol.md section 5.
 * Addressing (MACs, IPs, UDP ports, worker id) is set per copy in egress. */
control BuildAggReply(inout headers_t hdr, inout metadata_t meta) {
    apply {
        hdr.idx.pop_front(INDEX_BYTES);          /* the indices never leave the switch */
        hdr.agg.round = meta.copy_round;
        hdr.agg.contributors = meta.bitmap;
        hdr.agg.count = meta.count;
        if (meta.outcome == OUTCOME_STRAGGLER) {
            /* the received header otherwise (flags, reserved included), 5.3 */
            hdr.agg.pkt_type = TYPE_STRAGGLER;
            hdr.agg.num_values = 0;
            meta.out_payload_len = 0;
        } else {
            hdr.agg.pkt_type = TYPE_RESULT;
            hdr.agg.reserved = 0;
            hdr.agg.flags =
                meta.outcome == OUTCOME_COMPLETE     ? 8w0 :
                (meta.outcome == OUTCOME_RESERVE_LATE ? FLAG_RESERVE | FLAG_LATE :
                                                        FLAG_RESERVE);
            hdr.agg.expected = meta.res_expected;
            hdr.agg.min_count = meta.res_min_count;
            hdr.agg.tensor = meta.res_tensor;
            hdr.agg.offset = meta.res_offset;
            hdr.agg.num_values = meta.res_num_values;
            meta.out_payload_len = meta.res_num_values;
            EMIT_WORD(w0, 0, 1, 2, 3, 4, 5, 6, 7)
            EMIT_WORD(w1, 8, 9, 10, 11, 12, 13, 14, 15)
            EMIT_WORD(w2, 16, 17, 18, 19, 20, 21, 22, 23)
            EMIT_WORD(w3, 24, 25, 26, 27, 28, 29, 30, 31)
            EMIT_WORD(w4, 32, 33, 34, 35, 36, 37, 38, 39)
            EMIT_WORD(w5, 40, 41, 42, 43, 44, 45, 46, 47)
            EMIT_WORD(w6, 48, 49, 50, 51, 52, 53, 54, 55)
            EMIT_WORD(w7, 56, 57, 58, 59, 60, 61, 62, 63)
        }
        hdr.udp.length = UDP_HEADER_LEN + AGG_HEADER_LEN + meta.out_payload_len;
        hdr.ipv4.total_len = IPV4_HEADER_LEN + hdr.udp.length;
        meta.emit_agg = 1;
        meta.ipv4_changed = 1;
    }
}

#endif
