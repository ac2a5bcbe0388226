"""DPDK switch tests: skipped with the reason where the switch cannot run here."""
import pytest

from dataplane import dpdk_runner


@pytest.fixture(scope="session")
def switch_bin():
    ok, reason = dpdk_runner.available()       # builds dataplane/dpdk once
    if not ok:
        pytest.skip(f"DPDK switch unavailable: {reason}")
    return dpdk_runner.SWITCH_BIN
