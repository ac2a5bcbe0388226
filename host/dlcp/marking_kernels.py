"""Numba kernel of DLCP's per-partition marking (host.dlcp.marking, THC traffic).

One pass over a tensor's RHT partitions and its packets, for the marking policy that runs
on every submitted chunk: the same marks as partition_packet_ecn(partition_importance(...))
without their dozen numpy calls per chunk (which cost more than the ranking itself).
"""
from __future__ import annotations

import numpy as np
from numba import njit

MARKS_OK = 0
MARKS_NONFINITE = 1          # a partition norm is NaN or inf
MARKS_BAD_SIZE = 2           # a partition size is not positive
MARKS_SHORT = 3              # the partitions cover fewer values than the packets carry


@njit(cache=True, nogil=True)
def partition_marks(norms, sizes, values_per_packet, num_packets, important_ecn, not_ect,
                    out):
    """out[k]: important_ecn when packet k (values [k*vpp, (k+1)*vpp)) carries an
    important partition (RMS strictly above the median RMS; a lone partition is
    important), else not_ect. Partitions lie end to end with the given padded sizes.
    Returns MARKS_OK or the MARKS_* of the first problem found (out is then not set)."""
    n = norms.shape[0]
    total = 0
    for i in range(n):
        if not np.isfinite(norms[i]):
            return MARKS_NONFINITE
        if sizes[i] <= 0:
            return MARKS_BAD_SIZE
        total += sizes[i]
    if num_packets > 0 and total < (num_packets - 1) * values_per_packet + 1:
        return MARKS_SHORT
    important = np.ones(n, np.bool_)
    if n > 1:
        rms = np.empty(n, np.float64)
        for i in range(n):
            rms[i] = norms[i] / np.sqrt(np.float64(sizes[i]))
        median = np.median(rms)
        for i in range(n):
            important[i] = rms[i] > median
    part, part_end = 0, sizes[0] if n else 0
    for k in range(num_packets):
        lo = k * values_per_packet
        hi = min(lo + values_per_packet, total)
        while part < n - 1 and part_end <= lo:       # the first partition ending past lo
            part += 1
            part_end += sizes[part]
        q, q_end, hit = part, part_end, False
        while True:                                  # ... through the one holding hi - 1
            if important[q]:
                hit = True
                break
            if q_end >= hi or q == n - 1:
                break
            q += 1
            q_end += sizes[q]
        out[k] = important_ecn if hit else not_ect
    return MARKS_OK
