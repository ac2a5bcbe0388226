"""Every scenario runs once per data plane in tests/packet/targets/ (skipped with the
target's own reason where it cannot run here)."""
import pytest

from .targets import discover

TARGETS = discover()


@pytest.fixture(params=TARGETS, ids=[t.name for t in TARGETS])
def target(request):
    info = request.param
    if not info.available:
        pytest.skip(f"{info.name}: {info.reason}")
    tgt = info.make()
    yield tgt
    tgt.stop()
