/* THC table lookup: packed byte -> two 8-bit lane values (protocol.md 2.2, 4.2).
 *
 * One exact-match table per byte position (THC's "every aggregation block holds its own
 * copy of the lookup table"): a table is applied once per pass, so the ingress
 * instantiates this control INDEX_BYTES times. The control plane installs, per job, 256
 * entries: packed byte b -> T[b >> 4], T[b & 15] (bfrt_scripts/tofino_plan.py). The table
 * keys on the job's dense index from the jobs table (4 bits) and the byte: 12 bits, all of
 * them used, so the compiler indexes the action data directly (no match bits stored) and
 * a table takes about one SRAM block instead of the ten a 16-bit job id key needed. */
#ifndef _THC_INA_TNA_LOOKUP_P4_
#define _THC_INA_TNA_LOOKUP_P4_

control ByteLookup(in index_byte_t index_byte,
                   in job_index_t job_index,
                   out bit<16> lanes) {
    action set_lanes(bit<8> high_value, bit<8> low_value) {
        lanes = high_value ++ low_value;
    }

    action no_lanes() {
        lanes = 0;
    }

    table byte_to_lanes {
        key = {
            job_index         : exact @name("job_index");
            index_byte.packed : exact @name("packed");
        }
        actions = { set_lanes; @defaultonly no_lanes; }
        const default_action = no_lanes();
        size = 256 * MAX_JOBS;
    }

    apply {
        /* no gateway around it (each would take one of a stage's 16 logical tables): a
         * byte past num_values or the padding nibble of an odd count looks up some
         * table value, which lands in lanes past num_values, outside the RESULT's
         * datagram (protocol.md 5.1); no lane carries, as n * max(T) <= 255 */
        byte_to_lanes.apply();
    }
}

#endif
