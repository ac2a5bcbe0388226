"""The reference aggregator (dataplane/reference.py) as a packet-suite target, in-process."""
from __future__ import annotations

from dataplane.config import SwitchConfig
from dataplane.reference import MAX_VALUES, ReferenceSwitch

from .base import Target


def available() -> tuple[bool, str]:
    return True, "in-process Python model"


class ReferenceTarget(Target):
    name = "reference"
    max_values = MAX_VALUES

    def __init__(self):
        self.switch: ReferenceSwitch | None = None

    def start(self, config: SwitchConfig, port_rates: dict[int, float] | None = None) -> None:
        # A simulated clock that never moves while input arrives: the whole input of a
        # run() is one burst, then every port drains (§6 "paused" ports included).
        self.switch = ReferenceSwitch(config, port_rates, clock=lambda: 0.0)

    def run(self, frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        if self.switch is None:
            raise RuntimeError("run() before start()")
        out = []
        for port, frame in frames:
            out.extend(self.switch.process(port, frame, now=0.0))
        out.extend(self.switch.drain())
        return out

    def counters(self) -> dict:
        return self.switch.counters()

    def stop(self) -> None:
        self.switch = None


def make_target() -> Target:
    return ReferenceTarget()
