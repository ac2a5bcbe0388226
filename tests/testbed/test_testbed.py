"""The Mininet testbed, for real: hosts in network namespaces, veth links with TCLink
bandwidth limits, the reference UDP aggregator on its own host behind a Linux bridge."""
from __future__ import annotations

import os
import subprocess

import pytest

import host.netlab.testbed as tb
from host.experiments import testbed as cli
from host.netlab.testbed import make_config, run_testbed, switch_available
from host.netlab.testbed.mininet_loader import MininetMissing, load_mininet

pytestmark = pytest.mark.netns


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, veth, tc)"
    try:
        load_mininet()
    except MininetMissing as exc:
        return str(exc)
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "iproute2 cannot use network namespaces here"
    return None


SKIP = _skip_reason()
needs_root = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def links_with(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip() for line in out.splitlines()
            if line.split(":")[1].strip().startswith(prefix)]


@needs_root
def test_shaped_testbed_run_prints_no_htb_warning(tmp_path, capfd):
    """A 50 Mbit/s htb class gets an explicit quantum: tc stays silent (Mininet would
    print `*** Error: Warning: sch_htb: quantum ... is big` once per shaped interface)."""
    opts = tb.TestbedOptions(hosts=2, bw=50.0, switch="reference", values=256,
                             values_per_packet=64, pool_size=4, workdir=str(tmp_path))
    result = run_testbed(opts)
    assert result.ok, result.hosts
    out, err = capfd.readouterr()
    assert "sch_htb" not in out + err and "Error" not in out + err, out + err


def test_htb_quantum_is_the_kernels_choice_within_its_silent_range():
    assert tb.network.htb_quantum(50.0) == 200_000        # 625 000 B/s / 10, clamped
    assert tb.network.htb_quantum(1.0) == 12_500
    assert tb.network.htb_quantum(0.01) == 1000


@needs_root
def test_reference_aggregator_testbed_sums_match_numpy(tmp_path):
    opts = tb.TestbedOptions(hosts=3, bw=50.0, switch="reference", values=3000,
                          values_per_packet=64, pool_size=8, seed=11, timeout=30,
                          workdir=str(tmp_path))
    result = run_testbed(opts)
    assert result.switch == "reference"
    assert len(result.hosts) == 3
    packets = -(-3000 // 64)
    for name, r in result.hosts.items():
        assert r["ok"], (name, r)
        assert r["received"] == packets and r["mismatches"] == 0
    job = result.counters["jobs"]["1"] if "1" in result.counters["jobs"] else \
        result.counters["jobs"][1]
    assert job["results_multicast"] == packets
    assert job["aggregated"] == 3 * packets
    assert job["drop_not_member"] == 0 and job["drop_bad_expected"] == 0
    assert links_with(f"t{os.getpid() % 10000}") == []           # torn down


@needs_root
@pytest.mark.skipif(not switch_available("dpdk")[0], reason=switch_available("dpdk")[1])
def test_dpdk_switch_testbed_sums_match_numpy(tmp_path):
    opts = tb.TestbedOptions(hosts=3, bw=50.0, switch="dpdk", values=2000, pool_size=8,
                             seed=5, timeout=30, workdir=str(tmp_path))
    result = run_testbed(opts)
    assert result.switch == "dpdk"
    assert result.ok, result.hosts
    job = result.counters["jobs"]["1"]
    packets = -(-2000 // 64)
    assert job["results_multicast"] == packets and job["drop_not_member"] == 0
    assert result.counters["global"]["drop_bad_length"] == 0
    assert links_with(f"t{os.getpid() % 10000}") == []


@needs_root
@pytest.mark.skipif(not switch_available("bmv2")[0], reason=switch_available("bmv2")[1])
def test_bmv2_switch_testbed_sums_match_numpy(tmp_path):
    opts = tb.TestbedOptions(hosts=3, bw=50.0, switch="bmv2", values=1000,
                             values_per_packet=64, pool_size=8, seed=7, timeout=60,
                             workdir=str(tmp_path))
    result = run_testbed(opts)
    assert result.switch == "bmv2"
    assert result.ok, result.hosts
    packets = -(-1000 // 64)
    for name, r in result.hosts.items():
        assert r["received"] == packets and r["mismatches"] == 0, (name, r)
    job = result.counters["jobs"][1] if 1 in result.counters["jobs"] else \
        result.counters["jobs"]["1"]
    assert job["results_multicast"] == packets and job["aggregated"] == 3 * packets
    assert job["drop_not_member"] == 0
    assert links_with(f"t{os.getpid() % 10000}") == []


def switches_on(tag: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "simple_switch_grpc"], capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if f"@{tag}s-" in line]


@needs_root
@pytest.mark.skipif(not switch_available("bmv2")[0], reason=switch_available("bmv2")[1])
def test_bmv2_refusing_the_job_leaves_no_switch_running(tmp_path):
    # 65 values per packet: BMv2 refuses the job after simple_switch_grpc has started
    opts = tb.TestbedOptions(hosts=2, switch="bmv2", values=100, values_per_packet=65,
                             workdir=str(tmp_path))
    with pytest.raises(tb.TestbedError, match="limit of 64 values per packet"):
        run_testbed(opts)
    assert switches_on(f"t{os.getpid() % 10000}") == []


@needs_root
def test_failing_host_command_is_reported_and_torn_down(tmp_path):
    opts = tb.TestbedOptions(hosts=2, switch="reference", bw=0, timeout=10,
                          command="echo host {worker} at {ip}; exit 3", workdir=str(tmp_path))
    result = run_testbed(opts)
    assert not result.ok
    assert all(r["returncode"] == 3 and not r["ok"] for r in result.hosts.values())
    assert any("host 1 at 10.0.0.2" in r["stdout"] for r in result.hosts.values())
    assert links_with(f"t{os.getpid() % 10000}") == []


@needs_root
def test_exception_mid_run_still_tears_everything_down(tmp_path, monkeypatch):
    def explode(self, progress=None):
        raise RuntimeError("host run failed")

    monkeypatch.setattr(tb.Testbed, "run_hosts", explode)   # fault injection after build()
    with pytest.raises(RuntimeError, match="host run failed"):
        run_testbed(tb.TestbedOptions(hosts=2, switch="reference", bw=0, workdir=str(tmp_path)))
    assert links_with(f"t{os.getpid() % 10000}") == []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"t{os.getpid() % 10000}" not in names


@needs_root
def test_bad_options_are_refused_before_building(tmp_path):
    with pytest.raises(tb.TestbedError, match="1..32"):
        run_testbed(tb.TestbedOptions(hosts=0, switch="reference"))
    with pytest.raises(tb.TestbedError, match="unknown switch"):
        run_testbed(tb.TestbedOptions(hosts=2, switch="tofino"))
    if not switch_available("bmv2")[0]:
        with pytest.raises(tb.TestbedError, match="bmv2 cannot run here"):
            run_testbed(tb.TestbedOptions(hosts=2, switch="bmv2"))
    with pytest.raises(tb.TestbedError, match="overflows"):     # 9 workers x g=30 > 255
        run_testbed(tb.TestbedOptions(hosts=9, switch="reference", workdir=str(tmp_path)))


def test_config_places_worker_w_on_port_w():
    cfg = make_config(4, pool_size=16)
    (job,) = cfg.jobs
    assert [(m.worker, m.port, m.ip) for m in job.members] == \
        [(w, w, f"10.0.0.{w + 1}") for w in range(4)]
    assert len({m.udp_port for m in job.members}) == 4   # the UDP service needs distinct ones


def test_cli_help_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "--switch" in capsys.readouterr().out


@needs_root
def test_sigterm_mid_run_tears_down(tmp_path):
    import sys
    import time
    proc = subprocess.Popen([sys.executable, "-m", "host.experiments.testbed", "--switch", "reference",
                             "--hosts", "2", "--bw", "0", "--command", "sleep 60",
                             "--workdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tag = f"t{proc.pid % 10000}"
    try:
        deadline = time.monotonic() + 30
        while not links_with(tag + "s-eth") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert links_with(tag + "s"), "testbed never came up"
        time.sleep(1.0)                      # hosts are running their command now
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert links_with(tag) == []
