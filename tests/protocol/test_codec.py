"""The packet library: the scapy layer and the vectorized codec agree byte for byte."""
from pathlib import Path

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from dataplane import config
from host.packets import (AGG_PORT_BASE, FLAG_LATE, FLAG_RESERVE, FLAG_RETX, HEADER_DTYPE,
                          HEADER_LEN, TYPE_DATA, TYPE_FLUSH, TYPE_RESULT, TYPE_STRAGGLER,
                          AggHeader, decode_headers, encode_data, encode_headers,
                          encode_results, ipv4_checksum, parse_frame, scatter_payloads,
                          wrap_frames)

MACS = dict(src_mac="02:00:00:00:00:01", dst_mac="02:00:00:00:00:fe")
IPS = dict(src_ip="10.0.0.1", dst_ip="10.0.0.254")


def pack(idx):
    idx = np.asarray(idx, dtype=np.uint8)
    padded = np.zeros(len(idx) + len(idx) % 2, dtype=np.uint8)
    padded[:len(idx)] = idx
    return (padded[0::2] << 4) | padded[1::2]


def scapy_data(idx, **fields):
    return bytes(AggHeader(type=TYPE_DATA, num_values=len(idx), **fields) / Raw(bytes(pack(idx))))


def test_header_dtype_is_32_bytes_with_protocol_names():
    assert HEADER_DTYPE.itemsize == HEADER_LEN == 32
    assert HEADER_DTYPE.names == ("ver_type", "flags", "job", "slot", "worker", "min_count",
                                  "round", "expected", "contributors", "tensor", "offset",
                                  "num_values", "count", "reserved")
    assert len(AggHeader()) == 32


def test_constants_match_the_job_description():
    assert AGG_PORT_BASE == config.AGG_PORT_BASE
    assert (FLAG_RETX, FLAG_RESERVE, FLAG_LATE) == (1, 2, 4)
    assert (TYPE_DATA, TYPE_RESULT, TYPE_STRAGGLER, TYPE_FLUSH) == (0, 1, 2, 3)


@pytest.mark.parametrize("num_values,vpp", [(1, 1), (7, 3), (8, 4), (64, 64), (100, 64),
                                            (1023, 256), (33, 5), (2, 1024), (9, 2)])
def test_encode_data_matches_scapy_for_every_packet(num_values, vpp):
    rng = np.random.default_rng(num_values * 7 + vpp)
    idx = rng.integers(0, 16, num_values)
    n_pkts = -(-num_values // vpp)
    slots = rng.integers(0, 65536, n_pkts)
    rounds = rng.integers(0, 2**32, n_pkts, dtype=np.uint64)
    bufs, lengths = encode_data(pack(idx), num_values, vpp, job=513, worker=31, tensor=0xDEADBEEF,
                                slots=slots, rounds=rounds, expected=0x80000001, min_count=3,
                                flags=FLAG_RETX, first_offset=1000)
    assert bufs.shape == (n_pkts, HEADER_LEN + (vpp + 1) // 2)
    for k in range(n_pkts):
        chunk = idx[k * vpp:(k + 1) * vpp]
        ref = scapy_data(chunk, flags=FLAG_RETX, job=513, slot=int(slots[k]), worker=31,
                         min_count=3, round=int(rounds[k]), expected=0x80000001,
                         tensor=0xDEADBEEF, offset=1000 + k * vpp)
        assert bufs[k, :lengths[k]].tobytes() == ref
        assert not bufs[k, lengths[k]:].any()      # row padding is zero


def test_odd_tail_padding_nibble_is_zero_even_if_input_has_garbage():
    packed = np.array([0x12, 0x3F], dtype=np.uint8)    # value 3 is 3, the 0xF is padding
    bufs, lengths = encode_data(packed, 3, 4, job=0, worker=0, tensor=0, slots=0, rounds=0,
                                expected=1)
    assert bufs[0, HEADER_LEN:lengths[0]].tolist() == [0x12, 0x30]


def test_encode_results_matches_scapy_and_decodes():
    rng = np.random.default_rng(1)
    sums = rng.integers(0, 256, 150).astype(np.uint8)
    bufs, lengths = encode_results(sums, 150, 64, job=2, worker=5, tensor=9, slots=[4, 5, 6],
                                   rounds=3, expected=0xFF, contributors=0x7F, count=7,
                                   flags=FLAG_RESERVE | FLAG_LATE, first_offset=64)
    assert lengths.tolist() == [96, 96, 54]
    for k in range(3):
        ref = AggHeader(type=TYPE_RESULT, flags=FLAG_RESERVE | FLAG_LATE, job=2, slot=4 + k,
                        worker=5, round=3, expected=0xFF, contributors=0x7F, tensor=9,
                        offset=64 + 64 * k, num_values=int(lengths[k] - 32), count=7)
        assert bufs[k, :lengths[k]].tobytes() == bytes(ref / Raw(bytes(sums[64 * k:64 * k + 64])))
    hdr = decode_headers(bufs, lengths)
    assert hdr["offset"].tolist() == [64, 128, 192]
    assert hdr["num_values"].tolist() == [64, 64, 22]
    assert (hdr["ver_type"] == 0x21).all()
    out = np.zeros(150, dtype=np.uint8)
    scatter_payloads(bufs, lengths, hdr, out, base_offset=64)
    assert np.array_equal(out, sums)


def test_decode_accepts_a_list_of_bytes_and_encode_headers_roundtrips():
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (5, 32)).astype(np.uint8)
    hdr = decode_headers([r.tobytes() + b"xyz"[:i] for i, r in enumerate(raw)])
    assert np.array_equal(encode_headers(hdr), raw)
    for i, r in enumerate(raw):
        pkt = AggHeader(r.tobytes())
        assert pkt.job == hdr["job"][i] and pkt.round == hdr["round"][i]
        assert pkt.offset == hdr["offset"][i] and pkt.expected == hdr["expected"][i]


def test_decode_refuses_short_packets():
    with pytest.raises(ValueError, match="shorter than the 32-byte"):
        decode_headers([bytes(32), bytes(31)])


def test_scatter_ignores_non_results_and_refuses_out_of_range():
    sums = np.arange(10, dtype=np.uint8)
    bufs, lengths = encode_results(sums, 10, 4, job=0, worker=0, tensor=0, slots=0, rounds=0,
                                   expected=1, contributors=1, count=1)
    hdr = decode_headers(bufs, lengths)
    hdr_mixed = hdr.copy()
    hdr_mixed["ver_type"][1] = 0x22                       # a STRAGGLER row is skipped
    out = np.full(10, 99, dtype=np.uint8)
    scatter_payloads(bufs, lengths, hdr_mixed, out)
    assert out.tolist() == [0, 1, 2, 3, 99, 99, 99, 99, 8, 9]
    with pytest.raises(ValueError, match="outside"):
        scatter_payloads(bufs, lengths, hdr, np.zeros(9, dtype=np.uint8))
    with pytest.raises(ValueError, match="truncated"):
        scatter_payloads(bufs, lengths - 1, hdr, np.zeros(10, dtype=np.uint8))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="packed holds"):
        encode_data(np.zeros(2, np.uint8), 5, 4, job=0, worker=0, tensor=0, slots=0,
                    rounds=0, expected=1)
    with pytest.raises(ValueError, match="slots"):
        encode_data(np.zeros(4, np.uint8), 8, 4, job=0, worker=0, tensor=0, slots=[1, 2, 3],
                    rounds=0, expected=1)
    with pytest.raises(ValueError, match="rounds: values must be integers in 0..4294967295"):
        encode_data(np.zeros(4, np.uint8), 8, 4, job=0, worker=0, tensor=0, slots=0,
                    rounds=[0, 2**32], expected=1)
    with pytest.raises(ValueError, match="job"):
        encode_data(np.zeros(4, np.uint8), 8, 4, job=-1, worker=0, tensor=0, slots=0,
                    rounds=0, expected=1)
    # One number for every packet is checked against the field's width too.
    with pytest.raises(ValueError, match="worker: values must be integers in 0..255"):
        encode_data(np.zeros(4, np.uint8), 8, 4, job=0, worker=256, tensor=0, slots=0,
                    rounds=0, expected=1)
    with pytest.raises(ValueError, match="rounds: values must be integers in 0..4294967295"):
        encode_data(np.zeros(4, np.uint8), 8, 4, job=0, worker=0, tensor=0, slots=0,
                    rounds=np.int64(2**32), expected=1)
    with pytest.raises(ValueError, match="slots: values must be integers in 0..65535"):
        encode_data(np.zeros(4, np.uint8), 8, 4, job=0, worker=0, tensor=0, slots=1.5,
                    rounds=0, expected=1)
    with pytest.raises(ValueError, match="values_per_packet"):
        encode_data(np.zeros(4, np.uint8), 8, 0, job=0, worker=0, tensor=0, slots=0,
                    rounds=0, expected=1)


def test_numpy_scalars_encode_as_python_ints():
    packed = np.arange(8, dtype=np.uint8)
    fields = dict(job=513, worker=31, tensor=0xDEADBEEF, slots=7, rounds=2**32 - 1,
                  expected=0b1011, min_count=2, flags=1, first_offset=4096)
    want, _ = encode_data(packed, 16, 8, **fields)
    got, _ = encode_data(packed, 16, 8, **{k: np.uint64(v) if k != "job" else np.int16(v)
                                           for k, v in fields.items()})
    np.testing.assert_array_equal(got, want)


def test_empty_range_gives_no_packets():
    bufs, lengths = encode_data(np.zeros(0, np.uint8), 0, 64, job=0, worker=0, tensor=0,
                                slots=0, rounds=0, expected=1)
    assert bufs.shape == (0, 64) and lengths.shape == (0,)


def test_wrap_frames_matches_scapy_and_parses():
    idx = np.arange(16) % 16
    bufs, lengths = encode_data(pack(idx), 16, 6, job=7, worker=1, tensor=2, slots=[0, 1, 2],
                                rounds=1, expected=3)
    tos = np.array([0x80, 0x81, 0xC2])
    frames = wrap_frames(bufs, lengths, **MACS, **IPS, sport=40001, dport=50003, tos=tos)
    for k, frame in enumerate(frames):
        ref = (Ether(**{"src": MACS["src_mac"], "dst": MACS["dst_mac"]})
               / IP(src=IPS["src_ip"], dst=IPS["dst_ip"], tos=int(tos[k]), id=0, flags="DF",
                    ttl=64)
               / UDP(sport=40001, dport=50003, chksum=0)
               / AggHeader(bytes(bufs[k, :lengths[k]])))
        assert frame == bytes(ref)
        parsed = parse_frame(frame)
        assert parsed.ip_checksum_ok and parsed.tos == tos[k] and parsed.dport == 50003
        assert parsed.field("slot") == k and parsed.payload == bufs[k, 32:lengths[k]].tobytes()
        assert parsed.udp_len == 8 + lengths[k] and parsed.ip_len == 28 + lengths[k]
        assert ipv4_checksum(frame[14:34]) == parsed.ip_checksum


def test_scapy_dissects_both_directions_and_strips_ethernet_padding():
    to_agg = bytes(Ether() / IP() / UDP(sport=1234, dport=AGG_PORT_BASE + 7)
                   / AggHeader(type=TYPE_FLUSH))
    assert Ether(to_agg)[AggHeader].type == TYPE_FLUSH
    from_agg = bytes(Ether() / IP() / UDP(sport=AGG_PORT_BASE, dport=1234)
                     / AggHeader(type=TYPE_RESULT, num_values=2) / Raw(b"\x05\x06"))
    pkt = Ether(from_agg + b"\x00" * 6)          # trailing padding after the payload
    assert pkt[AggHeader].num_values == 2 and pkt[Raw].load == b"\x05\x06"
    assert UDP in Ether(bytes(Ether() / IP() / UDP(sport=1, dport=53)))
    assert AggHeader not in Ether(bytes(Ether() / IP() / UDP(sport=1, dport=53) / Raw(bytes(40))))
    assert UDP(bytes(UDP() / AggHeader())).dport == AGG_PORT_BASE


def test_the_worked_example_of_protocol_md():
    """docs/protocol.md §1 spells out one DATA packet byte for byte."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    example = "20 00 0001 0005 02 00 00000007 00000007 00000000 00000009 00000060 0003 00 00 1f 40"
    assert example in doc
    bufs, lengths = encode_data(pack([1, 15, 4]), 3, 64, job=1, worker=2, tensor=9, slots=5,
                                rounds=7, expected=0b111, first_offset=96)
    assert bufs[0, :lengths[0]].tobytes() == bytes.fromhex(example.replace(" ", ""))


@pytest.mark.parametrize("base_offset,out_pad", [(0, 0), (3, 7), (1000, 1)])
def test_scatter_reassembles_shuffled_packets_at_any_alignment(base_offset, out_pad):
    rng = np.random.default_rng(base_offset)
    sums = rng.integers(0, 256, 1000).astype(np.uint8)
    bufs, lengths = encode_results(sums, 1000, 96, job=1, worker=0, tensor=0, slots=0,
                                   rounds=0, expected=1, contributors=1, count=1,
                                   first_offset=1000)
    order = rng.permutation(len(bufs))
    bufs, lengths = bufs[order], lengths[order]
    out = np.zeros(1000 + 1000 - base_offset + out_pad, dtype=np.uint8)
    scatter_payloads(bufs, lengths, decode_headers(bufs, lengths), out, base_offset)
    start = 1000 - base_offset
    np.testing.assert_array_equal(out[start:start + 1000], sums)
    assert not out[:start].any() and not out[start + 1000:].any()


def test_encode_data_into_given_rows_matches_a_fresh_encoding():
    """`out=`: the packets written straight into caller rows (a stream's own) are the
    bytes of a fresh encoding, for whole packets and for a short last one; a wrong shape
    is refused."""
    for num_values, vpp in ((4 * 64, 64), (3 * 64 + 7, 64), (17, 6)):
        idx = np.random.default_rng(num_values).integers(0, 16, num_values)
        args = dict(job=3, worker=2, tensor=9, slots=np.arange(-(-num_values // vpp)),
                    rounds=5, expected=0b111, first_offset=vpp)
        fresh, lengths = encode_data(pack(idx), num_values, vpp, **args)
        rows = np.full(fresh.shape, 0xAA, np.uint8)       # stale bytes must not survive
        bufs, lengths_out = encode_data(pack(idx), num_values, vpp, out=rows, **args)
        assert bufs is rows
        assert np.array_equal(rows, fresh) and np.array_equal(lengths_out, lengths)
    with pytest.raises(ValueError, match="out"):
        encode_data(pack(idx), num_values, vpp, out=np.zeros((1, 8), np.uint8), **args)
