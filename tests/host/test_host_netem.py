"""Network namespaces with shaped links (root), and the allreduce benchmark on them."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from host.netlab.netem import NetnsTestbed, netns_available

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
    with NetnsTestbed(2, rate_mbit=rate) as tb:
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
    tb = NetnsTestbed(1, rate_mbit=100, delay_ms=5)
    try:
        tb.__enter__()
        assert tb.qdisc == "netem"
    except Exception as exc:                               # kernels without sch_netem
        assert "no netem qdisc" in str(exc)
    finally:
        tb.close()


@pytest.mark.slow
def test_benchmark_runs_modes_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    # 2 MB: the tbf bucket (500 KB at 1 Gbit/s) must hold well under half of the ring's
    # 2 MB per direction, or a fast run beats half the wire bound on the burst alone.
    res = subprocess.run([sys.executable, "-m", "host.experiments.bench_allreduce", "--workers", "2",
                          "--sizes-mb", "2", "--rates-mbit", "1000", "--reps", "1",
                          "--modes", "thc-agg,fp32-gloo",   # thc-gloo: test_host_allreduce
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == {"thc-agg", "fp32-gloo"}
    for r in rows:
        assert r["median_s"] > 0 and r["bound_s"] > 0
    fp32 = next(r for r in rows if r["mode"] == "fp32-gloo")
    assert fp32["median_s"] > 0.5 * fp32["bound_s"]      # the shaped link is the floor


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
