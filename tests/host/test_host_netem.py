"""Network namespaces with shaped links (root), and the allreduce benchmark on them."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from host.netlab.links import netns_available
from host.netlab.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
REASON = netns_available()
pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")]

SINK = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
        "s.bind((sys.argv[1],5001));s.listen(1);c,_=s.accept();n=0\n"
        "while True:\n b=c.recv(1<<16)\n if not b: break\n n+=len(b)\nprint(n)")
SOURCE = ("import socket,sys,time;c=socket.create_connection((sys.argv[1],5001));t=time.time();"
          "c.sendall(b'x'*int(sys.argv[2]));c.shutdown(socket.SHUT_WR);c.recv(1);"
          "print(time.time()-t)")


def test_links_are_shaped_to_the_rate():
    nbytes, rate = 1_000_000, 20
    with Topology(2, rate_mbit=rate) as tb:
        sink = tb.popen(1, [sys.executable, "-c", SINK, tb.host_ip(1)], stdout=subprocess.PIPE,
                        text=True)
        time.sleep(0.5)
        src = tb.popen(0, [sys.executable, "-c", SOURCE, tb.host_ip(1), str(nbytes)],
                       stdout=subprocess.PIPE, text=True)
        elapsed = float(src.communicate(timeout=30)[0])
        received = int(sink.communicate(timeout=30)[0])
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert tb.switch_ns in names
    assert received == nbytes
    assert elapsed > 0.8 * nbytes * 8 / (rate * 1e6)      # bytes on the wire cost time
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tb.switch_ns not in names                       # cleaned up


def test_delay_without_netem_is_refused_or_applied():
    tb = Topology(1, rate_mbit=100, delay_ms=5)
    try:
        tb.up()
        assert tb.qdisc == "netem"
    except Exception as exc:                               # kernels without sch_netem
        assert "no netem qdisc" in str(exc)
    finally:
        tb.down()


def _ipv6_disabled(dev: str, ns: str | None) -> str:
    path = f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"
    argv = ["cat", path] if ns is None else ["ip", "netns", "exec", ns, "cat", path]
    return subprocess.run(argv, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("layout", ["bridge", "ports", "routed"])
def test_every_link_a_switch_sees_is_quiet(layout):
    """IPv6 off on both ends of every link, so no neighbour discovery reaches a switch."""
    with Topology(2, layout=layout) as tb:
        ends = [(h.host_if, h.ns) for h in tb.hosts] + [(h.switch_if, tb.switch_ns)
                                                         for h in tb.hosts]
        if layout == "ports":
            ends += [("ctl0", h.ns) for h in tb.hosts]
        assert {end: _ipv6_disabled(*end) for end in ends} == {end: "1" for end in ends}
        for ns in tb.host_ns:
            addrs = subprocess.run(["ip", "netns", "exec", ns, "ip", "-6", "addr"],
                                   capture_output=True, text=True).stdout
            assert addrs.strip() == "", addrs


def test_sigterm_tears_a_topology_down():
    code = ("import sys, time\nfrom host.netlab.topology import Topology\n"
            "tb = Topology(2, layout='routed').up()\nprint(tb.tag, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        tag = proc.stdout.readline().strip()
        assert tag, "the topology never came up"
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"nl{tag}h0" in names
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + 15
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"nl{tag}" not in names and f"nl{tag}" not in links


@pytest.mark.slow
def test_benchmark_runs_modes_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    # 2 MB: the tbf bucket (500 KB at 1 Gbit/s) must hold well under half of the ring's
    # 2 MB per direction, or a fast run beats half the wire bound on the burst alone.
    res = subprocess.run([sys.executable, "-m", "host.experiments.bench_allreduce", "--workers", "2",
                          "--sizes-mb", "2", "--rates-mbit", "1000", "--reps", "1",
                          # thc-gloo: test_host_allreduce
                          "--modes", "thc-agg,bf16-hook,fp16-hook,fp32-gloo",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"thc-agg", "bf16-hook", "fp16-hook", "fp32-gloo"}
    for r in rows.values():
        assert r["median_s"] > 0 and r["bound_s"] > 0
        assert r["values_per_packet"] == 8192 and r["mtu"] == 9000   # jumbo by default
        # The profile names what held each cell: both workers' CPU and the machine's.
        assert r["worker_cpu_s"] > 0
        assert r["machine_busy"] is None or 0 <= r["machine_busy"] <= 1
        assert r["resource_bound"] in ("wire", "cpu", "sync")
    assert "what bound it" in res.stdout
    fp32 = rows["fp32-gloo"]
    assert fp32["median_s"] > 0.5 * fp32["bound_s"]      # the shaped link is the floor
    for hook in ("bf16-hook", "fp16-hook"):              # 2 bytes a value on the same ring
        assert rows[hook]["bound_s"] == pytest.approx(fp32["bound_s"] / 2)
    thc, bf16 = rows["thc-agg"], rows["bf16-hook"]        # ratios measured in this run
    assert thc["time_vs_bf16-hook"] == pytest.approx(thc["median_s"] / bf16["median_s"])
    assert thc["time_vs_fp32-gloo"] == pytest.approx(thc["median_s"] / fp32["median_s"])
    assert "thc-agg / bf16-hook" in res.stdout and "thc-agg / fp32-gloo" in res.stdout


@pytest.mark.slow
def test_benchmark_dpdk_switch_column(tmp_path):
    """thc-dpdk: the DPDK switch on the workers' shaped links aggregates every chunk."""
    from dataplane.dpdk_runner import SWITCH_BIN
    if not SWITCH_BIN.is_file():
        pytest.skip(f"{SWITCH_BIN} is not built (make build)")
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "host.experiments.bench_allreduce", "--workers", "2",
                          "--sizes-mb", "0.25", "--rates-mbit", "1000", "--reps", "1",
                          "--modes", "thc-dpdk", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["thc-dpdk"]
    assert rows[0]["median_s"] > 0 and rows[0]["bound_s"] > 0
    drops = {k: v for k, v in rows[0]["switch_stats"].items() if k.startswith("drop")}
    assert not any(drops.values()), drops


def test_the_benchmark_names_the_resource_that_bound_a_cell():
    from host.experiments.bench_allreduce import machine_busy, machine_cpu_ticks, resource_bound
    assert resource_bound(0.110, 0.100, 0.99) == "wire"        # near the wire: CPU irrelevant
    assert resource_bound(0.200, 0.100, 0.95) == "cpu"
    assert resource_bound(0.200, 0.100, 0.40) == "sync"
    before = machine_cpu_ticks()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.15:                      # 150 ms of work of our own
        pass
    # at least our one core of the machine's, busy most of the time
    assert 0.5 / os.cpu_count() < machine_busy(before, machine_cpu_ticks()) <= 1
    assert machine_busy(before, before) is None                 # too short to tell
