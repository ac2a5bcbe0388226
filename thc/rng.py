"""Counter-based randomness shared by the numpy reference, the Numba CPU and CUDA kernels.

One integer hash (the splitmix64 finalizer) turns a 64-bit counter into 64 random bits.
Keys are derived on the host from (seed, purpose, round, tensor, worker); each element's
bits are mix64(key + (i + 1) * GOLDEN) for its padded position i, so every backend sees
the same bits with no generator state to ship around.

- Rademacher signs of the RHT under rademacher_key(seed), for the global padded position
  (partition k, offset j) -> i = k * partition_size + j: bit (i mod 64) of the hash of
  counter i // 64 (one hash per 64 signs); bit set -> -1.
- Stochastic rounding under rounding_key(seed, round, tensor, worker): element e uses the
  hash of counter e // 2 (one per packed byte); even e takes bits 40..63, odd e bits 8..31,
  as a float32 uniform in [0, 1) with 24 random bits.
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
PURPOSE_RADEMACHER = 0x5248_5400     # "RHT"
PURPOSE_ROUNDING = 0x5351_0000       # "SQ"

# numpy scalars: Numba freezes these as uint64 constants, so no mixed-sign promotion.
U_GOLDEN = np.uint64(GOLDEN)
U_MUL1 = np.uint64(MUL1)
U_MUL2 = np.uint64(MUL2)
U_ONE = np.uint64(1)
U30, U27, U31, U40, U63 = (np.uint64(s) for s in (30, 27, 31, 40, 63))
U6, U8, U63MASK = np.uint64(6), np.uint64(8), np.uint64(63)
U24MASK = np.uint64(0xFFFFFF)
UNIFORM_SCALE = np.float32(1.0 / (1 << 24))


def mix64_int(z: int) -> int:
    """splitmix64 finalizer on a Python int (host-side key derivation)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MUL1) & MASK64
    z = ((z ^ (z >> 27)) * MUL2) & MASK64
    return z ^ (z >> 31)


def derive_key(*parts: int) -> int:
    """Fold integers into one 64-bit key (order matters; negative values refused)."""
    key = 0
    for part in parts:
        if part < 0:
            raise ValueError(f"key parts must be non-negative integers, got {part}")
        key = mix64_int((key ^ (part & MASK64)) + GOLDEN)
    return key


def rademacher_key(seed: int) -> int:
    return derive_key(PURPOSE_RADEMACHER, seed)


def rounding_key(seed: int, round: int, tensor: int, worker: int) -> int:
    return derive_key(PURPOSE_ROUNDING, seed, round, tensor, worker)


def mix64(z):
    """splitmix64 finalizer on a uint64 scalar: the one kernel-side hash (Numba CPU/CUDA)."""
    z = (z ^ (z >> U30)) * U_MUL1
    z = (z ^ (z >> U27)) * U_MUL2
    return z ^ (z >> U31)


def element_bits(key, i):
    """64 random bits for element i under key (uint64 key, integer i)."""
    return mix64(key + (np.uint64(i) + U_ONE) * U_GOLDEN)


# ---- vectorized numpy versions (the reference) -------------------------------------------

def element_bits_np(key: int, positions: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = np.uint64(key) + (positions.astype(np.uint64) + U_ONE) * U_GOLDEN
        z = (z ^ (z >> U30)) * U_MUL1
        z = (z ^ (z >> U27)) * U_MUL2
        return z ^ (z >> U31)


def signs_np(key: int, positions: np.ndarray) -> np.ndarray:
    """+1/-1 float32 per position: bit (i mod 64) of the hash of i // 64, set -> -1."""
    positions = positions.astype(np.uint64)
    bits = element_bits_np(key, positions >> U6)
    bit = (bits >> (positions & U63MASK)) & U_ONE
    return np.float32(1.0) - np.float32(2.0) * bit.astype(np.float32)


def uniforms_np(key: int, positions: np.ndarray) -> np.ndarray:
    """float32 uniforms in [0, 1) with 24 random bits: element e from the hash of e // 2,
    bits 40..63 for even e and 8..31 for odd e."""
    positions = positions.astype(np.uint64)
    bits = element_bits_np(key, positions >> U_ONE)
    shift = np.where(positions & U_ONE, U8, U40)
    return ((bits >> shift) & U24MASK).astype(np.float32) * UNIFORM_SCALE
