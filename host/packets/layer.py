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

from .constants import AGG_PORT_BASE, AGG_PORT_COUNT, TYPE_NAMES, VERSION, payload_len


class AggHeader(Packet):
    name = "AGG"
    fields_desc = [
        BitField("version", VERSION, 4),
        BitEnumField("type", 0, 4, TYPE_NAMES),
        FlagsField("flags", 0, 8, ["RETX", "RESERVE", "LATE", "F3", "F4", "F5", "F6", "F7"]),
        ShortField("job", 0),
        ShortField("slot", 0),
        ByteField("worker", 0),
        ByteField("min_count", 0),
        IntField("round", 0),
        XIntField("expected", 0),
        XIntField("contributors", 0),
        IntField("tensor", 0),
        IntField("offset", 0),
        ShortField("num_values", 0),
        ByteField("count", 0),
        ByteField("reserved", 0),
    ]

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
