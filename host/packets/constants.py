"""Wire constants of protocol v2 (docs/protocol.md §1-§2)."""
from __future__ import annotations

import numpy as np

VERSION = 2
HEADER_LEN = 32

TYPE_DATA = 0
TYPE_RESULT = 1
TYPE_STRAGGLER = 2
TYPE_FLUSH = 3
TYPE_NAMES = {TYPE_DATA: "DATA", TYPE_RESULT: "RESULT",
              TYPE_STRAGGLER: "STRAGGLER", TYPE_FLUSH: "FLUSH"}

FLAG_RETX = 0x01
FLAG_RESERVE = 0x02
FLAG_LATE = 0x04

AGG_PORT_BASE = 50000          # UDP ports 50000-50015 are aggregation traffic
AGG_PORT_MASK = 0xFFF0
AGG_PORT_COUNT = 16

ETH_LEN = 14
IPV4_LEN = 20
UDP_LEN = 8
L2L4_LEN = ETH_LEN + IPV4_LEN + UDP_LEN      # 42: everything before the AGG header

# The 32-byte AGG header, network byte order, field names as in docs/protocol.md §2.
HEADER_DTYPE = np.dtype([
    ("ver_type", "u1"),
    ("flags", "u1"),
    ("job", ">u2"),
    ("slot", ">u2"),
    ("worker", "u1"),
    ("min_count", "u1"),
    ("round", ">u4"),
    ("expected", ">u4"),
    ("contributors", ">u4"),
    ("tensor", ">u4"),
    ("offset", ">u4"),
    ("num_values", ">u2"),
    ("count", "u1"),
    ("reserved", "u1"),
])
assert HEADER_DTYPE.itemsize == HEADER_LEN


def is_agg_port(port) -> bool:
    """True when a UDP port is in the aggregation range (works on numpy arrays too)."""
    return (port & AGG_PORT_MASK) == AGG_PORT_BASE


def payload_len(ptype: int, num_values: int) -> int:
    """Payload bytes a packet of this type and value count carries (§2.1)."""
    if ptype == TYPE_DATA:
        return (num_values + 1) // 2
    if ptype == TYPE_RESULT:
        return num_values
    return 0
