"""DLCP marking policy: layer index -> priority band (DSCP), gradient magnitude -> ECN.

Two marks per packet (DLCP paper, §3.2.2; docs/protocol.md §6):

* **Band.** ``band = floor(layer * P / L)`` with P = 7 data bands, 0-based layer index,
  so the front layer gets band 0 (the highest data priority) and every band is in
  ``[0, P-1]`` for any L >= 1.  The band becomes DSCP ``32 + band``
  (``dataplane.config.band_to_dscp``); switches map it to queue ``6 - band``.
* **Importance, uncompressed fp32 traffic** (the DLCP transport): a packet is important
  when the mean |g| of the values it carries is strictly greater (``>``) than the
  tensor's median |g|, estimated from a random sample of ``max(1, ceil(0.001 * N))``
  values.
* **Importance, THC traffic** (the in-network path): after the RHT every packet of a
  partition has about the same magnitude, so the per-packet rule would mark at random.
  Importance is decided per RHT partition instead, from a number the rotation keeps: the
  partition's L2 norm (the same before and after the RHT).  A partition is important when
  its RMS value (norm / sqrt(values)) is strictly greater than the median RMS over the
  tensor's partitions, the per-partition reading of the paper's "mean |g| > median |g|"
  (DLCP paper, §3.2.2); every packet of the partition carries that mark.  The allreduce
  passes the max-reduced norms that every worker already agreed on, so all workers mark
  a partition alike, and a tensor of one partition is all important (nothing to rank).

Important packets are sent ECT(0): a RED/ECN-style switch marks them CE above the queue
threshold instead of dropping them. Unimportant packets are Not-ECT and are the ones
selectively dropped.

The host transport calls a policy with the agreed hook signature::

    policy(*, layer, num_layers, values, values_per_packet, num_packets)
        -> (dscp uint8[num_packets], ecn uint8[num_packets])

A policy whose ``marks_partitions`` attribute is true also gets ``partition_norms``
(float per RHT partition of the submitted values) and ``partition_sizes`` (values per
partition) on THC traffic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dataplane.config import CONTROL_DSCP, NUM_DATA_BANDS, band_to_dscp

ECN_NOT_ECT = 0b00
ECN_ECT1 = 0b01
ECN_ECT0 = 0b10
ECN_CE = 0b11
DEFAULT_DSCP = 0            # best effort: queue 0, never selectively dropped
SAMPLE_FRACTION = 0.001     # the paper's 0.1% sample for the median estimate

__all__ = [
    "ECN_NOT_ECT", "ECN_ECT0", "ECN_ECT1", "ECN_CE", "CONTROL_DSCP", "DEFAULT_DSCP",
    "layer_band", "layer_dscp", "sample_size", "median_abs_estimate", "packet_mean_abs",
    "importance_ecn", "partition_importance", "partition_packet_ecn", "partition_marks",
    "DlcpPolicy",
    "tos_byte",
]


def layer_band(layer: int, num_layers: int, num_bands: int = NUM_DATA_BANDS) -> int:
    """Band of a 0-based layer index: floor(layer * P / L); 0 = front = highest priority."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} outside 0..{num_layers - 1}")
    if not 1 <= num_bands <= NUM_DATA_BANDS:
        raise ValueError(f"num_bands must be in 1..{NUM_DATA_BANDS}, got {num_bands}")
    return (layer * num_bands) // num_layers


def layer_dscp(layer: int, num_layers: int, num_bands: int = NUM_DATA_BANDS) -> int:
    return band_to_dscp(layer_band(layer, num_layers, num_bands))


def tos_byte(dscp: int, ecn: int) -> int:
    """The IPv4 ToS byte: DSCP in the upper 6 bits, ECN in the lower 2."""
    return ((int(dscp) & 0x3F) << 2) | (int(ecn) & 0x3)


def sample_size(num_values: int, fraction: float = SAMPLE_FRACTION) -> int:
    return max(1, math.ceil(fraction * num_values))


def median_abs_estimate(values: np.ndarray, rng: np.random.Generator,
                        fraction: float = SAMPLE_FRACTION) -> float:
    """Median |g| of a uniform sample (without replacement) of max(1, ceil(fraction*N)) values."""
    flat = np.ravel(values)
    if flat.size == 0:
        raise ValueError("cannot estimate the median of an empty tensor")
    idx = rng.choice(flat.size, size=sample_size(flat.size, fraction), replace=False)
    return float(np.median(np.abs(flat[idx].astype(np.float64))))


def packet_mean_abs(values: np.ndarray, values_per_packet: int, num_packets: int) -> np.ndarray:
    """Mean |g| of each packet's values; packet k carries [k*vpp, min((k+1)*vpp, N))."""
    flat = np.ravel(values)
    if values_per_packet < 1:
        raise ValueError(f"values_per_packet must be >= 1, got {values_per_packet}")
    expected = -(-flat.size // values_per_packet)
    if num_packets != expected:
        raise ValueError(f"{flat.size} values at {values_per_packet} per packet make "
                         f"{expected} packets, caller says {num_packets}")
    starts = np.arange(num_packets, dtype=np.int64) * values_per_packet
    counts = np.minimum(starts + values_per_packet, flat.size) - starts
    sums = np.add.reduceat(np.abs(flat.astype(np.float64)), starts)
    return sums / counts


def importance_ecn(values: np.ndarray, values_per_packet: int, num_packets: int,
                   rng: np.random.Generator, fraction: float = SAMPLE_FRACTION,
                   important_ecn: int = ECN_ECT0) -> np.ndarray:
    """ECN per packet: ECT when mean|g| > sampled median|g| (strict), else Not-ECT."""
    flat = np.ravel(values)
    if not np.all(np.isfinite(flat)):
        bad = int(np.count_nonzero(~np.isfinite(flat)))
        raise ValueError(f"gradient has {bad} NaN/inf values; refusing to mark it")
    means = packet_mean_abs(flat, values_per_packet, num_packets)
    threshold = median_abs_estimate(flat, rng, fraction)
    return np.where(means > threshold, important_ecn, ECN_NOT_ECT).astype(np.uint8)


def partition_importance(norms: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Important partitions: RMS (norm / sqrt(size)) strictly above the median RMS.

    One partition: important (there is nothing to rank it against, so keep it safe)."""
    norms = np.asarray(norms, np.float64).reshape(-1)
    sizes = np.asarray(sizes, np.float64).reshape(-1)
    if norms.shape != sizes.shape:
        raise ValueError(f"{len(norms)} partition norms for {len(sizes)} partition sizes")
    if not np.all(np.isfinite(norms)):
        raise ValueError("partition norms hold NaN/inf; refusing to mark them")
    if (sizes <= 0).any():
        raise ValueError("partition sizes must be positive")
    if len(norms) <= 1:
        return np.ones(len(norms), bool)
    rms = norms / np.sqrt(sizes)
    return rms > np.median(rms)


def partition_packet_ecn(important: np.ndarray, sizes: np.ndarray, values_per_packet: int,
                         num_packets: int, important_ecn: int = ECN_ECT0) -> np.ndarray:
    """Each packet's ECN from the partitions it carries (partitions laid end to end with
    the given padded sizes; packet k carries [k*vpp, (k+1)*vpp)): ECT when any of them
    is important (a packet larger than a partition spans several)."""
    sizes = np.asarray(sizes, np.int64).reshape(-1)
    ends = np.cumsum(sizes)
    if num_packets and ends[-1] < (num_packets - 1) * values_per_packet + 1:
        raise ValueError(f"partitions cover {int(ends[-1])} values, {num_packets} packets "
                         f"of {values_per_packet} need more")
    starts = np.arange(num_packets, dtype=np.int64) * values_per_packet
    last = np.minimum(starts + values_per_packet, ends[-1]) - 1
    first_part = np.searchsorted(ends, starts, side="right")
    last_part = np.searchsorted(ends, last, side="right")
    # Any important partition in [first_part, last_part]: prefix sums of the flags.
    flags = np.concatenate([[0], np.cumsum(np.asarray(important, np.int64))])
    hit = flags[last_part + 1] - flags[first_part] > 0
    return np.where(hit, important_ecn, ECN_NOT_ECT).astype(np.uint8)


def partition_marks(norms: np.ndarray, sizes: np.ndarray, values_per_packet: int,
                    num_packets: int, important_ecn: int = ECN_ECT0) -> np.ndarray:
    """partition_packet_ecn(partition_importance(norms, sizes), sizes, ...) in one Numba
    pass (host.dlcp.marking_kernels): the policy's per-chunk path, same marks and the
    same refusals."""
    # THC traffic only: Numba is loaded with thc already; the fp32 transport never gets here.
    from host.dlcp import marking_kernels as kernels
    norms = np.ascontiguousarray(norms, np.float64).reshape(-1)
    sizes = np.ascontiguousarray(sizes, np.int64).reshape(-1)
    if norms.shape != sizes.shape:
        raise ValueError(f"{len(norms)} partition norms for {len(sizes)} partition sizes")
    if not len(norms):
        raise ValueError("no partitions to mark")
    out = np.empty(num_packets, np.uint8)
    status = kernels.partition_marks(norms, sizes, values_per_packet, num_packets,
                                     important_ecn, ECN_NOT_ECT, out)
    if status == kernels.MARKS_NONFINITE:
        raise ValueError("partition norms hold NaN/inf; refusing to mark them")
    if status == kernels.MARKS_BAD_SIZE:
        raise ValueError("partition sizes must be positive")
    if status == kernels.MARKS_SHORT:
        raise ValueError(f"partitions cover {int(sizes.sum())} values, {num_packets} packets "
                         f"of {values_per_packet} need more")
    return out


@dataclass
class DlcpPolicy:
    """The default DLCP marking hook (band from layer, ECN from magnitude).

    enabled=False sends everything best effort (DSCP 0, Not-ECT); mark_importance=False
    keeps the band but sends every packet ECT (nothing selectively dropped). On THC
    traffic (partition_norms given) importance is per RHT partition, else per packet.
    """
    marks_partitions = True         # the transport passes partition norms on THC traffic
    enabled: bool = True
    mark_importance: bool = True
    num_bands: int = NUM_DATA_BANDS
    sample_fraction: float = SAMPLE_FRACTION
    important_ecn: int = ECN_ECT0
    seed: int | None = 0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.num_bands <= NUM_DATA_BANDS:
            raise ValueError(f"DlcpPolicy: num_bands must be in 1..{NUM_DATA_BANDS}, "
                             f"got {self.num_bands}")
        if not 0.0 < self.sample_fraction <= 1.0:
            raise ValueError(f"DlcpPolicy: sample_fraction must be in (0, 1], "
                             f"got {self.sample_fraction}")
        if self.important_ecn not in (ECN_ECT0, ECN_ECT1):
            raise ValueError("DlcpPolicy: important_ecn must be ECT(0)=2 or ECT(1)=1")
        self.rng = np.random.default_rng(self.seed)

    @property
    def ect_retransmissions(self) -> bool:
        """The in-network transport resends a lost chunk ECT (marked, not dropped again)."""
        return self.enabled and self.mark_importance

    def __call__(self, *, layer: int, num_layers: int, values: np.ndarray,
                 values_per_packet: int, num_packets: int, partition_norms=None,
                 partition_sizes=None) -> tuple[np.ndarray, np.ndarray]:
        if not self.enabled:
            return (np.full(num_packets, DEFAULT_DSCP, np.uint8),
                    np.full(num_packets, ECN_NOT_ECT, np.uint8))
        dscp = np.full(num_packets, layer_dscp(layer, num_layers, self.num_bands), np.uint8)
        if not self.mark_importance:
            return dscp, np.full(num_packets, self.important_ecn, np.uint8)
        if partition_norms is not None:
            return dscp, partition_marks(partition_norms, partition_sizes, values_per_packet,
                                         num_packets, self.important_ecn)
        ecn = importance_ecn(values, values_per_packet, num_packets, self.rng,
                             self.sample_fraction, self.important_ecn)
        return dscp, ecn
