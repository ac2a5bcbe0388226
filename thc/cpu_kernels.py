"""Numba CPU kernels (@njit(parallel=True)) for the codec, behind codec.THCCodec.

Every kernel releases the GIL (nogil=True): host.allreduce runs the codec on its
exchange thread while the training thread goes on with backward.

Each kernel is a plain loop; the Python functions at the bottom own shapes, dtypes and the
per-partition loop, with the same signatures as the numpy reference backend.

RHT layout of the work (why it is fast): the first pass reads x, applies the Rademacher
signs and the 1/sqrt(n) scale, and runs every stride below FWHT_BLOCK floats while the
block sits in L1/L2; the large strides then go two per pass (radix-4). Butterflies work on
slices (views) of equal length, which lets LLVM vectorize the inner loops. A 2^20
partition takes 1 + 4 passes over memory; the inverse runs the same passes in reverse
order (the FWHT stages commute) and fuses the signs and the un-padding into the last one.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import rng
from .codec import _NumpyKernels

_mix64 = njit(cache=True, inline="always")(rng.mix64)
U_GOLDEN, U_ONE, U6, U8, U40 = rng.U_GOLDEN, rng.U_ONE, rng.U6, rng.U8, rng.U40
U63MASK, U24MASK = rng.U63MASK, rng.U24MASK
UNIFORM_SCALE = rng.UNIFORM_SCALE
FWHT_BLOCK = 4096            # floats per in-cache block (16 KiB)
STAGE_CHUNK = 4096           # floats per task in a large-stride pass
NORM_CHUNK = 1 << 16


@njit(cache=True, inline="always")
def _bits(key, counter):
    return _mix64(key + (np.uint64(counter) + U_ONE) * U_GOLDEN)


@njit(cache=True, inline="always")
def _negate(pos, word):
    """Sign bit of padded position pos, given word = the hash of pos // 64."""
    return (word >> (np.uint64(pos) & U63MASK)) & U_ONE


# ---- norms ------------------------------------------------------------------------------
@njit(parallel=True, cache=True, nogil=True)
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


# ---- FWHT building blocks -----------------------------------------------------------------
@njit(cache=True, inline="always")
def _fwht8(buf, i):
    """Strides 1, 2, 4 on buf[i:i+8] in registers."""
    a0 = buf[i] + buf[i + 1]
    a1 = buf[i] - buf[i + 1]
    a2 = buf[i + 2] + buf[i + 3]
    a3 = buf[i + 2] - buf[i + 3]
    a4 = buf[i + 4] + buf[i + 5]
    a5 = buf[i + 4] - buf[i + 5]
    a6 = buf[i + 6] + buf[i + 7]
    a7 = buf[i + 6] - buf[i + 7]
    b0 = a0 + a2
    b1 = a1 + a3
    b2 = a0 - a2
    b3 = a1 - a3
    b4 = a4 + a6
    b5 = a5 + a7
    b6 = a4 - a6
    b7 = a5 - a7
    buf[i] = b0 + b4
    buf[i + 1] = b1 + b5
    buf[i + 2] = b2 + b6
    buf[i + 3] = b3 + b7
    buf[i + 4] = b0 - b4
    buf[i + 5] = b1 - b5
    buf[i + 6] = b2 - b6
    buf[i + 7] = b3 - b7


@njit(cache=True, inline="always")
def _butterfly4(v0, v1, v2, v3):
    """Two strides at once on four equal-length runs (vectorizable)."""
    for t in range(v0.shape[0]):
        a0 = v0[t]
        a1 = v1[t]
        a2 = v2[t]
        a3 = v3[t]
        b0 = a0 + a1
        b1 = a0 - a1
        b2 = a2 + a3
        b3 = a2 - a3
        v0[t] = b0 + b2
        v1[t] = b1 + b3
        v2[t] = b0 - b2
        v3[t] = b1 - b3


@njit(cache=True, inline="always")
def _butterfly2(v0, v1):
    for t in range(v0.shape[0]):
        a = v0[t]
        c = v1[t]
        v0[t] = a + c
        v1[t] = a - c


@njit(cache=True, inline="always")
def _block_stages(buf, base, block):
    """Every stride below `block` (>= 8) on buf[base:base+block], which is in cache."""
    for i in range(base, base + block, 8):
        _fwht8(buf, i)
    h = 8
    while 4 * h <= block:
        for i in range(base, base + block, 4 * h):
            _butterfly4(buf[i:i + h], buf[i + h:i + 2 * h], buf[i + 2 * h:i + 3 * h],
                        buf[i + 3 * h:i + 4 * h])
        h *= 4
    if h < block:
        for i in range(base, base + block, 2 * h):
            _butterfly2(buf[i:i + h], buf[i + h:i + 2 * h])


@njit(cache=True, nogil=True)
def _fwht_small(buf, start, n):
    """Plain radix-2 for partitions shorter than 8."""
    h = 1
    while h < n:
        for i in range(start, start + n, 2 * h):
            for j in range(i, i + h):
                a = buf[j]
                c = buf[j + h]
                buf[j] = a + c
                buf[j + h] = a - c
        h *= 2


@njit(parallel=True, cache=True, nogil=True)
def _radix4_pass(buf, start, n, h, chunk):
    """Strides h and 2h over the partition; tasks are (group of 4h, chunk of h)."""
    per_group = h // chunk
    for task in prange((n // (4 * h)) * per_group):
        i = start + (task // per_group) * 4 * h + (task % per_group) * chunk
        _butterfly4(buf[i:i + chunk], buf[i + h:i + h + chunk], buf[i + 2 * h:i + 2 * h + chunk],
                    buf[i + 3 * h:i + 3 * h + chunk])


@njit(parallel=True, cache=True, nogil=True)
def _radix2_pass(buf, start, n, h, chunk):
    per_group = h // chunk
    for task in prange((n // (2 * h)) * per_group):
        i = start + (task // per_group) * 2 * h + (task % per_group) * chunk
        _butterfly2(buf[i:i + chunk], buf[i + h:i + h + chunk])


def _large_strides(buf, start, total, n, block):
    """Strides block .. n/2 of the partitions of size n in buf[start:start+total], two
    per pass; one parallel pass covers all those partitions (fewer barriers)."""
    h = block
    while 4 * h <= n:
        _radix4_pass(buf, start, total, h, min(h, STAGE_CHUNK))
        h *= 4
    if h < n:
        _radix2_pass(buf, start, total, h, min(h, STAGE_CHUNK))


# ---- RHT passes ---------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _signed_run(src, dst, pos0, count, word, scale):
    """dst[pos0+t] = +-scale * src[pos0+t] for t < count, sign bit t of `word` (set -> -)."""
    for t in range(count):
        bit = np.float32((word >> np.uint64(t)) & U_ONE)
        dst[pos0 + t] = src[pos0 + t] * scale * (np.float32(1.0) - np.float32(2.0) * bit)


@njit(cache=True, inline="always")
def _sign_scale_range(src, dst, lo, hi, d, key, scale):
    """Apply signs and scale to positions lo..hi-1 (< d are read, the rest are zeros):
    whole 64-position words take the vectorizable path."""
    pos = lo
    while pos < hi:
        word = _bits(key, pos >> 6)
        stop = min((pos | 63) + 1, hi)
        if (pos & 63) == 0 and stop - pos == 64 and stop <= d:
            _signed_run(src, dst, pos, 64, word, scale)
        else:
            for p in range(pos, stop):
                v = src[p] * scale if p < d else np.float32(0.0)
                dst[p] = -v if _negate(p, word) else v
        pos = stop


@njit(parallel=True, cache=True, nogil=True)
def _sign_pad_blocks(x, out, d, start, n, block, key, scale):
    """Forward first pass: out = sign * scale * x (zero past d), then the in-block strides."""
    for b in prange(n // block):
        base = start + b * block
        _sign_scale_range(x, out, base, base + block, d, key, scale)
        if block >= 8:
            _block_stages(out, base, block)


@njit(parallel=True, cache=True, nogil=True)
def _blocks_sign_unpad(buf, out, d, start, n, block, key, scale):
    """Inverse last pass: the in-block strides, then out = sign * scale * buf below d."""
    for b in prange(n // block):
        base = start + b * block
        if block >= 8:
            _block_stages(buf, base, block)
        _sign_scale_range(buf, out, base, min(base + block, d), d, key, scale)


def rht_forward(x, out, d, start, total, n, key, scale):
    """out[start:start+total] = H D x / sqrt(n) for consecutive zero-padded partitions of
    size n (total a multiple of n)."""
    if n < 8:
        for s in range(start, start + total, n):
            _sign_pad_blocks(x, out, d, s, n, n, key, scale)
            _fwht_small(out, s, n)
        return
    block = min(n, FWHT_BLOCK)
    _sign_pad_blocks(x, out, d, start, total, block, key, scale)
    _large_strides(out, start, total, n, block)


def rht_inverse(buf, out, d, start, total, n, key, scale):
    """out[start:min(start+total, d)] = D H buf / sqrt(n) per partition of size n; buf is
    overwritten."""
    if n < 8:
        for s in range(start, start + total, n):
            _fwht_small(buf, s, n)
            _blocks_sign_unpad(buf, out, d, s, n, n, key, scale)
        return
    block = min(n, FWHT_BLOCK)
    _large_strides(buf, start, total, n, block)
    _blocks_sign_unpad(buf, out, d, start, total, block, key, scale)


def fwht_inplace(buf: np.ndarray, start: int, n: int) -> None:
    """Unnormalized Walsh-Hadamard transform of buf[start:start+n] (n a power of two)."""
    if n < 8:
        _fwht_small(buf, start, n)
        return
    block = min(n, FWHT_BLOCK)
    _fwht_blocks(buf, start, n, block)
    _large_strides(buf, start, n, n, block)


@njit(parallel=True, cache=True, nogil=True)
def _fwht_blocks(buf, start, n, block):
    for b in prange(n // block):
        _block_stages(buf, start + b * block, block)


# ---- quantization -----------------------------------------------------------------------
@njit(cache=True, inline="always")
def _index(x, m, sc, g, table_f32, lower, inv_width, u):
    """Bracketing table index of x after clamping to [-m, m], rounded up with probability
    (y - T[j]) * inv_width[j] (u uniform in [0, 1)). Branch-free: the coin flip is
    unpredictable, and a branch on it costs ~10x."""
    x = min(max(x, -m), m)
    y = min((x + m) * sc, g)
    j = np.int64(lower[np.int64(y)])
    frac = (y - table_f32[j]) * inv_width[j]
    return j + np.int64(u < frac)


@njit(parallel=True, cache=True, nogil=True)
def _quantize(rot, half, scale, table_f32, lower, inv_width, log_p, key, out):
    """Clamp, map to grid units, stochastically round to a bracketing table value, pack
    (element 2k in the high nibble). Returns the number of NaN/Inf inputs (index 0)."""
    g = table_f32[table_f32.shape[0] - 1]
    nonfinite = 0
    for k in prange(out.shape[0]):
        e = 2 * k
        part = e >> log_p              # both elements of a byte share a partition
        m = half[part]
        sc = scale[part]
        word = _bits(key, k)
        u_hi = np.float32(word >> U40) * UNIFORM_SCALE
        u_lo = np.float32((word >> U8) & U24MASK) * UNIFORM_SCALE
        x0 = rot[e]
        x1 = rot[e + 1]
        ok0 = np.isfinite(x0)
        ok1 = np.isfinite(x1)
        if not (ok0 and ok1):          # rare: count, and quantize a 0 in their place
            nonfinite += np.int64(not ok0) + np.int64(not ok1)
            x0 = x0 if ok0 else np.float32(0.0)
            x1 = x1 if ok1 else np.float32(0.0)
        z0 = _index(x0, m, sc, g, table_f32, lower, inv_width, u_hi)
        z1 = _index(x1, m, sc, g, table_f32, lower, inv_width, u_lo)
        out[k] = (z0 << 4) | z1
    return nonfinite


@njit(parallel=True, cache=True, nogil=True)
def _lookup(packed, table_u8, out):
    for k in prange(packed.shape[0]):
        b = packed[k]
        out[2 * k] = table_u8[b >> 4]
        out[2 * k + 1] = table_u8[b & 15]


@njit(parallel=True, cache=True, nogil=True)
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


def rotate(a, layout, sign_key):
    a = _contiguous(a, np.float32)
    out = np.empty(layout.padded, dtype=np.float32)
    key = np.uint64(sign_key)
    for s, total, n in layout.segments():
        rht_forward(a, out, layout.d, s, total, n, key, np.float32(1.0 / np.sqrt(n)))
    return out


def inverse_rotate(a, layout, sign_key, overwrite=False):
    buf = _contiguous(a, np.float32) if overwrite else np.array(a, dtype=np.float32, copy=True)
    out = np.empty(layout.d, dtype=np.float32)
    key = np.uint64(sign_key)
    for s, total, n in layout.segments():
        rht_inverse(buf, out, layout.d, s, total, n, key, np.float32(1.0 / np.sqrt(n)))
    return out


def quantize(a, half, scale, codec, layout, key):
    a = _contiguous(a, np.float32)
    out = np.empty(layout.padded // 2, dtype=np.uint8)
    log_p = layout.partition_size.bit_length() - 1
    nonfinite = _quantize(a, half, scale, codec.table_f32, codec.lower, codec.inv_width, log_p,
                          np.uint64(key), out)
    return out, int(nonfinite)


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
