"""Registry of packet-suite targets: one module per data plane in this folder.

`discover()` imports each known module and asks it whether it can run here; the suite
parametrizes every scenario over all of them and skips the unavailable ones with their
reason (never a fake).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from .base import Target

TARGET_NAMES = ("reference", "dpdk", "bmv2")


@dataclass
class TargetInfo:
    name: str
    module: ModuleType | None
    available: bool
    reason: str

    def make(self) -> Target:
        if not self.available:
            raise RuntimeError(f"target {self.name} is not available: {self.reason}")
        return self.module.make_target()


def _probe(name: str) -> TargetInfo:
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{name}":
            return TargetInfo(name, None, False, f"tests/packet/targets/{name}.py not written yet")
        return TargetInfo(name, None, False, f"importing the {name} target failed: {exc}")
    except Exception as exc:  # a broken target module must not take the suite down
        return TargetInfo(name, None, False, f"importing the {name} target failed: {exc!r}")
    try:
        ok, reason = module.available()
    except Exception as exc:
        ok, reason = False, f"{name}.available() raised {exc!r}"
    return TargetInfo(name, module, bool(ok), reason)


def discover(names=TARGET_NAMES) -> list[TargetInfo]:
    return [_probe(name) for name in names]


__all__ = ["Target", "TargetInfo", "TARGET_NAMES", "discover"]
