"""Wire constants of protocol v2, defined once: docs/protocol.md §1 (encapsulation) and §2
(the AGG header, packet types, flags, payload).

Standard library only, so that every Python that speaks the protocol imports it: the
reference aggregator (dataplane/reference.py), the job description (dataplane/config.py),
the host codec and scapy layer (host/packets), and the Tofino SDE's bfshell Python through
bfrt_scripts/tofino_plan.py. The C planes (dataplane/dpdk/agg_core.h, p4src/) spell the
same numbers in their own languages; tests/protocol checks them against this module.
"""
from __future__ import annotations

import struct

VERSION = 2                    # high nibble of ver_type

TYPE_DATA = 0
TYPE_RESULT = 1
TYPE_STRAGGLER = 2
TYPE_FLUSH = 3
TYPE_NAMES = {TYPE_DATA: "DATA", TYPE_RESULT: "RESULT",
              TYPE_STRAGGLER: "STRAGGLER", TYPE_FLUSH: "FLUSH"}

FLAG_RETX = 0x01               # sender retransmission
FLAG_RESERVE = 0x02            # result re-served by unicast
FLAG_LATE = 0x04               # unicast result for a worker that did not contribute
FLAG_NAMES = {FLAG_RETX: "RETX", FLAG_RESERVE: "RESERVE", FLAG_LATE: "LATE"}

# UDP ports 50000-50015 are aggregation traffic: dport & 0xFFF0 == 50000 (§1).
AGG_PORT_BASE = 50000
AGG_PORT_COUNT = 16
AGG_PORT_MASK = 0xFFFF & ~(AGG_PORT_COUNT - 1)

ETH_LEN = 14
IPV4_LEN = 20                  # no options: IHL 5
UDP_LEN = 8
L2L4_LEN = ETH_LEN + IPV4_LEN + UDP_LEN      # 42: everything before the AGG header
# The longest frame any plane takes (Ethernet header to the last byte, no FCS); a longer
# one is dropped first and counted drop_oversize (§4.1).
MAX_FRAME = 9216

# The AGG header (§2): (name, bytes) in wire order, every field big-endian. `ver_type`
# is one byte of two nibbles: version (high) and packet type (low).
HEADER_FIELDS = (
    ("ver_type", 1),
    ("flags", 1),
    ("job", 2),
    ("slot", 2),
    ("worker", 1),
    ("min_count", 1),
    ("round", 4),
    ("expected", 4),
    ("contributors", 4),
    ("tensor", 4),
    ("offset", 4),
    ("num_values", 2),
    ("count", 1),
    ("reserved", 1),
)
HEADER_LEN = sum(size for _, size in HEADER_FIELDS)          # 32
AGG_FRAME_OVERHEAD = L2L4_LEN + HEADER_LEN                    # frame bytes before the payload

_STRUCT_CODE = {1: "B", 2: "H", 4: "I"}
# The header as a struct: unpack gives one int per field of HEADER_FIELDS, in order.
HEADER_STRUCT = struct.Struct(">" + "".join(_STRUCT_CODE[size] for _, size in HEADER_FIELDS))
assert HEADER_STRUCT.size == HEADER_LEN == 32


def is_agg_port(port):
    """True when a UDP port is in the aggregation range (works on numpy arrays too)."""
    return (port & AGG_PORT_MASK) == AGG_PORT_BASE


def payload_len(ptype: int, num_values: int) -> int:
    """Payload bytes a packet of this type and value count carries (§2.1)."""
    if ptype == TYPE_DATA:
        return (num_values + 1) // 2
    if ptype == TYPE_RESULT:
        return num_values
    return 0
