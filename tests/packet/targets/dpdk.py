"""The DPDK switch (dataplane/dpdk/) as a packet-suite target, in pcap mode.

Each port is a net_pcap device: the frames injected on a port form its rx pcap, the
frames the switch sends form its tx pcap, and a schedule file fixes the arrival
order across ports, so a run is deterministic. A pcap input is read once per
process, so state across run() calls is kept by replaying the whole history since
start() in one process (the switch is deterministic): each run() returns only the
frames beyond those already returned per port. Every run() ends with a drain
(paused ports included), exactly where the reference drains.
"""
from __future__ import annotations

from dataplane.config import SwitchConfig
from dataplane.dpdk_config import DPDK_MAX_VALUES, render
from dataplane.dpdk_runner import available as switch_available
from dataplane.dpdk_runner import run_pcap

from .base import Target

_AVAILABLE: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    global _AVAILABLE
    if _AVAILABLE is None:             # builds the switch once per session
        _AVAILABLE = switch_available()
    return _AVAILABLE


class DpdkTarget(Target):
    name = "dpdk"
    max_values = DPDK_MAX_VALUES

    def __init__(self):
        self._config: SwitchConfig | None = None
        self._rates: dict[int, float] = {}
        self._batches: list[list[tuple[int, bytes]]] = []
        self._returned: dict[int, int] = {}
        self._stats: dict | None = None

    def start(self, config: SwitchConfig, port_rates: dict[int, float] | None = None) -> None:
        render(config)                 # refuses a bad config now, as the reference does
        for port, rate in (port_rates or {}).items():
            if rate is not None and rate < 0:
                raise ValueError(f"port {port}: service rate {rate} must be >= 0 packets/s")
        self._config = config
        self._rates = {p: r for p, r in (port_rates or {}).items() if r is not None}
        self._batches, self._returned, self._stats = [], {}, None

    def run(self, frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        if self._config is None:
            raise RuntimeError("run() before start()")
        self._batches.append([(int(p), bytes(f)) for p, f in frames])
        out_by_port, self._stats = run_pcap(self._config, self._batches, self._rates)
        new = []
        for port in sorted(out_by_port):
            already = self._returned.get(port, 0)
            new += [(port, f) for f in out_by_port[port][already:]]
            self._returned[port] = len(out_by_port[port])
        return new

    def counters(self) -> dict:
        if self._config is None:
            raise RuntimeError("counters() before start()")
        if self._stats is None:        # nothing ran yet: no packet has touched a counter
            self._stats = run_pcap(self._config, [[]], self._rates)[1]
        return {"global": dict(self._stats["global"]),
                "jobs": {int(j): dict(c) for j, c in self._stats["jobs"].items()}}

    def stop(self) -> None:
        self._config = None
        self._batches, self._returned, self._stats = [], {}, None


def make_target() -> Target:
    return DpdkTarget()
