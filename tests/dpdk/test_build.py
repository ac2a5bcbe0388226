"""The switch builds warning-free from its own Makefile against Debian's DPDK."""
import subprocess

from dataplane.dpdk_runner import DPDK_DIR


def test_builds_without_warnings(switch_bin, tmp_path):
    res = subprocess.run(["make", "-C", str(DPDK_DIR), f"BUILD={tmp_path}", "EXTRA_CFLAGS=-Werror"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr
    assert (tmp_path / "thc_switch").exists()


def test_missing_config_is_refused_with_usage(switch_bin):
    res = subprocess.run([str(switch_bin), "--no-huge", "--no-pci", "-m", "64", "--no-shconf",
                          "--log-level", "*:error", "--"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0
    assert "--config is required" in res.stderr
