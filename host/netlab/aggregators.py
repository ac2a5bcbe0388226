"""Starting and stopping the lab's aggregators as processes: the reference UDP service
(dataplane.udp_service) and the DPDK switch (thc_switch on net_af_packet ports).

`popen` is whatever starts a process where the aggregator must run: subprocess.Popen
(this namespace), `Topology.popen_switch` (the switch namespace) or a Mininet host's
`popen`. Both starters wait until the process says it is ready and raise
AggregatorError, with what it printed, when it does not.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dataplane.dpdk_config import write_config
from dataplane.dpdk_runner import SWITCH_BIN, eal_args

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0


class AggregatorError(RuntimeError):
    """An aggregator did not start; the message has its output."""


def python_env(**extra) -> dict:
    """The environment of a Python process started in the lab (this checkout first)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def start_reference(popen, config_path, host: str, port: int,
                    counters_json=None) -> subprocess.Popen:
    """dataplane.udp_service serving config_path at (host, port), once it is bound."""
    argv = [sys.executable, "-m", "dataplane.udp_service", "--config", str(config_path),
            "--host", host, "--port", str(port)]
    if counters_json is not None:
        argv += ["--counters-json", str(counters_json)]
    proc = popen(argv, cwd=str(REPO_ROOT), env=python_env(), stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()                 # "serving ..." once it is bound
    if "serving" not in line:
        stop(proc)
        raise AggregatorError(f"the reference UDP service did not start: "
                              f"{(line + proc.stdout.read()).strip()[-2000:]}")
    return proc


def start_dpdk(popen, config, vdevs: list[str], workdir) -> subprocess.Popen:
    """thc_switch with `vdevs` (port p = vdevs[p]) serving `config`, once it runs.

    Its configuration, log and (when it stops) counters go to workdir: dpdk_switch.conf,
    dpdk_switch.log, dpdk_stats.json."""
    workdir = Path(workdir)
    conf = write_config(config, workdir / "dpdk_switch.conf")
    log_path = workdir / "dpdk_switch.log"
    with open(log_path, "w") as log:
        proc = popen([str(SWITCH_BIN), *eal_args(vdevs), "--", "--config", str(conf),
                      "--stats", str(workdir / "dpdk_stats.json")],
                     stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()             # its one start-up line: "... running"
        if not line:
            break
        if "running" in line:
            return proc
    stop(proc)
    raise AggregatorError("thc_switch did not start: " + log_path.read_text()[-2000:])


def stop(proc, timeout: float = 20.0) -> None:
    """SIGTERM (the aggregators write their counters then), SIGKILL after timeout."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
