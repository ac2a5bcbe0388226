"""The interface every data plane offers the packet suite (tests/packet/).

A target takes Ethernet frames in on switch ports and gives back the frames it emits,
with the counters of docs/protocol.md §4.5. One module per data plane in this folder
(`reference.py`, `dpdk.py`, `bmv2.py`) defines

    available() -> tuple[bool, str]    # False and the reason when it cannot run here
    make_target() -> Target

and the registry (`__init__.py`) parametrizes every scenario over them.
"""
from __future__ import annotations

import abc

from dataplane.config import SwitchConfig


class Target(abc.ABC):
    name: str
    max_values: int        # the data plane's MAX_VALUES; scenarios use values_per_packet <= it

    @abc.abstractmethod
    def start(self, config: SwitchConfig, port_rates: dict[int, float] | None = None) -> None:
        """Install `config` on a fresh data plane (all slots and counters zero).

        port_rates: egress port -> packets/s. 0 = paused while the input of a run() arrives,
        then drained in strict priority order (docs/protocol.md §6). Ports not listed are
        unlimited.
        """

    @abc.abstractmethod
    def run(self, frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Inject (ingress port, frame) in order; return every emitted (egress port, frame).

        The order within one egress port is preserved. State persists across run() calls
        until stop(); paused ports are drained at the end of each run().
        """

    @abc.abstractmethod
    def counters(self) -> dict:
        """{"global": {name: int}, "jobs": {job_id: {name: int}}}: names exactly as in
        docs/protocol.md §4.5, cumulative since start(), zeros included."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Release everything start() took (processes, interfaces, files)."""
