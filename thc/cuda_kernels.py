"""Numba CUDA kernels for the codec, behind codec.THCCodec (picked for CUDA inputs).

Same semantics and the same float32 operation order as thc.reference and the CPU kernels
(thc.vector_kernels), so quantization indices agree bit for bit (the hash is integer-only;
no fused multiply-add pattern is present in the quantizer). Torch CUDA tensors are viewed through
__cuda_array_interface__ (no copies); outputs come back as torch tensors on the same
device, or as Numba device arrays for Numba inputs. Tested under NUMBA_ENABLE_CUDASIM=1.

Where torch has CUDA, the kernels run on torch's current stream and new buffers come from
torch's caching allocator: a call then neither waits for the GPU to drain (importing a torch
tensor on its own stream needs no synchronization) nor pays cudaMalloc and cudaFree for
each tensor-sized output. The codec's constant tables are copied to the device once.
"""
from __future__ import annotations

import math
import sys

import numpy as np
from numba import cuda

from . import rng
from .arrays import is_torch, torch_module

U_GOLDEN, U_ONE, U6, U8, U40 = rng.U_GOLDEN, rng.U_ONE, rng.U6, rng.U8, rng.U40
U63MASK, U24MASK = rng.U63MASK, rng.U24MASK
UNIFORM_SCALE = rng.UNIFORM_SCALE
THREADS = 256
SHARED_FWHT = 2048           # floats per shared-memory FWHT block (8 KiB)
NORM_CHUNK = 4096

_mix64 = cuda.jit(device=True)(rng.mix64)


@cuda.jit(device=True)
def _bits(key, counter):
    return _mix64(key + (np.uint64(counter) + U_ONE) * U_GOLDEN)


@cuda.jit(device=True)
def _negate(key, pos):
    """Sign bit of padded position pos: bit pos % 64 of the hash of pos // 64."""
    upos = np.uint64(pos)
    return (_bits(key, upos >> U6) >> (upos & U63MASK)) & U_ONE


def _grid(n: int, stream) -> tuple:
    """Launch configuration: one thread per item, on `stream`."""
    return max((n + THREADS - 1) // THREADS, 1), THREADS, stream


def _torch_cuda():
    """torch where it is loaded and has CUDA (it is never imported here), else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_available() else None


_STREAMS: dict = {}


def _stream():
    """torch's current stream where torch has CUDA (so the codec's work is ordered with the
    caller's), else the default stream."""
    torch = _torch_cuda()
    handle = torch.cuda.current_stream().cuda_stream if torch is not None else 0
    found = _STREAMS.get(handle)
    if found is None:
        found = _STREAMS[handle] = cuda.external_stream(handle) if handle else \
            cuda.default_stream()
    return found


def _empty(n: int, dtype):
    """An uninitialized device array: from torch's caching allocator where torch has CUDA."""
    torch = _torch_cuda()
    if torch is None:
        return cuda.device_array(n, dtype=dtype)
    t = torch.empty(n, dtype=getattr(torch, np.dtype(dtype).name),
                    device=torch.device("cuda", torch.cuda.current_device()))
    return cuda.as_cuda_array(t, sync=False)


_CONSTANTS: dict = {}


def _constant(array: np.ndarray):
    """A device copy of a small constant table (the codec's), made once per content."""
    device = getattr(cuda.get_current_device(), "id", 0)      # the simulator's has none
    key = (array.dtype.str, array.tobytes(), device)
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = cuda.to_device(array)
    return found


# ---- kernels ----------------------------------------------------------------------------
@cuda.jit
def _chunk_sumsq(x, chunk, log_p, sums):
    """One block per chunk; shared-memory tree sum; atomic add into its partition."""
    acc = cuda.shared.array(THREADS, dtype=np.float64)
    t = cuda.threadIdx.x
    base = cuda.blockIdx.x * chunk
    stop = min(base + chunk, x.shape[0])
    s = 0.0
    for i in range(base + t, stop, cuda.blockDim.x):
        v = np.float64(x[i])
        s += v * v
    acc[t] = s
    cuda.syncthreads()
    width = cuda.blockDim.x // 2
    while width > 0:
        if t < width:
            acc[t] += acc[t + width]
        cuda.syncthreads()
        width //= 2
    if t == 0:
        cuda.atomic.add(sums, base >> log_p, acc[0])


@cuda.jit
def _sign_scale_unpad(buf, out, d, start, n, key, scale):
    i = cuda.grid(1)
    pos = start + i
    if i < n and pos < d:
        v = buf[pos] * scale
        out[pos] = -v if _negate(key, pos) else v


@cuda.jit(device=True)
def _shared_stages(sm, t, block):
    """Every stride below `block` of the FWHT held in shared memory, ascending (the
    reference's order); thread t does one butterfly per stride. The index arithmetic is
    shifts and masks: a division by the stride costs tens of instructions per butterfly."""
    log_h = 0
    while (1 << log_h) < block:
        h = 1 << log_h
        i = ((t >> log_h) << (log_h + 1)) | (t & (h - 1))
        a = sm[i]
        c = sm[i + h]
        sm[i] = a + c
        sm[i + h] = a - c
        cuda.syncthreads()
        log_h += 1


@cuda.jit
def _fwht_shared(buf, start, block):
    """All strides below `block` in shared memory; block/2 threads, one butterfly each."""
    sm = cuda.shared.array(SHARED_FWHT, dtype=np.float32)
    t = cuda.threadIdx.x
    base = start + cuda.blockIdx.x * block
    for i in range(t, block, cuda.blockDim.x):
        sm[i] = buf[base + i]
    cuda.syncthreads()
    _shared_stages(sm, t, block)
    for i in range(t, block, cuda.blockDim.x):
        buf[base + i] = sm[i]


@cuda.jit
def _sign_fwht_shared(x, out, d, start, block, key, scale):
    """The RHT's first pass: each block loads its slice of x scaled by 1/sqrt(n), with the
    random signs and the zero padding applied (_sign_scale_unpad's inverse), runs the
    shared-memory strides and writes out."""
    sm = cuda.shared.array(SHARED_FWHT, dtype=np.float32)
    t = cuda.threadIdx.x
    base = start + cuda.blockIdx.x * block
    for i in range(t, block, cuda.blockDim.x):
        pos = base + i
        v = x[pos] * scale if pos < d else np.float32(0.0)
        sm[i] = -v if _negate(key, pos) else v
    cuda.syncthreads()
    _shared_stages(sm, t, block)
    for i in range(t, block, cuda.blockDim.x):
        out[base + i] = sm[i]


@cuda.jit
def _fwht_stage(buf, start, total, log_h):
    """Stride h over buf[start:start+total]: one thread per butterfly."""
    q = cuda.grid(1)
    if q < total // 2:
        h = 1 << log_h
        i = start + ((q >> log_h) << (log_h + 1)) + (q & (h - 1))
        a = buf[i]
        c = buf[i + h]
        buf[i] = a + c
        buf[i + h] = a - c


@cuda.jit
def _fwht_stage4(buf, start, total, log_h):
    """Strides h and 2h in one pass: one thread per (i, i+h, i+2h, i+3h)."""
    q = cuda.grid(1)
    if q < total // 4:
        h = 1 << log_h
        i = start + ((q >> log_h) << (log_h + 2)) + (q & (h - 1))
        a0 = buf[i]
        a1 = buf[i + h]
        a2 = buf[i + 2 * h]
        a3 = buf[i + 3 * h]
        b0 = a0 + a1
        b1 = a0 - a1
        b2 = a2 + a3
        b3 = a2 - a3
        buf[i] = b0 + b2
        buf[i + h] = b1 + b3
        buf[i + 2 * h] = b0 - b2
        buf[i + 3 * h] = b1 - b3


@cuda.jit(device=True)
def _index(x, m, sc, g, table_f32, lower, inv_width, u):
    """Same arithmetic, same order as reference.quantize and vector_kernels._quantize_lanes
    (bit-identical indices)."""
    x = min(max(x, -m), m)
    y = min((x + m) * sc, g)
    j = np.int64(lower[np.int64(y)])
    frac = (y - table_f32[j]) * inv_width[j]
    return j + np.int64(u < frac)


@cuda.jit
def _quantize(rot, half, scale, table_f32, lower, inv_width, log_p, key, out, nonfinite):
    """One thread per packed byte (elements 2k, 2k+1; one hash gives both uniforms)."""
    k = cuda.grid(1)
    if k < out.shape[0]:
        g = table_f32[table_f32.shape[0] - 1]
        e = 2 * k
        part = e >> log_p
        m = half[part]
        sc = scale[part]
        word = _bits(key, k)
        u_hi = np.float32(word >> U40) * UNIFORM_SCALE
        u_lo = np.float32((word >> U8) & U24MASK) * UNIFORM_SCALE
        x0 = rot[e]
        x1 = rot[e + 1]
        z0 = 0
        z1 = 0
        if math.isfinite(x0):
            z0 = _index(x0, m, sc, g, table_f32, lower, inv_width, u_hi)
        else:
            cuda.atomic.add(nonfinite, 0, 1)
        if math.isfinite(x1):
            z1 = _index(x1, m, sc, g, table_f32, lower, inv_width, u_lo)
        else:
            cuda.atomic.add(nonfinite, 0, 1)
        out[k] = (z0 << 4) | z1


@cuda.jit
def _lookup(packed, table_u8, out):
    k = cuda.grid(1)
    if k < packed.shape[0]:
        b = packed[k]
        out[2 * k] = table_u8[b >> 4]
        out[2 * k + 1] = table_u8[b & 15]


@cuda.jit
def _decode_rotated(sums, counts, half, step, log_p, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        c = counts[i] if counts.shape[0] > 1 else counts[0]
        part = i >> log_p
        if c > 0:
            out[i] = (np.float32(sums[i]) / c) * step[part] - half[part]
        else:
            out[i] = np.float32(0.0)


@cuda.jit
def _add_inplace(a, b):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = a[i] + b[i]


@cuda.jit
def _subtract(a, b, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] - b[i]


# ---- the backend interface the codec calls ----------------------------------------------
def as_flat(x, name, dtype="float32"):
    """A 1-D Numba device view of x (torch CUDA tensor or Numba device array)."""
    if is_torch(x):
        t = x.detach().reshape(-1)
        if dtype is not None and t.dtype != getattr(torch_module(), dtype):
            t = t.to(getattr(torch_module(), dtype))
        # made on the stream the kernels run on (_stream): no synchronization needed
        return cuda.as_cuda_array(t.contiguous(), sync=False)
    a = x.reshape(x.size) if len(x.shape) != 1 else x
    if dtype is not None and a.dtype != np.dtype(dtype):
        a = cuda.to_device(a.copy_to_host().astype(dtype))
    return a


def length(a):
    return a.shape[0]


def wrap_like(x, out):
    if is_torch(x):
        return torch_module().as_tensor(out, device=x.device)
    return out


def as_counts(counts, padded):
    if is_torch(counts) and counts.is_cuda and counts.numel() == padded:
        return as_flat(counts, "counts")            # stays on the device, no round trip
    if is_torch(counts) or hasattr(counts, "copy_to_host"):
        c = counts.detach().cpu().numpy() if is_torch(counts) else counts.copy_to_host()
    else:
        c = np.asarray(counts)
    c = c.astype(np.float32).reshape(-1)
    if c.shape[0] not in (1, padded):
        raise ValueError(f"counts: per-element counts need length {padded}, got {c.shape}")
    return cuda.to_device(c, stream=_stream())


def partition_norms(a, layout):
    s = _stream()
    sums = cuda.to_device(np.zeros(layout.num_partitions, dtype=np.float64), stream=s)
    if layout.d:
        chunk = min(layout.partition_size, NORM_CHUNK)
        blocks = (layout.d + chunk - 1) // chunk
        _chunk_sumsq[blocks, THREADS, s](a, chunk, layout.partition_size.bit_length() - 1,
                                         sums)
    host = sums.copy_to_host(stream=s)
    s.synchronize()
    return np.sqrt(host).astype(np.float32)


def pad(a, layout):
    s = _stream()
    out = cuda.to_device(np.zeros(layout.padded, dtype=np.float32), stream=s)
    out[:layout.d].copy_to_device(a, stream=s)
    return out


def unpad(a, layout):
    out = _empty(layout.d, np.float32)
    out.copy_to_device(a[:layout.d], stream=_stream())
    return out


def fwht_inplace(buf, start: int, total: int, n: int, s) -> None:
    """Unnormalized FWHT of each size-n partition in buf[start:start+total]: strides below
    2048 in shared memory, then two global strides per launch."""
    block = min(n, SHARED_FWHT)
    _fwht_shared[total // block, block // 2, s](buf, start, block)
    fwht_global(buf, start, total, n, block, s)


def fwht_global(buf, start: int, total: int, n: int, block: int, s) -> None:
    """The FWHT's strides from `block` up to n/2, two per launch where they pair up."""
    log_h = block.bit_length() - 1
    log_n = n.bit_length() - 1
    while log_h + 2 <= log_n:
        _fwht_stage4[_grid(total // 4, s)](buf, start, total, log_h)
        log_h += 2
    if log_h < log_n:
        _fwht_stage[_grid(total // 2, s)](buf, start, total, log_h)


def rotate(a, layout, sign_key):
    s = _stream()
    out = _empty(layout.padded, np.float32)
    key = np.uint64(sign_key)
    for start, total, n in layout.segments():
        block = min(n, SHARED_FWHT)
        _sign_fwht_shared[total // block, block // 2, s](a, out, layout.d, start, block, key,
                                                         np.float32(1.0 / np.sqrt(n)))
        fwht_global(out, start, total, n, block, s)
    return out


def inverse_rotate(a, layout, sign_key, overwrite=False):
    s = _stream()
    if overwrite:
        buf = a
    else:
        buf = _empty(layout.padded, np.float32)
        buf.copy_to_device(a, stream=s)
    out = _empty(layout.d, np.float32)
    key = np.uint64(sign_key)
    for start, total, n in layout.segments():
        fwht_inplace(buf, start, total, n, s)
        _sign_scale_unpad[_grid(total, s)](buf, out, layout.d, start, total, key,
                                           np.float32(1.0 / np.sqrt(n)))
    return out


def quantize(a, half, scale, codec, layout, key):
    s = _stream()
    out = _empty(layout.padded // 2, np.uint8)
    nonfinite = cuda.to_device(np.zeros(1, dtype=np.int32), stream=s)
    _quantize[_grid(out.shape[0], s)](
        a, cuda.to_device(half, stream=s), cuda.to_device(scale, stream=s),
        _constant(codec.table_f32), _constant(codec.lower), _constant(codec.inv_width),
        layout.partition_size.bit_length() - 1, np.uint64(key), out, nonfinite)
    count = nonfinite.copy_to_host(stream=s)
    s.synchronize()
    return out, int(count[0])


def lookup(packed, table_u8):
    s = _stream()
    out = _empty(2 * packed.shape[0], np.uint8)
    _lookup[_grid(packed.shape[0], s)](packed, _constant(table_u8), out)
    return out


def decode_rotated(sums, counts, half, step, layout):
    if np.dtype(sums.dtype).kind not in "iu":
        raise TypeError(f"sums must be an integer array, got {sums.dtype}")
    s = _stream()
    out = _empty(layout.padded, np.float32)
    _decode_rotated[_grid(layout.padded, s)](sums, counts, cuda.to_device(half, stream=s),
                                             cuda.to_device(step, stream=s),
                                             layout.partition_size.bit_length() - 1, out)
    return out


def add_inplace(a, b):
    _add_inplace[_grid(a.shape[0], _stream())](a, b)


def subtract(a, b, out):
    _subtract[_grid(out.shape[0], _stream())](a, b, out)


def copy_into(dst, src):
    dst.copy_to_device(src, stream=_stream())
