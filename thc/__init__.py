"""THC: tensor homomorphic compression (NSDI'24), the codec library.

Public API (agreed with host/): optimal_table, truncation_threshold, THCCodec, ErrorFeedback,
NonFiniteError, LaneOverflowError. See thc/codec.py for the codec and docs/perf.md for speed.
"""
from .codec import ErrorFeedback, THCCodec
from .errors import LaneOverflowError, NonFiniteError, check_lanes
from .layout import DEFAULT_PARTITION_SIZE
from .tables import optimal_table, truncation_threshold

__all__ = ["optimal_table", "truncation_threshold", "THCCodec", "ErrorFeedback",
           "NonFiniteError", "LaneOverflowError", "check_lanes", "DEFAULT_PARTITION_SIZE"]
