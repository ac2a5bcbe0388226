"""Ethernet/IPv4/UDP framing around AGG packets (docs/protocol.md §1, §5).

`wrap_frames` builds whole frames for a batch with numpy (valid IPv4 header checksum,
UDP checksum 0); `parse_frame` takes one frame apart for tests and tools.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import numpy as np

from .codec import as_2d
from .constants import ETH_LEN, HEADER_DTYPE, HEADER_LEN, IPV4_LEN, L2L4_LEN, UDP_LEN

ETHERTYPE_IPV4 = 0x0800
IPPROTO_UDP = 17
IP_FLAG_DF = 0x4000
DEFAULT_TTL = 64


def mac_bytes(mac: str) -> bytes:
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"MAC address {mac!r} is not of the form aa:bb:cc:dd:ee:ff")
    return bytes(int(p, 16) for p in parts)


def mac_str(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def ip_bytes(ip: str) -> bytes:
    return ipaddress.IPv4Address(ip).packed


def ip_str(raw: bytes) -> str:
    return str(ipaddress.IPv4Address(bytes(raw)))


def ipv4_checksums(ip_headers: np.ndarray) -> np.ndarray:
    """Internet checksum of each row of a (n, 20) uint8 array whose checksum bytes are 0."""
    words = ip_headers.astype(np.uint32)
    total = (words[:, 0::2] << 8 | words[:, 1::2]).sum(axis=1)
    total = (total & 0xFFFF) + (total >> 16)
    total = (total & 0xFFFF) + (total >> 16)
    return (~total & 0xFFFF).astype(np.uint16)


def ipv4_checksum(ip_header: bytes) -> int:
    """Checksum of one 20-byte IPv4 header (the checksum field is ignored)."""
    hdr = np.frombuffer(bytes(ip_header[:IPV4_LEN]), dtype=np.uint8).copy()
    hdr[10:12] = 0
    return int(ipv4_checksums(hdr.reshape(1, IPV4_LEN))[0])


def _column(value, n: int, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.int64)
    if arr.ndim == 0:
        return np.full(n, int(arr), dtype=np.int64)
    if arr.shape != (n,):
        raise ValueError(f"{name}: expected a scalar or {n} per-packet values, got {arr.shape}")
    return arr


def wrap_frames(bufs, lengths, *, src_mac: str, dst_mac: str, src_ip: str, dst_ip: str,
                sport, dport, tos=0, ttl: int = DEFAULT_TTL) -> list[bytes]:
    """Ethernet/IPv4/UDP frames around AGG packets (rows of `bufs`, `lengths` long).

    `sport`, `dport` and `tos` are scalars or per-packet arrays. IPv4: IHL 5, id 0, DF,
    protocol 17, a valid header checksum; UDP checksum 0.
    """
    arr, lens = as_2d(bufs, lengths)
    n = len(arr)
    frames = np.zeros((n, L2L4_LEN + arr.shape[1]), dtype=np.uint8)
    frames[:, 0:6] = np.frombuffer(mac_bytes(dst_mac), dtype=np.uint8)
    frames[:, 6:12] = np.frombuffer(mac_bytes(src_mac), dtype=np.uint8)
    frames[:, 12:14] = (ETHERTYPE_IPV4 >> 8, ETHERTYPE_IPV4 & 0xFF)
    ip = frames[:, ETH_LEN:ETH_LEN + IPV4_LEN]
    udp_len = UDP_LEN + lens
    total_len = IPV4_LEN + udp_len
    ip[:, 0] = 0x45
    ip[:, 1] = _column(tos, n, "tos") & 0xFF
    ip[:, 2], ip[:, 3] = total_len >> 8, total_len & 0xFF
    ip[:, 6], ip[:, 7] = IP_FLAG_DF >> 8, 0
    ip[:, 8] = ttl
    ip[:, 9] = IPPROTO_UDP
    ip[:, 12:16] = np.frombuffer(ip_bytes(src_ip), dtype=np.uint8)
    ip[:, 16:20] = np.frombuffer(ip_bytes(dst_ip), dtype=np.uint8)
    csum = ipv4_checksums(ip)
    ip[:, 10], ip[:, 11] = csum >> 8, csum & 0xFF
    udp = frames[:, ETH_LEN + IPV4_LEN:L2L4_LEN]
    sp, dp = _column(sport, n, "sport"), _column(dport, n, "dport")
    udp[:, 0], udp[:, 1] = sp >> 8, sp & 0xFF
    udp[:, 2], udp[:, 3] = dp >> 8, dp & 0xFF
    udp[:, 4], udp[:, 5] = udp_len >> 8, udp_len & 0xFF
    frames[:, L2L4_LEN:] = arr
    ends = L2L4_LEN + lens
    return [frames[i, :ends[i]].tobytes() for i in range(n)]


@dataclass
class ParsedFrame:
    eth_dst: str
    eth_src: str
    ethertype: int
    ihl: int
    tos: int
    ip_len: int
    ip_id: int
    ip_flags_frag: int
    ttl: int
    proto: int
    ip_checksum: int
    ip_checksum_ok: bool
    ip_src: str
    ip_dst: str
    sport: int
    dport: int
    udp_len: int
    udp_checksum: int
    header: np.void | None          # one HEADER_DTYPE record; None when the UDP payload is short
    payload: bytes                  # UDP payload after the AGG header (or all of it if no header)

    @property
    def dscp(self) -> int:
        return self.tos >> 2

    @property
    def ecn(self) -> int:
        return self.tos & 0x3

    @property
    def ptype(self) -> int | None:
        return None if self.header is None else int(self.header["ver_type"]) & 0x0F

    def field(self, name: str) -> int:
        return int(self.header[name])


def parse_frame(frame: bytes) -> ParsedFrame:
    """Take an Ethernet/IPv4/UDP frame apart (ValueError if it is not one)."""
    frame = bytes(frame)
    if len(frame) < L2L4_LEN:
        raise ValueError(f"frame of {len(frame)} bytes is shorter than Ethernet+IPv4+UDP")
    ethertype = int.from_bytes(frame[12:14], "big")
    ip = frame[ETH_LEN:ETH_LEN + IPV4_LEN]
    if ethertype != ETHERTYPE_IPV4 or ip[0] >> 4 != 4 or ip[9] != IPPROTO_UDP:
        raise ValueError("not an IPv4/UDP frame")
    ihl = ip[0] & 0x0F
    l4 = ETH_LEN + 4 * ihl
    if len(frame) < l4 + UDP_LEN:
        raise ValueError("frame truncated inside the IPv4 options or UDP header")
    udp = frame[l4:l4 + UDP_LEN]
    udp_len = int.from_bytes(udp[4:6], "big")
    body = frame[l4 + UDP_LEN:l4 + max(udp_len, UDP_LEN)]
    header = None
    payload = body
    if len(body) >= HEADER_LEN:
        header = np.frombuffer(body[:HEADER_LEN], dtype=HEADER_DTYPE)[0]
        payload = body[HEADER_LEN:]
    checksum = int.from_bytes(ip[10:12], "big")
    return ParsedFrame(
        eth_dst=mac_str(frame[0:6]), eth_src=mac_str(frame[6:12]), ethertype=ethertype,
        ihl=ihl, tos=ip[1], ip_len=int.from_bytes(ip[2:4], "big"),
        ip_id=int.from_bytes(ip[4:6], "big"), ip_flags_frag=int.from_bytes(ip[6:8], "big"),
        ttl=ip[8], proto=ip[9], ip_checksum=checksum,
        ip_checksum_ok=ihl == 5 and ipv4_checksum(ip) == checksum,
        ip_src=ip_str(ip[12:16]), ip_dst=ip_str(ip[16:20]),
        sport=int.from_bytes(udp[0:2], "big"), dport=int.from_bytes(udp[2:4], "big"),
        udp_len=udp_len, udp_checksum=int.from_bytes(udp[6:8], "big"),
        header=header, payload=payload)
