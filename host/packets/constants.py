"""Wire constants of protocol v2 (docs/protocol.md §1-§2) for the host side.

The constants themselves live in dataplane/wire.py and are re-exported here; what this
module adds is the numpy view of the AGG header, built from the same field list.
"""
from __future__ import annotations

import numpy as np

from dataplane.wire import (AGG_FRAME_OVERHEAD, AGG_PORT_BASE, AGG_PORT_COUNT, AGG_PORT_MASK,
                            ETH_LEN, FLAG_LATE, FLAG_NAMES, FLAG_RESERVE, FLAG_RETX,
                            HEADER_FIELDS, HEADER_LEN, IPV4_LEN, L2L4_LEN, TYPE_DATA,
                            TYPE_FLUSH, TYPE_NAMES, TYPE_RESULT, TYPE_STRAGGLER, UDP_LEN,
                            VERSION, is_agg_port, payload_len)

__all__ = [
    "AGG_FRAME_OVERHEAD", "AGG_PORT_BASE", "AGG_PORT_COUNT", "AGG_PORT_MASK", "ETH_LEN",
    "FLAG_LATE", "FLAG_NAMES", "FLAG_RESERVE", "FLAG_RETX", "HEADER_DTYPE", "HEADER_FIELDS",
    "HEADER_LEN", "IPV4_LEN", "L2L4_LEN", "TYPE_DATA", "TYPE_FLUSH", "TYPE_NAMES",
    "TYPE_RESULT", "TYPE_STRAGGLER", "UDP_LEN", "VERSION", "is_agg_port", "payload_len",
]

# The 32-byte AGG header, network byte order, one unsigned field per HEADER_FIELDS entry.
HEADER_DTYPE = np.dtype([(name, f">u{size}") for name, size in HEADER_FIELDS])
assert HEADER_DTYPE.itemsize == HEADER_LEN
