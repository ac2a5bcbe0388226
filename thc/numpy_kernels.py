"""The numpy reference (thc.reference) behind the kernel interface that codec.THCCodec calls.

The "numpy" backend of the codec. The CPU kernels (thc.cpu_kernels) reuse its shape and
buffer helpers (as_flat, wrap_like, pad, ...), which are plain numpy in both.
"""
from __future__ import annotations

import numpy as np

from . import reference
from .arrays import host_numpy, is_torch, torch_module


def as_flat(x, name, dtype="float32"):
    """A 1-D numpy view of x (a CPU torch tensor is viewed without copying), converted to
    dtype unless dtype is None."""
    if is_torch(x):
        a = x.detach().reshape(-1).numpy()
    else:
        a = np.asarray(x).reshape(-1)
    if dtype is not None and a.dtype != np.dtype(dtype):
        a = a.astype(dtype)
    return a


def length(a):
    return a.shape[0]


def wrap_like(x, out):
    """out as the kind x came as: torch in, torch out."""
    if is_torch(x):
        return torch_module().from_numpy(np.ascontiguousarray(out))
    return out


def as_counts(counts, padded):
    c = np.asarray(host_numpy(counts))
    if c.ndim == 0:
        return c.astype(np.float32)
    if c.shape != (padded,):
        raise ValueError(f"counts: per-element counts need length {padded}, got {c.shape}")
    return c.astype(np.float32)


def partition_norms(a, layout):
    return reference.partition_norms(a, layout)


def pad(a, layout):
    out = np.zeros(layout.padded, dtype=np.float32)
    out[:layout.d] = a
    return out


def unpad(a, layout):
    return np.ascontiguousarray(a[:layout.d])


def rotate(a, layout, sign_key):
    return reference.rotate(a, layout, sign_key)


def inverse_rotate(a, layout, sign_key, overwrite=False):
    return reference.inverse_rotate(a, layout, sign_key)


def quantize(a, half, scale, codec, layout, key):
    nonfinite = int((~np.isfinite(a)).sum())
    if nonfinite:
        return None, nonfinite
    return reference.quantize(a, half, scale, codec.table, codec.lower, codec.inv_width,
                              layout, key), 0


def lookup(packed, table_u8):
    return reference.lookup(packed, table_u8)


def decode_rotated(sums, counts, half, step, layout):
    return reference.decode_rotated(sums, counts, half, step, layout)


def add_inplace(a, b):
    np.add(a, b, out=a)


def subtract(a, b, out):
    np.subtract(a, b, out=out)


def copy_into(dst, src):
    np.copyto(dst, src)
