"""Errors the codec raises on bad input (each message says what to change)."""
from __future__ import annotations

LANE_MAX = 255  # 8-bit result lanes: a sum of n table values must stay <= 255


class NonFiniteError(ValueError):
    """A tensor handed to the codec holds NaN or Inf."""


class LaneOverflowError(ValueError):
    """n workers x granularity g would overflow the 8-bit result lanes."""


def check_lanes(workers: int, granularity: int, lane_max: int = LANE_MAX) -> None:
    """Refuse a set-up whose integer sums can exceed the lane width."""
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    if workers * granularity > lane_max:
        raise LaneOverflowError(
            f"{workers} workers x granularity {granularity} = {workers * granularity} "
            f"overflows the {lane_max.bit_length()}-bit result lanes (max {lane_max}); "
            f"use granularity <= {lane_max // workers} or at most "
            f"{max(lane_max // granularity, 0)} workers")
