/* THC table lookup: packed byte -> two 8-bit lane values (protocol.md 2.2, 4.2).
 * One table per byte position: a table may be applied only once per control,
 * so the ingress instantiates this control INDEX_BYTES times. The controller
 * installs, per job, 256 entries: packed byte b -> T[b >> 4] ++ T[b & 15]. */
#ifndef _THC_INA_LOOKUP_P4_
#define _THC_INA_LOOKUP_P4_

control ByteLookup(in index_byte_t index_byte,
                   in bit<16> job,
                   in bit<16> num_values,
                   out bit<16> lanes)
                  (bit<16> byte_position) {
    action set_lanes(bit<8> high_value, bit<8> low_value) {
        lanes = high_value ++ low_value;
    }

    action no_lanes() {
        lanes = 0;
    }

    table byte_to_lanes {
        key = {
            job               : exact;
            index_byte.packed : exact;
        }
        actions = { set_lanes; no_lanes; }
        const default_action = no_lanes();
        size = 256 * MAX_JOBS;
    }

    apply {
        lanes = 0;
        if (index_byte.isValid()) {
            byte_to_lanes.apply();
            /* odd num_values: the last low nibble is padding and adds nothing */
            if (2 * byte_position + 1 >= num_values) {
                lanes = lanes & 0xFF00;
            }
        }
    }
}

#endif
