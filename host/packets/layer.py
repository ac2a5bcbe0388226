"""The scapy layer for the AGG header (docs/protocol.md §2).

Bound to UDP so that `rdpcap` and `Ether(bytes)` decode aggregation traffic in both
directions: to an aggregator (UDP destination port 50000-50015) and from one (source port
in the range). Building `UDP()/AggHeader()` sets the destination port to 50000.
"""
from __future__ import annotations

from scapy.fields import (BitEnumField, BitField, ByteField, FlagsField, IntField,
                          ShortField, XIntField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_bottom_up, bind_top_down

from .constants import (AGG_PORT_BASE, AGG_PORT_COUNT, FLAG_NAMES, HEADER_FIELDS, TYPE_DATA,
                        TYPE_NAMES, VERSION, payload_len)

# Field type by size in bytes; the two bitmaps of workers are shown in hex.
_FIELD_BY_SIZE = {1: ByteField, 2: ShortField, 4: IntField}
_BITMAPS = ("expected", "contributors")


def _header_fields() -> list:
    """The scapy fields of HEADER_FIELDS (dataplane/wire.py), in wire order."""
    fields = []
    for name, size in HEADER_FIELDS:
        if name == "ver_type":          # one byte, two nibbles (docs/protocol.md §2)
            fields += [BitField("version", VERSION, 4),
                       BitEnumField("type", TYPE_DATA, 4, TYPE_NAMES)]
        elif name == "flags":
            bits = 8 * size
            fields.append(FlagsField(name, 0, bits,
                                     [FLAG_NAMES.get(1 << bit, f"F{bit}") for bit in range(bits)]))
        elif name in _BITMAPS:
            fields.append(XIntField(name, 0))
        else:
            fields.append(_FIELD_BY_SIZE[size](name, 0))
    return fields


class AggHeader(Packet):
    name = "AGG"
    fields_desc = _header_fields()

    def extract_padding(self, s):
        # The payload length follows from type and num_values; anything after it is
        # Ethernet padding, not payload.
        n = payload_len(self.type, self.num_values)
        return s[:n], s[n:]

    def mysummary(self):
        return self.sprintf("AGG %type% job=%job% slot=%slot% round=%round% "
                            "worker=%worker% off=%offset% n=%num_values%")


for _port in range(AGG_PORT_BASE, AGG_PORT_BASE + AGG_PORT_COUNT):
    bind_bottom_up(UDP, AggHeader, dport=_port)
    bind_bottom_up(UDP, AggHeader, sport=_port)
bind_top_down(UDP, AggHeader, dport=AGG_PORT_BASE)
