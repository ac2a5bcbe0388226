"""Packet building and parsing for the THC-INA wire protocol v2 (docs/protocol.md).

Two ways to make the same bytes: the scapy layer `AggHeader` (readable, used by tests,
pcap tools and fuzzing) and the vectorized numpy codec (`encode_data`, `encode_results`,
`decode_headers`, `scatter_payloads`, `wrap_frames`) that hosts and servers use on whole
tensors at once. The test suite checks the two agree byte for byte.
"""
from .codec import (decode_headers, encode_data, encode_headers, encode_results,
                    header_types, header_versions, scatter_payloads)
from .constants import (AGG_FRAME_OVERHEAD, AGG_PORT_BASE, AGG_PORT_COUNT, AGG_PORT_MASK,
                        FLAG_LATE, FLAG_RESERVE, FLAG_RETX, HEADER_DTYPE, HEADER_LEN, L2L4_LEN,
                        TYPE_DATA, TYPE_FLUSH, TYPE_NAMES, TYPE_RESULT, TYPE_STRAGGLER, VERSION,
                        is_agg_port, payload_len)
from .frames import ParsedFrame, ipv4_checksum, ipv4_checksums, parse_frame, wrap_frames
from .layer import AggHeader

__all__ = [
    "AggHeader", "HEADER_DTYPE", "HEADER_LEN", "L2L4_LEN", "AGG_FRAME_OVERHEAD", "VERSION",
    "TYPE_DATA", "TYPE_RESULT", "TYPE_STRAGGLER", "TYPE_FLUSH", "TYPE_NAMES",
    "FLAG_RETX", "FLAG_RESERVE", "FLAG_LATE",
    "AGG_PORT_BASE", "AGG_PORT_MASK", "AGG_PORT_COUNT", "is_agg_port", "payload_len",
    "encode_data", "encode_results", "encode_headers", "decode_headers", "scatter_payloads",
    "header_types", "header_versions",
    "wrap_frames", "parse_frame", "ParsedFrame", "ipv4_checksum", "ipv4_checksums",
]
