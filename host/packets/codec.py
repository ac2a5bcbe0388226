"""Vectorized encoder/decoder for AGG headers and payloads (docs/protocol.md §2).

Every function works on whole batches with numpy: one tensor (or tensor range) becomes
one 2-D uint8 array, row k = AGG header + payload of packet k, padded with zeros to a
common width; `lengths[k]` is the real length of row k. No per-packet Python loop.
The bytes are identical to those the scapy layer (`layer.AggHeader`) builds.
"""
from __future__ import annotations

import numpy as np

from .constants import (HEADER_DTYPE, HEADER_LEN, TYPE_DATA, TYPE_RESULT, VERSION)

MAX_NUM_VALUES = 0xFFFF        # the num_values field is 16 bits


_FIELD_MAX = {np.dtype(t): np.iinfo(t).max for t in (np.uint8, np.uint16, np.uint32)}


def _per_packet(value, n: int, name: str, dtype):
    """A scalar (returned as an int: the header field takes it for every packet) or a
    per-packet array of n entries, refusing a wrong length or a value the field cannot
    hold."""
    limit = _FIELD_MAX[np.dtype(dtype)]
    if isinstance(value, (int, np.integer)):
        # Most fields are one number for the whole batch: checked without numpy, which
        # costs more than the rest of a one-packet batch's encoding.
        if not 0 <= value <= limit:
            raise _outside_field(name, limit)
        return int(value)
    arr = np.asarray(value)
    if arr.ndim != 0 and arr.shape != (n,):
        raise ValueError(f"{name}: expected a scalar or {n} per-packet values, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iub" or int(arr.min()) < 0
                     or int(arr.max()) > limit):
        raise _outside_field(name, limit)
    return np.full(n, arr, dtype=dtype) if arr.ndim == 0 else arr.astype(dtype, copy=False)


def _outside_field(name: str, limit: int) -> ValueError:
    return ValueError(f"{name}: values must be integers in 0..{limit} (the header field's width)")


def _split(num_values: int, values_per_packet: int) -> tuple[int, np.ndarray]:
    """Number of packets and the value count of each."""
    if not 1 <= values_per_packet <= MAX_NUM_VALUES:
        raise ValueError(f"values_per_packet must be in 1..{MAX_NUM_VALUES}, got {values_per_packet}")
    if num_values < 0:
        raise ValueError(f"num_values must be >= 0, got {num_values}")
    n_pkts = -(-num_values // values_per_packet)
    counts = np.full(n_pkts, values_per_packet, dtype=np.int64)
    if n_pkts:
        counts[-1] = num_values - (n_pkts - 1) * values_per_packet
    return n_pkts, counts


def _headers(ptype: int, counts: np.ndarray, values_per_packet: int, *, job, worker, tensor,
             slots, rounds, expected, min_count, flags, first_offset,
             contributors=0, count=0) -> np.ndarray:
    """The structured header array for a batch of packets of one type."""
    n = len(counts)
    hdr = np.zeros(n, dtype=HEADER_DTYPE)
    hdr["ver_type"] = (VERSION << 4) | ptype
    hdr["flags"] = _per_packet(flags, n, "flags", np.uint8)
    hdr["job"] = _per_packet(job, n, "job", np.uint16)
    hdr["slot"] = _per_packet(slots, n, "slots", np.uint16)
    hdr["worker"] = _per_packet(worker, n, "worker", np.uint8)
    hdr["min_count"] = _per_packet(min_count, n, "min_count", np.uint8)
    hdr["round"] = _per_packet(rounds, n, "rounds", np.uint32)
    hdr["expected"] = _per_packet(expected, n, "expected", np.uint32)
    hdr["contributors"] = _per_packet(contributors, n, "contributors", np.uint32)
    hdr["tensor"] = _per_packet(tensor, n, "tensor", np.uint32)
    offsets = int(first_offset) + np.arange(n, dtype=np.int64) * values_per_packet
    if n and (first_offset < 0 or offsets[-1] > 0xFFFFFFFF):
        raise ValueError("offsets must fit in 32 bits (0..4294967295)")
    hdr["offset"] = offsets
    hdr["num_values"] = counts
    hdr["count"] = _per_packet(count, n, "count", np.uint8)
    return hdr


def _write_nibble_rows(payload: np.ndarray, packed: np.ndarray, num_values: int,
                       values_per_packet: int) -> None:
    """Fill payload rows (n_pkts, ceil(vpp/2)) with the packed indices, every padding
    nibble zero (whatever the rows held before)."""
    n_pkts, width = payload.shape
    if values_per_packet % 2 == 0:
        # Packet boundaries fall on byte boundaries: whole packets are a reshape of the
        # packed bytes, copied in place; only a short last packet needs zero padding.
        full = num_values // values_per_packet
        payload[:full] = packed[:full * width].reshape(full, width)
        if full < n_pkts:
            lo, nbytes = full * width, (num_values + 1) // 2
            tail = payload[full]
            tail[:] = 0
            tail[:nbytes - lo] = packed[lo:nbytes]
            if num_values % 2:
                tail[nbytes - lo - 1] &= 0xF0          # the odd tail's padding nibble
        return
    # Odd vpp: boundaries split bytes, so unpack to one index per value and re-pack rows.
    idx = np.empty(2 * len(packed), dtype=np.uint8)
    idx[0::2] = packed >> 4
    idx[1::2] = packed & 0x0F
    rows = np.zeros((n_pkts, 2 * width), dtype=np.uint8)
    flat_vals = np.zeros(n_pkts * values_per_packet, dtype=np.uint8)
    flat_vals[:num_values] = idx[:num_values]
    rows[:, :values_per_packet] = flat_vals.reshape(n_pkts, values_per_packet)
    payload[:] = (rows[:, 0::2] << 4) | rows[:, 1::2]


def encode_data(packed, num_values: int, values_per_packet: int, *, job, worker, tensor,
                slots, rounds, expected, min_count=0, flags=0, first_offset=0, out=None):
    """DATA packets (AGG header + packed 4-bit indices) for `num_values` values.

    `packed` holds the indices of the range, two per byte, the even value in the high
    nibble. Packet k carries values [k*vpp, min((k+1)*vpp, num_values)) at offset
    first_offset + k*vpp. `slots`, `rounds` (and the other header arguments) are scalars or
    per-packet arrays. Returns (bufs uint8[n_pkts, 32 + ceil(vpp/2)], lengths int64[n_pkts]);
    with `out` (uint8 rows of that shape, e.g. a stream's own datagram rows) every byte of
    the packets is written there and `out` is returned as bufs, with no copy of the payload between.
    """
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    if len(packed) < (num_values + 1) // 2:
        raise ValueError(f"packed holds {len(packed)} bytes; {num_values} values need "
                         f"{(num_values + 1) // 2}")
    n_pkts, counts = _split(num_values, values_per_packet)
    width = (values_per_packet + 1) // 2
    if out is None:
        bufs = np.zeros((n_pkts, HEADER_LEN + width), dtype=np.uint8)
    elif out.shape != (n_pkts, HEADER_LEN + width) or out.dtype != np.uint8:
        raise ValueError(f"out: expected uint8 rows of shape {(n_pkts, HEADER_LEN + width)}, "
                         f"got {out.dtype} {out.shape}")
    else:
        bufs = out
    hdr = _headers(TYPE_DATA, counts, values_per_packet, job=job, worker=worker, tensor=tensor,
                   slots=slots, rounds=rounds, expected=expected, min_count=min_count,
                   flags=flags, first_offset=first_offset)
    bufs[:, :HEADER_LEN] = hdr.view(np.uint8).reshape(n_pkts, HEADER_LEN)
    if n_pkts:
        _write_nibble_rows(bufs[:, HEADER_LEN:], packed, num_values, values_per_packet)
    return bufs, HEADER_LEN + (counts + 1) // 2


def encode_results(sums, num_values: int, values_per_packet: int, *, job, worker, tensor,
                   slots, rounds, expected, contributors, count, min_count=0, flags=0,
                   first_offset=0):
    """RESULT packets (AGG header + 8-bit sums), laid out like `encode_data`.

    Returns (bufs uint8[n_pkts, 32 + vpp], lengths int64[n_pkts]).
    """
    sums = np.ascontiguousarray(sums, dtype=np.uint8).reshape(-1)
    if len(sums) < num_values:
        raise ValueError(f"sums holds {len(sums)} values; need {num_values}")
    n_pkts, counts = _split(num_values, values_per_packet)
    bufs = np.zeros((n_pkts, HEADER_LEN + values_per_packet), dtype=np.uint8)
    hdr = _headers(TYPE_RESULT, counts, values_per_packet, job=job, worker=worker,
                   tensor=tensor, slots=slots, rounds=rounds, expected=expected,
                   min_count=min_count, flags=flags, first_offset=first_offset,
                   contributors=contributors, count=count)
    bufs[:, :HEADER_LEN] = hdr.view(np.uint8).reshape(n_pkts, HEADER_LEN)
    payload = np.zeros(n_pkts * values_per_packet, dtype=np.uint8)
    payload[:num_values] = sums[:num_values]
    bufs[:, HEADER_LEN:] = payload.reshape(n_pkts, values_per_packet)
    return bufs, HEADER_LEN + counts


def encode_headers(headers: np.ndarray) -> np.ndarray:
    """The wire bytes (n, 32) of a HEADER_DTYPE array (for headers built field by field)."""
    headers = np.ascontiguousarray(headers, dtype=HEADER_DTYPE).reshape(-1)
    return headers.view(np.uint8).reshape(len(headers), HEADER_LEN)


def as_2d(bufs, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """A 2-D uint8 array and lengths from either a 2-D array or a list of bytes."""
    if isinstance(bufs, np.ndarray):
        if bufs.ndim != 2 or bufs.dtype != np.uint8:
            raise ValueError(f"bufs must be a 2-D uint8 array, got {bufs.dtype} {bufs.shape}")
        if lengths is None:
            lengths = np.full(len(bufs), bufs.shape[1], dtype=np.int64)
        return bufs, np.asarray(lengths, dtype=np.int64)
    items = [bytes(b) for b in bufs]
    lens = np.fromiter((len(b) for b in items), dtype=np.int64, count=len(items))
    width = int(lens.max()) if len(items) else HEADER_LEN
    arr = np.zeros((len(items), max(width, HEADER_LEN)), dtype=np.uint8)
    if items:
        flat = np.frombuffer(b"".join(items), dtype=np.uint8)
        rows = np.repeat(np.arange(len(items)), lens)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        arr[rows, np.arange(len(flat)) - starts] = flat
    if lengths is not None:
        lens = np.minimum(lens, np.asarray(lengths, dtype=np.int64))
    return arr, lens


def decode_headers(bufs, lengths=None) -> np.ndarray:
    """The AGG headers of a batch of packets as a HEADER_DTYPE array.

    `bufs` is a 2-D uint8 array (row = one AGG header + payload) or a list of bytes.
    A packet shorter than 32 bytes is refused with ValueError (callers that take packets
    from the network filter by length first and count the drop).
    """
    arr, lens = as_2d(bufs, lengths)
    short = np.flatnonzero(lens < HEADER_LEN)
    if len(short) or arr.shape[1] < HEADER_LEN:
        raise ValueError(f"packets {short[:8].tolist()} are shorter than the {HEADER_LEN}-byte "
                         "AGG header")
    return np.ascontiguousarray(arr[:, :HEADER_LEN]).view(HEADER_DTYPE).reshape(-1).copy()


def header_types(headers: np.ndarray) -> np.ndarray:
    return headers["ver_type"] & 0x0F


def header_versions(headers: np.ndarray) -> np.ndarray:
    return headers["ver_type"] >> 4


def scatter_payloads(bufs, lengths, headers, out, base_offset: int = 0) -> None:
    """Copy each RESULT payload into out[offset - base_offset : + num_values].

    Rows that are not RESULT packets are ignored. A RESULT row whose payload is shorter
    than num_values, or that falls outside `out`, raises ValueError naming the row:
    callers select the packets of one tensor range before scattering.
    """
    arr, lens = as_2d(bufs, lengths)
    headers = np.asarray(headers, dtype=HEADER_DTYPE).reshape(-1)
    if len(headers) != len(arr):
        raise ValueError(f"{len(headers)} headers for {len(arr)} packets")
    if out.dtype != np.uint8 or out.ndim != 1:
        raise ValueError(f"out must be a 1-D uint8 array, got {out.dtype} {out.shape}")
    rows = np.flatnonzero((header_types(headers) == TYPE_RESULT)
                          & (header_versions(headers) == VERSION))
    if not len(rows):
        return
    nv = headers["num_values"][rows].astype(np.int64)
    start = headers["offset"][rows].astype(np.int64) - base_offset
    bad = (lens[rows] < HEADER_LEN + nv) | (start < 0) | (start + nv > len(out))
    if bad.any():
        r = int(rows[np.argmax(bad)])
        raise ValueError(f"RESULT row {r} (offset {int(headers['offset'][r])}, "
                         f"{int(headers['num_values'][r])} values, length {int(lens[r])}) is "
                         f"truncated or outside out[{base_offset}:{base_offset + len(out)}]")
    # Packets of one tensor share one num_values (but the tail): copy them group by group
    # as whole rows, through a (rows, nv) view of `out` when the offsets are aligned.
    for count in np.unique(nv):
        if count == 0:
            continue
        group = nv == count
        starts = start[group]
        data = arr[rows[group], HEADER_LEN:HEADER_LEN + count]
        if not (starts % count).any():
            out[:len(out) // count * count].reshape(-1, count)[starts // count] = data
        else:
            out[starts[:, None] + np.arange(count)] = data
