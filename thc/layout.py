"""How a flat tensor of d floats maps onto RHT partitions.

A tensor is cut into partitions of `partition_size` floats (a power of two; the default
2^20 floats = 4 MiB, BytePS's recommended partition). Full partitions need no padding;
the remainder (or a tensor smaller than one partition) is zero-padded only to its own
next power of two, at least 2 so that 4-bit indices pack into whole bytes. Position i
of the padded tensor lies in partition i // partition_size.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

DEFAULT_PARTITION_SIZE = 1 << 20


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def check_partition_size(partition_size: int) -> int:
    p = int(partition_size)
    if p < 2 or p & (p - 1):
        raise ValueError(f"partition_size must be a power of two >= 2, got {partition_size}")
    return p


@dataclass(frozen=True)
class Layout:
    """The partitions of d floats. Its derived lengths are computed once (cached_property
    writes the instance's __dict__, which a frozen dataclass allows): the codec asks for
    them several times per call, and a call of a small tensor is mostly such overhead."""
    d: int                 # unpadded length
    partition_size: int

    @cached_property
    def full_partitions(self) -> int:
        return self.d // self.partition_size

    @cached_property
    def tail(self) -> int:
        """Unpadded length of the last, short partition (0 if none)."""
        return self.d - self.full_partitions * self.partition_size

    @cached_property
    def tail_padded(self) -> int:
        return max(next_pow2(self.tail), 2) if self.tail else 0

    @cached_property
    def padded(self) -> int:
        return self.full_partitions * self.partition_size + self.tail_padded

    @cached_property
    def num_partitions(self) -> int:
        return self.full_partitions + (1 if self.tail else 0)

    def sizes(self) -> np.ndarray:
        """Padded size of every partition."""
        s = np.full(self.num_partitions, self.partition_size, dtype=np.int64)
        if self.tail:
            s[-1] = self.tail_padded
        return s

    def starts(self) -> np.ndarray:
        return np.arange(self.num_partitions, dtype=np.int64) * self.partition_size

    def data_lengths(self) -> np.ndarray:
        """Unpadded number of elements in every partition."""
        s = np.full(self.num_partitions, self.partition_size, dtype=np.int64)
        if self.tail:
            s[-1] = self.tail
        return s

    def segments(self):
        """(start, total, partition size) runs of equal-size partitions: all full
        partitions as one run, then the tail. Kernels sweep a whole run per launch."""
        runs = []
        if self.full_partitions:
            runs.append((0, self.full_partitions * self.partition_size, self.partition_size))
        if self.tail:
            runs.append((self.full_partitions * self.partition_size, self.tail_padded,
                         self.tail_padded))
        return runs

    @classmethod
    def from_padded(cls, padded: int, partition_size: int) -> "Layout":
        """The layout whose padded length is `padded` (d taken as the padded length)."""
        return cls(int(padded), partition_size)
