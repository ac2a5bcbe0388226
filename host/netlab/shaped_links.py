"""Workers on shaped links: an aggregator on a NetnsTestbed, and workers that join their
namespace. Shared by host.experiments.bench_allreduce and host.experiments.main_job --link-mbit.

* `job_config`: the job description of a testbed's hosts (worker w at host_ip(w),
  WORKER_UDP_PORT), with the packet size the hosts send;
* `start_reference`: the reference UDP service bound to the bridge in the switch
  namespace (in-network aggregation: its traffic crosses only the workers' links);
* `start_dpdk`: the DPDK switch on the bare switch ports of a switch="ports" testbed
  (net_af_packet, qdisc_bypass=0 so the ports' shaping applies to its output too);
* `enter_netns`: move the calling process's main thread (and every thread and socket it
  creates afterwards) into a namespace, before the worker opens anything.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER_UDP_PORT = 40000
AGG_PORT = 50000
GLOO_PORT = 29600
CLONE_NEWNET = 0x40000000


def job_config(tb, pool_size: int, job: int = 1, values_per_packet: int = 1024):
    from dataplane.config import Job, Member, SwitchConfig
    members = [Member(worker=w, port=w, mac=tb.host_mac(w), ip=tb.host_ip(w),
                      udp_port=WORKER_UDP_PORT) for w in range(tb.num_hosts)]
    return SwitchConfig(ip=tb.switch_ip, mac=tb.switch_mac,
                        jobs=(Job.from_thc(job, pool_size, members,
                                           values_per_packet=values_per_packet),)).validate()


def python_env(**extra) -> dict:
    """The environment of a Python process started on the testbed (this checkout first)."""
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=str(Path(__file__).resolve().parents[2]), **extra)


def start_reference(tb, config, workdir: Path) -> subprocess.Popen:
    """The reference aggregator in the switch namespace at (tb.switch_ip, AGG_PORT)."""
    path = Path(workdir) / "switch.json"
    config.save(path)
    agg = tb.popen_switch([sys.executable, "-m", "dataplane.udp_service", "--config", str(path),
                           "--host", tb.switch_ip, "--port", str(AGG_PORT)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=python_env())
    agg.stdout.readline()                 # "serving ..." once it is bound
    return agg


def start_dpdk(tb, config, workdir: Path, ring_frames: int = 1024) -> subprocess.Popen:
    """thc_switch in the switch namespace, port w = worker w's link (af_packet).

    Its counters go to workdir/dpdk_stats.json when it stops."""
    from dataplane.dpdk_config import write_config
    from dataplane.dpdk_runner import SWITCH_BIN, af_packet_vdevs, eal_args
    workdir = Path(workdir)
    conf = write_config(config, workdir / "dpdk_switch.conf")
    # qdisc_bypass=0: the switch's transmissions go through the port's tbf (the link rate).
    # Jumbo-sized ring frames (16 KiB of locked memory each, per direction): 1024 hold four
    # windows of a 256-slot pool, room while the switch's lcore is descheduled on this
    # shared machine (512 lost packets at 1024 values per packet).
    vdevs = af_packet_vdevs([tb.switch_port(p) for p in range(tb.num_hosts)],
                            framecnt=ring_frames, qdisc_bypass=False)
    log = open(workdir / "dpdk_switch.log", "w")
    proc = tb.popen_switch([str(SWITCH_BIN), *eal_args(vdevs), "--", "--config", str(conf),
                            "--stats", str(workdir / "dpdk_stats.json")],
                           stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "running" in line:
            return proc
    proc.kill()
    proc.wait()
    raise SystemExit("thc_switch did not start: " +
                     (workdir / "dpdk_switch.log").read_text()[-2000:])


def stop(proc) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def enter_netns(name: str) -> None:
    """setns(CLONE_NEWNET) for the calling thread: call it in a worker process's main
    thread before it creates threads or sockets (they are created in the namespace)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
