"""Plain numpy reference of every codec step (float32 arithmetic, same order of operations
as the Numba kernels, so quantization indices agree bit for bit given the same input)."""
from __future__ import annotations

import numpy as np

from . import rng
from .layout import Layout


def fwht(v: np.ndarray) -> np.ndarray:
    """Unnormalized Walsh-Hadamard transform of a power-of-two float32 vector (a new array)."""
    n = len(v)
    out = v.astype(np.float32, copy=True)
    h = 1
    while h < n:
        pairs = out.reshape(-1, 2, h)
        a, b = pairs[:, 0, :].copy(), pairs[:, 1, :]
        pairs[:, 0, :] = a + b
        pairs[:, 1, :] = a - b
        h *= 2
    return out


def partition_norms(x: np.ndarray, layout: Layout) -> np.ndarray:
    norms = np.empty(layout.num_partitions, dtype=np.float32)
    for k, (s, n) in enumerate(zip(layout.starts(), layout.data_lengths())):
        part = x[s:s + n].astype(np.float64)
        norms[k] = np.sqrt(np.dot(part, part))
    return norms


def rotate(x: np.ndarray, layout: Layout, sign_key: int) -> np.ndarray:
    out = np.zeros(layout.padded, dtype=np.float32)
    out[:layout.d] = x
    for s, n in zip(layout.starts(), layout.sizes()):
        signs = rng.signs_np(sign_key, np.arange(s, s + n))
        scale = np.float32(1.0 / np.sqrt(n))
        out[s:s + n] = fwht(out[s:s + n] * signs * scale)
    return out


def inverse_rotate(y: np.ndarray, layout: Layout, sign_key: int) -> np.ndarray:
    out = np.empty(layout.padded, dtype=np.float32)
    for s, n in zip(layout.starts(), layout.sizes()):
        signs = rng.signs_np(sign_key, np.arange(s, s + n))
        scale = np.float32(1.0 / np.sqrt(n))
        out[s:s + n] = fwht(y[s:s + n]) * scale * signs
    return out[:layout.d]


def element_partition(layout: Layout) -> np.ndarray:
    return np.arange(layout.padded) // layout.partition_size


def quantize(rotated: np.ndarray, half_range: np.ndarray, grid_scale: np.ndarray,
             table: np.ndarray, lower: np.ndarray, inv_width: np.ndarray, layout: Layout,
             key: int) -> np.ndarray:
    """Clamp to [-M, M], map to grid units y in [0, g], round to a bracketing table value
    (up with probability (y - T[j]) * inv_width[j], inv_width[j] = float32(1 / (T[j+1] - T[j]))),
    pack two 4-bit indices per byte."""
    g = np.float32(table[-1])
    part = element_partition(layout)
    m = half_range[part]
    x = np.minimum(np.maximum(rotated.astype(np.float32), -m), m)
    y = np.minimum((x + m) * grid_scale[part], g)
    j = lower[y.astype(np.int64)].astype(np.int64)
    lo = table[j].astype(np.float32)
    frac = (y - lo) * inv_width[j]
    up = rng.uniforms_np(key, np.arange(layout.padded)) < frac
    z = (j + up).astype(np.uint8)
    return pack(z)


def pack(z: np.ndarray) -> np.ndarray:
    return ((z[0::2] << 4) | z[1::2]).astype(np.uint8)


def unpack(packed: np.ndarray) -> np.ndarray:
    z = np.empty(2 * len(packed), dtype=np.uint8)
    z[0::2] = packed >> 4
    z[1::2] = packed & 0x0F
    return z


def lookup(packed: np.ndarray, table: np.ndarray) -> np.ndarray:
    return table.astype(np.uint8)[unpack(packed)]


def decode_rotated(sums: np.ndarray, counts: np.ndarray, half_range: np.ndarray,
                   step: np.ndarray, layout: Layout) -> np.ndarray:
    """-M + (Y / count) * (2M / g) per element; count 0 (nobody contributed) -> 0."""
    part = element_partition(layout)
    counts = np.broadcast_to(np.asarray(counts), (layout.padded,)).astype(np.float32)
    safe = np.where(counts > 0, counts, np.float32(1.0))
    v = (sums.astype(np.float32) / safe) * step[part] - half_range[part]
    return np.where(counts > 0, v, np.float32(0.0)).astype(np.float32)
