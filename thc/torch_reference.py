"""A straightforward PyTorch implementation of the same THC algorithm (the speed baseline).

Same partitions, table, clamp, stochastic rounding and packing as thc.THCCodec, written the
way one would in plain torch ops (stage-by-stage FWHT with reshapes, torch.rand for the
rounding draws). The Rademacher diagonal is the codec's (computed once and cached, as the
THC artifact caches D). Works on CPU and CUDA tensors.
"""
from __future__ import annotations

import numpy as np
import torch

from . import rng
from .codec import THCCodec


class TorchTHC:
    def __init__(self, codec: THCCodec):
        self.codec = codec
        self.table = torch.as_tensor(codec.table, dtype=torch.float32)
        self.table_u8 = torch.as_tensor(codec.table_u8)
        self.lower = torch.as_tensor(codec.lower.astype(np.int64))
        self._signs = {}

    def _signs_for(self, start, n, device):
        key = (start, n, str(device))
        if key not in self._signs:
            s = rng.signs_np(self.codec.sign_key, np.arange(start, start + n))
            self._signs[key] = torch.as_tensor(s, device=device)
        return self._signs[key]

    @staticmethod
    def fwht(v: torch.Tensor) -> torch.Tensor:
        n = v.numel()
        h = 1
        while h < n:
            pairs = v.view(-1, 2, h)
            v = torch.stack((pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]), dim=1)
            h *= 2
        return v.reshape(-1)

    def partition_norms(self, x):
        lay = self.codec.layout(x.numel())
        return torch.stack([x[s:s + n].norm() for s, n in
                            zip(lay.starts().tolist(), lay.data_lengths().tolist())])

    def rotate(self, x):
        lay = self.codec.layout(x.numel())
        padded = torch.nn.functional.pad(x, (0, lay.padded - lay.d))
        parts = [self.fwht(padded[s:s + n] * self._signs_for(s, n, x.device)) / np.sqrt(n)
                 for s, n in zip(lay.starts().tolist(), lay.sizes().tolist())]
        return torch.cat(parts)

    def _constants(self, max_norms, lay, device):
        sizes = torch.as_tensor(lay.sizes(), dtype=torch.float32, device=device)
        half = self.codec.t_p * max_norms.to(device) / sizes.sqrt()
        idx = torch.arange(lay.padded, device=device) // lay.partition_size
        return half[idx], half

    def quantize(self, rotated, max_norms):
        lay = self.codec.layout(rotated.numel())
        m, _ = self._constants(max_norms, lay, rotated.device)
        g = self.codec.granularity
        y = ((rotated.clamp(-m, m) + m) * (g / (2 * m))).clamp(0, g)
        table, lower = self.table.to(rotated.device), self.lower.to(rotated.device)
        j = lower[y.long()]
        lo, hi = table[j], table[j + 1]
        z = (j + (torch.rand_like(y) < (y - lo) / (hi - lo))).to(torch.uint8)
        return (z[0::2] << 4) | z[1::2]

    def lookup(self, packed):
        table = self.table_u8.to(packed.device)
        return torch.stack((table[(packed >> 4).long()], table[(packed & 15).long()]),
                           dim=1).reshape(-1)

    def decode(self, sums, count, max_norms, d):
        lay = self.codec.layout(d)
        m, _ = self._constants(max_norms, lay, sums.device)
        g = self.codec.granularity
        rotated = (sums.float() / count) * (2 * m / g) - m
        parts = [self.fwht(rotated[s:s + n]) * self._signs_for(s, n, sums.device) / np.sqrt(n)
                 for s, n in zip(lay.starts().tolist(), lay.sizes().tolist())]
        return torch.cat(parts)[:d]
