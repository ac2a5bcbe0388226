"""Numba CPU kernels for the codec, behind codec.THCCodec.

The RHT and the quantizer are thc.vector_kernels (explicit 16-lane vectors: FFHT-class
FWHT with the signs and the scale fused in, table lookups in registers); this module owns
shapes, padding, scratch buffers and the choice of threads, with the same signatures as
the numpy reference backend. Norms, lookup and decode are plain Numba loops (LLVM
vectorizes them).

RHT work layout (why it is fast): see thc.vector_kernels. In short, every float is read
once and written once; the 4 smallest strides are lane shuffles inside one vector, the
next 4 are across 16 vectors in registers, and each larger stride level is one radix-16
sweep while its group is in L1, L2 or L3. The output of a large tensor is written with
non-temporal stores. The forward and inverse RHT are bit-identical to thc.reference.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange

from . import rng
from . import vector_kernels as vk
from .codec import _NumpyKernels

_mix64 = njit(cache=True, inline="always")(rng.mix64)
U_GOLDEN, U_ONE = rng.U_GOLDEN, rng.U_ONE
NORM_CHUNK = 1 << 16
NT_MIN_BYTES = 1 << 23       # outputs at least this large skip the cache (streaming stores)
MIN_VECTOR_PARTITION = vk.LANES


@njit(cache=True, inline="always")
def _bits(key, counter):
    return _mix64(key + (np.uint64(counter) + U_ONE) * U_GOLDEN)


# ---- norms ------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def _chunk_sumsq(x, chunk):
    n = x.shape[0]
    chunks = (n + chunk - 1) // chunk
    out = np.zeros(chunks, dtype=np.float64)
    for c in prange(chunks):
        acc = 0.0
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            v = np.float64(x[i])
            acc += v * v
        out[c] = acc
    return out


# ---- RHT --------------------------------------------------------------------------------
@njit(cache=True)
def _tiny_partitions(src, si, dst, di, n, count, pos, key, scale, mode):
    """Partitions of fewer than 16 floats (2, 4 or 8): scalar radix-2, same operation
    order as the vector kernels and the reference."""
    buf = np.empty(n, dtype=np.float32)
    for k in range(count):
        for j in range(n):
            v = src[si + k * n + j]
            if mode == vk.FORWARD:
                p = pos + k * n + j
                v = v * scale
                if (_bits(key, p >> 6) >> np.uint64(p & 63)) & U_ONE:
                    v = -v
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
        for j in range(n):
            v = buf[j]
            if mode == vk.INVERSE:
                p = pos + k * n + j
                v = v * scale
                if (_bits(key, p >> 6) >> np.uint64(p & 63)) & U_ONE:
                    v = -v
            dst[di + k * n + j] = v


_scratch = threading.local()        # per calling thread: the kernels' scratch rows


def _scratch_rows(rows: int, n: int) -> np.ndarray:
    """(rows, scratch_size(n)) float32, reused across calls (no page faults per call)."""
    size = vk.scratch_size(n) if n > vk.CHUNK else 1
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * size:
        buf = np.empty(rows * size, dtype=np.float32)
        _scratch.buf = buf
    return buf[:rows * size].reshape(rows, size)


def aligned_empty(n: int) -> np.ndarray:
    """float32[n] starting on a 64-byte boundary (whole cache lines for streaming stores)."""
    raw = np.empty(n + 16, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip:skip + n]


def _transform(src, si, dst, di, n, count, pos, key, scale, mode):
    """`count` partitions of n floats src[si:] -> dst[di:] (pos: padded position of the
    first one, for the signs); mode vk.PLAIN, FORWARD or INVERSE."""
    if count == 0:
        return
    if n < MIN_VECTOR_PARTITION:
        _tiny_partitions(src, si, dst, di, n, count, pos, key, scale, mode)
        return
    nt = (4 * n * count >= NT_MIN_BYTES and (dst.ctypes.data + 4 * di) % 64 == 0)
    threads = numba.get_num_threads()
    if count == 1 and n > 4096 and threads > 1:
        vk.fwht_shared_partition(src, si, dst, di, n, pos, key, scale,
                                 _scratch_rows(1, n)[0], mode, nt)
    else:
        vk.fwht_partitions(src, si, dst, di, n, count, pos, key, scale,
                           _scratch_rows(min(threads, count), n), mode, nt)


def fwht_inplace(buf: np.ndarray, start: int, n: int) -> None:
    """Unnormalized Walsh-Hadamard transform of buf[start:start+n] (n a power of two)."""
    _transform(buf, start, buf, start, n, 1, 0, np.uint64(0), np.float32(1.0), vk.PLAIN)


def rht_forward(x, out, d, start, total, n, key, scale):
    """out[start:start+total] = H D x / sqrt(n) for consecutive zero-padded partitions of
    size n (total a multiple of n); x holds the d unpadded floats."""
    count = total // n
    if start + total <= d:
        _transform(x, start, out, start, n, count, start, key, scale, vk.FORWARD)
        return
    # the last partition runs past d: its zero-padded copy goes through the same kernels
    _transform(x, start, out, start, n, count - 1, start, key, scale, vk.FORWARD)
    last = start + (count - 1) * n
    padded = np.zeros(n, dtype=np.float32)
    padded[:d - last] = x[last:d]
    _transform(padded, 0, out, last, n, 1, last, key, scale, vk.FORWARD)


def rht_inverse(y, out, d, start, total, n, key, scale):
    """out[start:min(start+total, d)] = D H y / sqrt(n) per partition of size n (y is
    only read)."""
    count = total // n
    if start + total <= d:
        _transform(y, start, out, start, n, count, start, key, scale, vk.INVERSE)
        return
    _transform(y, start, out, start, n, count - 1, start, key, scale, vk.INVERSE)
    last = start + (count - 1) * n
    tail = aligned_empty(n)
    _transform(y, last, tail, 0, n, 1, last, key, scale, vk.INVERSE)
    out[last:d] = tail[:d - last]


# ---- lookup and decode ----------------------------------------------------------------
@njit(parallel=True, cache=True)
def _lookup(packed, table_u8, out):
    for k in prange(packed.shape[0]):
        b = packed[k]
        out[2 * k] = table_u8[b >> 4]
        out[2 * k + 1] = table_u8[b & 15]


@njit(parallel=True, cache=True)
def _decode_rotated(sums, counts, half, step, log_p, out):
    """-M + (Y / count) * step per element; count 0 -> 0. counts: 1 entry or one each."""
    per_element = counts.shape[0] > 1
    for i in prange(out.shape[0]):
        c = counts[i] if per_element else counts[0]
        part = i >> log_p
        if c > 0:
            out[i] = (np.float32(sums[i]) / c) * step[part] - half[part]
        else:
            out[i] = np.float32(0.0)


# ---- the backend interface the codec calls ----------------------------------------------
as_flat = _NumpyKernels.as_flat
length = _NumpyKernels.length
wrap_like = _NumpyKernels.wrap_like
pad = _NumpyKernels.pad
unpad = _NumpyKernels.unpad


def _contiguous(a, dtype=None):
    return np.ascontiguousarray(a, dtype=dtype)


def as_counts(counts, padded):
    c = _NumpyKernels.as_counts(counts, padded)
    return np.ascontiguousarray(c.reshape(-1), dtype=np.float32)


def partition_norms(a, layout):
    a = _contiguous(a, np.float32)
    chunk = min(layout.partition_size, NORM_CHUNK)
    sums = _chunk_sumsq(a, chunk)
    per_part = layout.partition_size // chunk
    norms = np.zeros(layout.num_partitions, dtype=np.float64)
    np.add.at(norms, np.arange(len(sums)) // per_part, sums)
    return np.sqrt(norms).astype(np.float32)


def _output(out, length, what):
    """The caller's output buffer, checked, or a fresh cache-line-aligned one."""
    if out is None:
        return aligned_empty(length)
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.ndim == 1
            and out.shape[0] == length and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"{what}: out must be a writable contiguous float32 array of length "
                         f"{length}")
    return out


def rotate(a, layout, sign_key, out=None):
    a = _contiguous(a, np.float32)
    out = _output(out, layout.padded, "rotate")
    if np.shares_memory(a, out):
        a = a.copy()                 # the tail padding would read what it just wrote
    key = np.uint64(sign_key)
    for s, total, n in layout.segments():
        rht_forward(a, out, layout.d, s, total, n, key, np.float32(1.0 / np.sqrt(n)))
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


def quantize(a, half, scale, codec, layout, key):
    a = _contiguous(a, np.float32)
    out = np.empty(layout.padded // 2, dtype=np.uint8)
    cells, inv_width = _quantizer_tables(codec)
    log_p = layout.partition_size.bit_length() - 1
    nonfinite = vk.quantize(a, half, scale, np.float32(codec.granularity), cells, inv_width,
                            log_p, np.uint64(key), out)
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
    _lookup(packed, table_u8, out)
    return out


def decode_rotated(sums, counts, half, step, layout):
    sums = _contiguous(sums)
    if sums.dtype.kind not in "iu":
        raise TypeError(f"sums must be an integer array, got {sums.dtype}")
    out = np.empty(layout.padded, dtype=np.float32)
    log_p = layout.partition_size.bit_length() - 1
    _decode_rotated(sums, counts, half, step, log_p, out)
    return out
