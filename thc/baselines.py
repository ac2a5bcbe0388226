"""Compressors with one interface, for NMSE comparisons (benchmarks, demo).

Each compressor simulates one aggregation round for n workers:
    est = comp.aggregate(grads, round=r)      # list of 1-D float32 numpy -> mean estimate
    comp.bits_up(n), comp.bits_down(n)        # bits per coordinate, worker->PS and PS->worker
Stateful compressors (error feedback) keep their state per worker between calls; call
reset() between experiments. These are plain numpy (the fast path is thc.THCCodec).
"""
from __future__ import annotations

import math

import numpy as np

from . import rng
from .codec import THCCodec
from .errors import check_lanes
from .tables import lower_index_table, optimal_table, truncation_threshold


class Compressor:
    name = "compressor"

    def aggregate(self, grads, round: int = 0) -> np.ndarray:
        raise NotImplementedError

    def bits_up(self, n: int) -> float:
        raise NotImplementedError

    def bits_down(self, n: int) -> float:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget per-worker state (error feedback)."""


class NoCompression(Compressor):
    name = "none (fp32)"

    def aggregate(self, grads, round=0):
        return np.mean(np.asarray(grads, dtype=np.float64), axis=0).astype(np.float32)

    def bits_up(self, n):
        return 32.0

    def bits_down(self, n):
        return 32.0


def _uniforms(seed, round, worker, d):
    return rng.uniforms_np(rng.rounding_key(seed, round, 0, worker), np.arange(d))


class THCCompressor(Compressor):
    """Non-uniform THC (Alg. 2) for any bit width b, with or without the RHT.

    lane_max=None simulates wide result lanes (bits_down grows with n); an int enforces
    n * g <= lane_max like the 8-bit data planes.
    """

    def __init__(self, bits=4, granularity=30, p=1 / 32, symmetric=False, rotate=True,
                 seed=0, partition_size=1 << 20, lane_max=None):
        self.bits, self.g, self.p = bits, granularity, p
        self.table = optimal_table(bits, granularity, p, symmetric=symmetric)
        self.lower = lower_index_table(self.table).astype(np.int64)
        self.t_p = truncation_threshold(p)
        self.rotator = THCCodec(partition_size=partition_size, seed=seed, rotate=rotate,
                                backend="cpu")
        self.seed, self.lane_max = seed, lane_max
        self.name = f"THC b={bits} g={granularity}" + ("" if rotate else " (no RHT)")

    def _indices(self, x, half, scale, key):
        m = half
        y = np.minimum((np.clip(x, -m, m) + m) * scale, np.float32(self.g))
        j = self.lower[y.astype(np.int64)]
        lo, hi = self.table[j], self.table[j + 1]
        up = rng.uniforms_np(key, np.arange(len(x))) < (y - lo) / (hi - lo)
        return j + up

    def aggregate(self, grads, round=0):
        n, d = len(grads), len(grads[0])
        if self.lane_max is not None:
            check_lanes(n, self.g, self.lane_max)
        codec = self.rotator
        norms = np.max([codec.partition_norms(g) for g in grads], axis=0)
        lay = codec.layout(d)
        part = np.arange(lay.padded) // lay.partition_size
        half = (self.t_p * norms.astype(np.float64) / np.sqrt(lay.sizes())).astype(np.float32)
        with np.errstate(divide="ignore"):
            scale = np.where(half > 0, self.g / (2.0 * half), 0.0).astype(np.float32)
        total = np.zeros(lay.padded, dtype=np.int64)
        for w, grad in enumerate(grads):
            key = rng.rounding_key(self.seed, round, 0, w)
            z = self._indices(codec.rotate(grad), half[part], scale[part], key)
            total += self.table[z]
        step = (2.0 * half / self.g).astype(np.float32)
        rotated = ((total / n) * step[part] - half[part]).astype(np.float32)
        return codec.inverse_rotate(rotated, d)

    def bits_up(self, n):
        return float(self.bits)

    def bits_down(self, n):
        return float(math.ceil(math.log2(n * self.g + 1)))


class UniformTHC(Compressor):
    """Uniform THC (Alg. 1): global [min, max] over workers, 2^b-level USQ, index sums."""

    def __init__(self, bits=4, rotate=True, seed=0, partition_size=1 << 20):
        self.bits = bits
        self.levels = (1 << bits) - 1
        self.rotator = THCCodec(partition_size=partition_size, seed=seed, rotate=rotate,
                                backend="cpu")
        self.seed = seed
        self.name = f"uniform THC b={bits}" + ("" if rotate else " (no RHT)")

    def aggregate(self, grads, round=0):
        n, d = len(grads), len(grads[0])
        rotated = [self.rotator.rotate(g) for g in grads]
        lo = min(float(r.min()) for r in rotated) if d else 0.0
        hi = max(float(r.max()) for r in rotated) if d else 0.0
        width = (hi - lo) or 1.0
        total = np.zeros(len(rotated[0]), dtype=np.int64)
        for w, r in enumerate(rotated):
            y = (r.astype(np.float64) - lo) / width * self.levels
            low = np.minimum(np.floor(y), self.levels - 1)
            u = rng.uniforms_np(rng.rounding_key(self.seed, round, 1, w), np.arange(len(y)))
            total += (low + (u < (y - low))).astype(np.int64)
        est = lo + (total / n) * width / self.levels
        return self.rotator.inverse_rotate(est.astype(np.float32), d)

    def bits_up(self, n):
        return float(self.bits)

    def bits_down(self, n):
        return float(math.ceil(math.log2(n * self.levels + 1)))


class TopK(Compressor):
    """Top-k magnitudes per worker (values + 32-bit indices) with error feedback."""

    def __init__(self, fraction=0.1):
        self.fraction = fraction
        self.errors = {}
        self.name = f"TopK {fraction:.0%} + EF"

    def aggregate(self, grads, round=0):
        n, d = len(grads), len(grads[0])
        k = max(1, int(round_half(self.fraction * d))) if d else 0
        total = np.zeros(d, dtype=np.float64)
        for w, grad in enumerate(grads):
            x = grad.astype(np.float64) + self.errors.get(w, 0.0)
            keep = np.argpartition(np.abs(x), d - k)[d - k:] if k < d else np.arange(d)
            sent = np.zeros(d)
            sent[keep] = x[keep]
            self.errors[w] = x - sent
            total += sent
        return (total / n).astype(np.float32)

    def bits_up(self, n):
        return 64.0 * self.fraction

    def bits_down(self, n):
        return min(32.0, 64.0 * min(1.0, n * self.fraction))

    def reset(self):
        self.errors.clear()


def round_half(v):
    return math.floor(v + 0.5)


class TernGrad(Compressor):
    """TernGrad: s * sign(x) * Bernoulli(|x| / s) with s = max |x| per worker."""

    name = "TernGrad"

    def __init__(self, seed=0):
        self.seed = seed

    def aggregate(self, grads, round=0):
        n, d = len(grads), len(grads[0])
        total = np.zeros(d, dtype=np.float64)
        for w, grad in enumerate(grads):
            x = grad.astype(np.float64)
            s = np.abs(x).max() if d else 0.0
            if s == 0:
                continue
            u = _uniforms(self.seed + 1, round, w, d)
            total += s * np.sign(x) * (u < np.abs(x) / s)
        return (total / n).astype(np.float32)

    def bits_up(self, n):
        return 2.0

    def bits_down(self, n):
        return 32.0     # per-worker scales: the PS must decompress and sends floats back


class QSGD(Compressor):
    """QSGD with s levels per bucket: ||x_b|| * sign(x) * xi, xi an unbiased rounding of
    s|x|/||x_b|| to an integer, divided by s (bucketed as in the QSGD paper's experiments)."""

    def __init__(self, levels=7, bucket=512, seed=0):
        self.levels, self.bucket, self.seed = levels, bucket, seed
        self.name = f"QSGD s={levels} bucket={bucket}"

    def aggregate(self, grads, round=0):
        n, d = len(grads), len(grads[0])
        total = np.zeros(d, dtype=np.float64)
        buckets = -(-d // self.bucket)
        for w, grad in enumerate(grads):
            x = np.zeros(buckets * self.bucket)
            x[:d] = grad
            x = x.reshape(buckets, self.bucket)
            norms = np.linalg.norm(x, axis=1, keepdims=True)
            safe = np.where(norms > 0, norms, 1.0)
            y = np.abs(x) / safe * self.levels
            low = np.floor(y)
            u = _uniforms(self.seed + 2, round, w, x.size).reshape(x.shape)
            q = norms * np.sign(x) * (low + (u < y - low)) / self.levels
            total += q.reshape(-1)[:d]
        return (total / n).astype(np.float32)

    def bits_up(self, n):
        return math.ceil(math.log2(2 * self.levels + 1)) + 32.0 / self.bucket

    def bits_down(self, n):
        return 32.0


def nmse(estimate, truth) -> float:
    truth = np.asarray(truth, dtype=np.float64)
    denom = float(np.dot(truth, truth))
    err = np.asarray(estimate, dtype=np.float64) - truth
    return float(np.dot(err, err) / denom) if denom else float(np.dot(err, err))


def default_compressors(partition_size=1 << 20):
    """The comparison set of the benchmark: matched to about 4 bits up where possible."""
    return [
        NoCompression(),
        THCCompressor(4, 30, 1 / 32, symmetric=True, partition_size=partition_size),
        THCCompressor(4, 30, 1 / 32, symmetric=True, rotate=False, partition_size=partition_size),
        UniformTHC(4, rotate=True, partition_size=partition_size),
        UniformTHC(4, rotate=False, partition_size=partition_size),
        TopK(0.1),
        TernGrad(),
        QSGD(7),
    ]
