"""dataplane/wire.py is the one definition of the wire constants: it says what
docs/protocol.md says, the DPDK switch's C header spells the same numbers, and the three
Python views built from its field list (struct, numpy dtype, scapy layer) give the same
bytes."""
import re
from pathlib import Path

import numpy as np
from scapy.compat import raw

from dataplane import wire
from host.packets import HEADER_DTYPE, AggHeader

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
AGG_CORE_H = (ROOT / "dataplane" / "dpdk" / "agg_core.h").read_text()


def section(title: str) -> str:
    start = PROTOCOL.index(title)
    return PROTOCOL[start:PROTOCOL.index("\n## ", start + 1)]


def test_header_fields_are_the_protocol_table():
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*`(\w+)`", section("## 2. AGG header"),
                      re.M)
    assert [(name, int(size)) for _, size, name in rows] == list(wire.HEADER_FIELDS)
    offsets = np.cumsum([0] + [size for _, size in wire.HEADER_FIELDS])[:-1]
    assert [int(off) for off, _, _ in rows] == offsets.tolist()
    assert f"AGG header ({wire.HEADER_LEN} bytes" in PROTOCOL


def test_types_version_and_ports_are_the_protocol_s():
    types = re.findall(r"^\|\s*(\d)\s*\|\s*`(\w+)`", section("### 2.1 Packet types"), re.M)
    assert {int(t): name for t, name in types} == wire.TYPE_NAMES
    assert f"version (= **{wire.VERSION}**)" in PROTOCOL
    last = wire.AGG_PORT_BASE + wire.AGG_PORT_COUNT - 1
    assert f"**{wire.AGG_PORT_BASE}–{last}**" in PROTOCOL
    assert f"dport & 0x{wire.AGG_PORT_MASK:04X} == {wire.AGG_PORT_BASE}" in PROTOCOL
    assert all(wire.is_agg_port(p) for p in range(wire.AGG_PORT_BASE, last + 1))
    assert not wire.is_agg_port(wire.AGG_PORT_BASE - 1) and not wire.is_agg_port(last + 1)
    for flag, name in wire.FLAG_NAMES.items():
        assert f"bit {flag.bit_length() - 1} `{name}`" in PROTOCOL


def test_the_dpdk_switch_spells_the_same_numbers():
    defines = {m.group(1): int(m.group(2), 0) for m in
               re.finditer(r"#define\s+(AGG_\w+)\s+(0x[0-9A-Fa-f]+|\d+)u?\b", AGG_CORE_H)}
    assert defines["AGG_VERSION"] == wire.VERSION
    assert defines["AGG_PORT_BASE"] == wire.AGG_PORT_BASE
    assert defines["AGG_PORT_MASK"] == wire.AGG_PORT_MASK
    assert defines["AGG_HEADER_LEN"] == wire.HEADER_LEN
    for ptype, name in wire.TYPE_NAMES.items():
        assert defines[f"AGG_TYPE_{name}"] == ptype
    for flag, name in wire.FLAG_NAMES.items():
        assert defines[f"AGG_FLAG_{name}"] == flag
    assert re.search(rf"AGG_L2L4_LEN\s.*/\*\s*{wire.L2L4_LEN}\s*\*/", AGG_CORE_H)


def test_struct_dtype_and_scapy_views_give_the_same_bytes():
    rng = np.random.default_rng(2)
    for _ in range(20):
        values = [int(rng.integers(0, 1 << (8 * size))) for _, size in wire.HEADER_FIELDS]
        packed = wire.HEADER_STRUCT.pack(*values)
        row = np.array(tuple(values), dtype=HEADER_DTYPE)
        assert row.tobytes() == packed
        fields = dict(zip((name for name, _ in wire.HEADER_FIELDS), values))
        ver_type = fields.pop("ver_type")
        scapy = AggHeader(version=ver_type >> 4, type=ver_type & 0x0F, **fields)
        assert raw(scapy) == packed


def test_payload_lengths_follow_the_types():
    assert wire.payload_len(wire.TYPE_DATA, 7) == 4
    assert wire.payload_len(wire.TYPE_RESULT, 7) == 7
    assert wire.payload_len(wire.TYPE_STRAGGLER, 7) == wire.payload_len(wire.TYPE_FLUSH, 7) == 0
    assert wire.L2L4_LEN == 42 and wire.AGG_FRAME_OVERHEAD == 74
