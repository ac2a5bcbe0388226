"""Numba CPU kernels for the codec, behind codec.THCCodec.

The RHT and the quantizer are thc.vector_kernels (explicit 16-lane vectors: FFHT-class
FWHT with the signs and the scale fused in, table lookups in registers); this module owns
shapes, padding, scratch buffers and the choice of threads, with the same signatures as
the numpy reference backend. Norms, lookup and decode are plain Numba loops (LLVM
vectorizes them). Every kernel releases the GIL (nogil=True): host.allreduce runs the codec
on its exchange thread while the training thread goes on with backward.

RHT work layout (why it is fast): see thc.vector_kernels. In short, every float is read
once and written once; the 4 smallest strides are lane shuffles inside one vector, the
next 4 are across 16 vectors in registers, and each larger stride level is one radix-16
sweep while its group is in L1, L2 or L3. The output of a large tensor is written with
non-temporal stores. The forward and inverse RHT are bit-identical to thc.reference.
"""
from __future__ import annotations

import sys
import threading

import numba
import numpy as np
from numba import njit, prange

from . import numpy_kernels, rng
from . import vector_kernels as vk

_mix64 = njit(cache=True, inline="always")(rng.mix64)
U_GOLDEN, U_ONE = rng.U_GOLDEN, rng.U_ONE
NORM_CHUNK = 1 << 16
NT_MIN_BYTES = 1 << 23       # outputs at least this large skip the cache (streaming stores)
MIN_VECTOR_PARTITION = vk.LANES
FUSED = True                 # rotate(add=, norms=), quantize(error_out=), decode_inverse


@njit(cache=True, inline="always")
def _bits(key, counter):
    return _mix64(key + (np.uint64(counter) + U_ONE) * U_GOLDEN)


# ---- RHT --------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _signed(v, p, key):
    """v with the Rademacher sign of padded position p."""
    if (_bits(key, p >> 6) >> np.uint64(p & 63)) & U_ONE:
        return -v
    return v


@njit(cache=True, nogil=True)
def _tiny_partitions(src, si, dst, di, n, count, pos, key, scale, sign, add, has_add,
                     squares):
    """Partitions of fewer than 16 floats (2, 4 or 8): scalar radix-2 with the operation
    order of the vector kernels and the reference."""
    buf = np.empty(n, dtype=np.float32)
    for k in range(count):
        for j in range(n):
            v = src[si + k * n + j]
            if sign == vk.SIGN_FIRST:
                v = _signed(v * scale, pos + k * n + j, key)
            buf[j] = v
        h = 1
        while h < n:
            for i in range(0, n, 2 * h):
                for j in range(i, i + h):
                    a = buf[j]
                    c = buf[j + h]
                    buf[j] = a + c
                    buf[j + h] = a - c
            h *= 2
        acc = 0.0
        for j in range(n):
            v = buf[j]
            if sign == vk.SIGN_LAST:
                v = _signed(v * scale, pos + k * n + j, key)
            if has_add:
                v = v + add[di + k * n + j]
            dst[di + k * n + j] = v
            acc += np.float64(v) * np.float64(v)
        squares[k] = acc


_scratch = threading.local()        # per calling thread: the kernels' scratch rows


def _scratch_rows(rows: int, n: int) -> np.ndarray:
    """(rows, scratch_size(n)) float32, reused across calls (no page faults per call)."""
    size = vk.scratch_size(n) if n > vk.CHUNK else vk.LANES    # rows start on cache lines
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * size:
        buf = aligned_empty(rows * size)
        _scratch.buf = buf
    return buf[:rows * size].reshape(rows, size)


def aligned_empty(n: int) -> np.ndarray:
    """float32[n] starting on a 64-byte boundary (whole cache lines for streaming stores)."""
    raw = np.empty(n + 16, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip:skip + n]


def _transform(src, si, dst, di, n, count, pos, key, scale, sign, add=None, squares=None):
    """`count` partitions of n floats src[si:] -> dst[di:] (+ add[di:]); pos: padded
    position of the first one (for the signs); sign vk.SIGN_NONE, SIGN_FIRST (forward RHT)
    or SIGN_LAST (inverse). squares[k] receives the sum of squares of output partition k."""
    if count == 0:
        return
    if squares is None:
        squares = np.empty(count, dtype=np.float64)
    has_add = add is not None
    add = add if has_add else dst
    if n < MIN_VECTOR_PARTITION:
        _tiny_partitions(src, si, dst, di, n, count, pos, key, scale, sign, add, has_add,
                         squares)
        return
    nt = (4 * n * count >= NT_MIN_BYTES and (dst.ctypes.data + 4 * di) % 64 == 0)
    threads = numba.get_num_threads()
    if count == 1 and n > 4096 and threads > 1:
        squares[0] = vk.fwht_shared_partition(src, si, dst, di, n, pos, key, scale,
                                              _scratch_rows(1, n)[0], sign, nt, add, has_add)
    else:
        vk.fwht_partitions(src, si, dst, di, n, count, pos, key, scale,
                           _scratch_rows(min(threads, count), n), sign, nt, add, has_add,
                           squares)


def fwht_inplace(buf: np.ndarray, start: int, n: int) -> None:
    """Unnormalized Walsh-Hadamard transform of buf[start:start+n] (n a power of two)."""
    _transform(buf, start, buf, start, n, 1, 0, np.uint64(0), np.float32(1.0), vk.SIGN_NONE)


def rht_forward(x, out, d, start, total, n, key, scale, add=None, squares=None):
    """out[start:start+total] = H D x / sqrt(n) (+ add) for consecutive zero-padded
    partitions of size n (total a multiple of n); x holds the d unpadded floats."""
    count = total // n
    if squares is None:
        squares = np.empty(count, dtype=np.float64)
    if start + total <= d:
        _transform(x, start, out, start, n, count, start, key, scale, vk.SIGN_FIRST, add,
                   squares)
        return
    # the last partition runs past d: its zero-padded copy goes through the same kernels
    _transform(x, start, out, start, n, count - 1, start, key, scale, vk.SIGN_FIRST, add,
               squares[:count - 1])
    last = start + (count - 1) * n
    padded = np.zeros(n, dtype=np.float32)
    padded[:d - last] = x[last:d]
    _transform(padded, 0, out, last, n, 1, last, key, scale, vk.SIGN_FIRST, add,
               squares[count - 1:])


def rht_inverse(y, out, d, start, total, n, key, scale):
    """out[start:min(start+total, d)] = D H y / sqrt(n) per partition of size n (y is
    only read)."""
    count = total // n
    if start + total <= d:
        _transform(y, start, out, start, n, count, start, key, scale, vk.SIGN_LAST)
        return
    _transform(y, start, out, start, n, count - 1, start, key, scale, vk.SIGN_LAST)
    last = start + (count - 1) * n
    tail = aligned_empty(n)
    _transform(y, last, tail, 0, n, 1, last, key, scale, vk.SIGN_LAST)
    out[last:d] = tail[:d - last]


# ---- lookup and decode ----------------------------------------------------------------
DECODE_TASK = 1 << 16


# Inner loops run over slices from index 0: an index that could be negative carries
# Numba's wraparound select, which keeps LLVM from vectorizing (5x slower here).
@njit(parallel=True, cache=True, nogil=True)
def _lookup(packed, pair_table, out16):
    """Both table values of a packed byte in one 16-bit load: pair_table[b] holds T[b >> 4]
    in its low byte (element 2k, first in memory) and T[b & 15] in its high byte."""
    n = packed.shape[0]
    tasks = (n + DECODE_TASK - 1) // DECODE_TASK
    for task in prange(tasks):
        src = packed[task * DECODE_TASK:min(n, (task + 1) * DECODE_TASK)]
        dst = out16[task * DECODE_TASK:min(n, (task + 1) * DECODE_TASK)]
        for k in range(src.shape[0]):
            dst[k] = pair_table[src[k]]


def _decode_rotated(sums, counts, half, step, log_p, out):
    vk.decode_rotated(sums, counts, half, step, log_p, out, DECODE_TASK)


# ---- the backend interface the codec calls ----------------------------------------------
as_flat = numpy_kernels.as_flat
length = numpy_kernels.length
wrap_like = numpy_kernels.wrap_like
pad = numpy_kernels.pad
unpad = numpy_kernels.unpad
add_inplace = numpy_kernels.add_inplace
subtract = numpy_kernels.subtract
copy_into = numpy_kernels.copy_into


def _contiguous(a, dtype=None):
    return np.ascontiguousarray(a, dtype=dtype)


def as_counts(counts, padded):
    c = numpy_kernels.as_counts(counts, padded)
    return np.ascontiguousarray(c.reshape(-1), dtype=np.float32)


def partition_norms(a, layout):
    a = _contiguous(a, np.float32)
    squares = vk.sum_squares(a, layout.starts(), layout.data_lengths(), NORM_CHUNK)
    return np.sqrt(squares).astype(np.float32)


def _output(out, length, what):
    """The caller's output buffer, checked, or a fresh cache-line-aligned one."""
    if out is None:
        return aligned_empty(length)
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.ndim == 1
            and out.shape[0] == length and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"{what}: out must be a writable contiguous float32 array of length "
                         f"{length}")
    return out


def rotate(a, layout, sign_key, out=None, add=None, norms=False):
    """The RHT of every zero-padded partition (+ add, a padded rotated-domain vector);
    with norms, also the L2 norm of every output partition, from the same pass."""
    a = _contiguous(a, np.float32)
    out = _output(out, layout.padded, "rotate")
    if np.shares_memory(a, out):
        a = a.copy()                 # the tail padding would read what it just wrote
    if add is not None:
        add = _contiguous(add, np.float32)
        if add.shape != (layout.padded,):
            raise ValueError(f"rotate: add has shape {add.shape}, expected ({layout.padded},)")
    key = np.uint64(sign_key)
    squares = np.zeros(layout.num_partitions, dtype=np.float64)
    k = 0
    for s, total, n in layout.segments():
        count = total // n
        rht_forward(a, out, layout.d, s, total, n, key, np.float32(1.0 / np.sqrt(n)), add,
                    squares[k:k + count])
        k += count
    if norms:
        return out, np.sqrt(squares).astype(np.float32)
    return out


def inverse_rotate(a, layout, sign_key, overwrite=False, out=None):
    """The input is only read (overwrite is accepted for interface compatibility)."""
    a = _contiguous(a, np.float32)
    out = _output(out, layout.d, "inverse_rotate")
    if np.shares_memory(a, out):
        a = a.copy()
    key = np.uint64(sign_key)
    for s, total, n in layout.segments():
        rht_inverse(a, out, layout.d, s, total, n, key, np.float32(1.0 / np.sqrt(n)))
    return out


def quantize(a, half, scale, codec, layout, key, step=None, error_out=None):
    """Packed indices; with error_out (padded float32), also a - own dequantized value,
    from the same pass (step: the per-partition decode step, needed then)."""
    a = _contiguous(a, np.float32)
    out = np.empty(layout.padded // 2, dtype=np.uint8)
    cells, inv_width, values, shuffle = _quantizer_tables(codec)
    log_p = layout.partition_size.bit_length() - 1
    has_err = error_out is not None
    err = error_out if has_err else a
    if step is None:
        step = np.zeros_like(half)
    nonfinite = vk.quantize(a, half, scale, step, np.float32(codec.granularity), cells,
                            inv_width, values, shuffle, log_p, np.uint64(key), out, err, has_err)
    return out, int(nonfinite)


def _quantizer_tables(codec):
    tables = getattr(codec, "_vector_tables", None)
    if tables is None:
        tables = vk.quantizer_tables(codec.table, codec.lower, codec.inv_width)
        codec._vector_tables = tables
    return tables


def lookup(packed, table_u8):
    packed = _contiguous(packed, np.uint8)
    out = np.empty(2 * packed.shape[0], dtype=np.uint8)
    _lookup(packed, _pair_table(table_u8), out.view(np.uint16))
    return out


_pair_tables = {}


def _pair_table(table_u8):
    key = table_u8.tobytes()
    pairs = _pair_tables.get(key)
    if pairs is None:
        b = np.arange(256)
        pairs = (table_u8[b >> 4].astype(np.uint16) |
                 (table_u8[b & 15].astype(np.uint16) << 8))
        if sys.byteorder == "big":                          # element 2k first in memory
            pairs = pairs.byteswap()
        _pair_tables[key] = pairs
    return pairs


def decode_rotated(sums, counts, half, step, layout, out=None):
    sums = _contiguous(sums)
    if sums.dtype.kind not in "iu":
        raise TypeError(f"sums must be an integer array, got {sums.dtype}")
    out = np.empty(layout.padded, dtype=np.float32) if out is None else out
    log_p = layout.partition_size.bit_length() - 1
    _decode_rotated(sums, counts, half, step, log_p, out)
    return out


def decode_inverse(sums, counts, half, step, layout, sign_key, out=None):
    """inverse_rotate(decode_rotated(sums, counts, half, step)) without the decoded tensor:
    the full partitions are decoded chunk by chunk inside the inverse RHT (the same
    operations, so the same bits). counts: as_counts's float32 array."""
    sums = _contiguous(sums)
    if sums.dtype.kind not in "iu":
        raise TypeError(f"sums must be an integer array, got {sums.dtype}")
    out = _output(out, layout.d, "decode_inverse")
    n, full = layout.partition_size, layout.full_partitions
    threads = numba.get_num_threads()
    if n < MIN_VECTOR_PARTITION or (full == 1 and n > 4096 and threads > 1):
        # tiny partitions, or one partition shared by every thread: the two passes
        rotated = decode_rotated(sums, counts, half, step, layout,
                                 out=decoded_scratch(layout.padded))
        return inverse_rotate(rotated, layout, sign_key, out=out)
    key, scale = np.uint64(sign_key), np.float32(1.0 / np.sqrt(n))
    if full:
        rows = min(threads, full)
        nt = (4 * n * full >= NT_MIN_BYTES and out.ctypes.data % 64 == 0)
        vk.decode_inverse_partitions(sums, counts, half, step, out, n, full, key, scale,
                                     _scratch_rows(rows, n), _chunk_rows(rows), nt)
    if layout.tail:
        start, n_tail = full * n, layout.tail_padded
        tail_counts = counts if counts.shape[0] == 1 else counts[start:]
        decoded, rotated = decoded_scratch(n_tail), aligned_empty(n_tail)
        _decode_rotated(sums[start:], tail_counts, half[full:], step[full:],
                        n.bit_length() - 1, decoded)
        _transform(decoded, 0, rotated, 0, n_tail, 1, start, key,
                   np.float32(1.0 / np.sqrt(n_tail)), vk.SIGN_LAST)
        out[start:] = rotated[:layout.d - start]
    return out


def _chunk_rows(rows: int) -> np.ndarray:
    buf = getattr(_scratch, "chunks", None)
    if buf is None or buf.shape[0] < rows:
        buf = _scratch.chunks = np.empty((rows, vk.CHUNK), dtype=np.float32)
    return buf[:rows]


def decoded_scratch(length: int) -> np.ndarray:
    """A per-thread float32 buffer for decode's rotated-domain intermediate (read by the
    inverse RHT, never returned): no page faults per call."""
    buf = getattr(_scratch, "decoded", None)
    if buf is None or buf.size < length:
        buf = aligned_empty(length)
        _scratch.decoded = buf
    return buf[:length]
