"""DLCP minimal rate control (DLCP paper, Fig. 7), as a pure state machine.

The receiver reports its measured receive rate every period (200 us by default); the
sender compares it with its own send rate over the same stretch:

* LINE_RATE_START: rate = link bandwidth. The first report with send > delta*recv halves
  the rate and enters CONG_AVOID.
* CONG_AVOID: send > delta*recv -> halve; otherwise add ai_fraction*link (capped at link).
* A retransmission round (the sender queues the resends a STATUS asked for; with a
  STATUS per band there can be one per band and iteration) resets to LINE_RATE_START at
  line rate.

"Congested" is send > delta*recv in both states: the paper's CONG_AVOID sentence reads the
other way round, which we take for a typo. Optional ECN echo (our extension,
off by default): with ce_threshold set, a report whose share of CE-marked arrivals is
above it also counts as congested. The switch CE-marks ECT packets exactly where it starts
dropping Not-ECT ones (occupancy above K), so the echo reacts to the queue before the
receive rate has fallen, and keeps reacting under strict priority, where a sender's receive
rate says little about how full its band's queue is. The cap at line rate and the floor
(min_fraction of the link, so a burst of empty reports cannot stall a sender forever) are
our choices; the paper states neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

REPORT_PERIOD_S = 200e-6
DELTA = 2.0
AI_FRACTION = 0.05


class RateState(Enum):
    LINE_RATE_START = "line_rate_start"
    CONG_AVOID = "cong_avoid"


@dataclass
class RateController:
    link_bps: float
    delta: float = DELTA
    ai_fraction: float = AI_FRACTION
    min_fraction: float = 0.01
    ce_threshold: float | None = None
    state: RateState = field(default=RateState.LINE_RATE_START, init=False)
    rate_bps: float = field(default=0.0, init=False)
    halvings: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.link_bps > 0:
            raise ValueError(f"RateController: link_bps must be > 0, got {self.link_bps}")
        if not self.delta >= 1:
            raise ValueError(f"RateController: delta must be >= 1, got {self.delta}")
        if not 0 < self.ai_fraction <= 1:
            raise ValueError(f"RateController: ai_fraction must be in (0, 1], got {self.ai_fraction}")
        if not 0 < self.min_fraction <= 1:
            raise ValueError(f"RateController: min_fraction must be in (0, 1], got {self.min_fraction}")
        if self.ce_threshold is not None and not 0 <= self.ce_threshold < 1:
            raise ValueError(f"RateController: ce_threshold must be in [0, 1), got {self.ce_threshold}")
        self.rate_bps = float(self.link_bps)

    def congested(self, send_bps: float, recv_bps: float, ce_fraction: float = 0.0) -> bool:
        if self.ce_threshold is not None and ce_fraction > self.ce_threshold:
            return True
        return send_bps > self.delta * recv_bps

    def on_report(self, send_bps: float, recv_bps: float, ce_fraction: float = 0.0) -> float:
        """Apply one receiver rate report (ce_fraction: the share of its arrivals that were
        CE-marked, used only with ce_threshold); returns the new sending rate."""
        if self.congested(send_bps, recv_bps, ce_fraction):
            self.rate_bps = max(self.rate_bps / 2, self.min_fraction * self.link_bps)
            self.state = RateState.CONG_AVOID
            self.halvings += 1
        elif self.state is RateState.CONG_AVOID:
            self.rate_bps = min(self.rate_bps + self.ai_fraction * self.link_bps, self.link_bps)
        return self.rate_bps

    def on_retransmission(self) -> float:
        self.state = RateState.LINE_RATE_START
        self.rate_bps = float(self.link_bps)
        return self.rate_bps
