"""Allreduce time vs tensor size on emulated links (root: network namespaces).

    sudo python -m host.experiments.bench_allreduce                      # 4 workers, 1 and 10 Gbit/s
    python -m host.experiments.bench_allreduce --sizes-mb 1,4,16 --json out/bench_allreduce.json

Each worker lives in its own network namespace, linked to a bridge by a veth pair shaped to
the link rate in both directions (host.netlab.topology.Topology). Side by side in one run:
  thc-agg    THC through the reference aggregator, which sits on the bridge (in the switch
             namespace), so its traffic crosses only the workers' links: in-network
             aggregation, 4 bits up and 8 bits down per value;
  thc-dpdk   THC through the DPDK switch (dataplane/dpdk/build/thc_switch, `make build`):
             no bridge; each worker link ends on its own switch port (net_af_packet on the
             switch-side veth, qdisc_bypass=0 so the link's tbf shapes the switch's
             output too). The process group (norm MAX exchange, barriers) runs over a
             separate unshaped control network, a few hundred bytes per call;
  thc-gloo   THC over gloo all_reduce(SUM) on uint8 lanes (no switch);
  bf16-hook  what torch's DDP hook bf16_compress_hook does to a bucket: cast to bf16,
             divide by the world size, gloo all_reduce, cast back (same process group
             and links as fp32-gloo);
  fp16-hook  the same with fp16 (fp16_compress_hook);
  fp32-gloo  plain fp32 gloo all_reduce, divided by the world size.
After the tables: each THC mode's time over bf16-hook's and over fp32-gloo's, at the same
rate and size in this run (below 1: THC is faster); the JSON rows carry them too.
`bound` is the bytes-on-the-wire limit of one worker link, the busier direction:
thc-agg max(up, down) frame bytes; ring allreduces 2(n-1)/n of the buffer each way.
`what bound it` names, per cell, the resource that held it: `wire` (within 25 % of that
bound), `cpu` (the machine's cores at least 90 % busy during the call, /proc/stat: workers,
switch and kernel together), else `sync` (the workers waiting on each other); the CPU of
all workers per call is printed too.
Times are medians over --reps of the slowest worker (all_reduce MAX of the per-worker times).
`peak MB` is the largest growth of a worker's resident memory over its timed reps of a
size (peak RSS over the RSS after the warm-up call, which holds the input, the
error-feedback state (1x the tensor) and the codec's and transport's set-up), the
busiest worker's: the output and everything transient (`x tensor`: in tensor sizes).

Packets: --values-per-packet (default 8192, the software aggregators' MAX_VALUES) sets
what the hosts send and the job description says; above 1440 values the links get jumbo
frames (MTU 9000), which veth links carry. THC modes are pipelined (--pipeline-values
padded values per chunk, 0 = whole tensors); --gso sends with UDP GSO (off by default,
host.datagram).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import thc
from dataplane.config import MAX_VALUES
from dataplane.dpdk_runner import SWITCH_BIN
from host.allreduce import DEFAULT_PIPELINE_VALUES
from host.ddp_hook import thc_hook_state
from host.netlab.aggregators import python_env, stop
from host.netlab.shaped_links import (AGG_PORT, GLOO_PORT, WORKER_UDP_PORT, job_config,
                                      start_dpdk, start_reference)

MODES = ("thc-agg", "thc-dpdk", "thc-gloo", "bf16-hook", "fp16-hook", "fp32-gloo")
AGG_MODES = ("thc-agg", "thc-dpdk")
THC_MODES = ("thc-agg", "thc-dpdk", "thc-gloo")
HOOK_DTYPES = {"bf16-hook": torch.bfloat16, "fp16-hook": torch.float16}
BASELINES = ("bf16-hook", "fp32-gloo")  # what each THC mode's time is divided by
VALUES_PER_PACKET = MAX_VALUES          # veth links take the jumbo frames it needs
FRAME_OVERHEAD = 14 + 20 + 8 + 32      # Ethernet + IPv4 + UDP + AGG header per packet
STANDARD_MTU, JUMBO_MTU = 1500, 9000


def link_mtu(values_per_packet: int) -> int:
    """The data links' MTU: jumbo frames once a RESULT (8 bits a value) outgrows 1500."""
    return STANDARD_MTU if 28 + 32 + values_per_packet <= STANDARD_MTU else JUMBO_MTU


def wire_bound_seconds(mode: str, size_bytes: int, workers: int, rate_mbit: float,
                       values_per_packet: int = VALUES_PER_PACKET) -> float:
    """Time one worker link needs for the bytes it must carry (the busier direction)."""
    d = size_bytes // 4
    if mode in AGG_MODES:
        padded = thc.THCCodec().padded_length(d)
        packets = -(-padded // values_per_packet)
        up = padded / 2 + packets * FRAME_OVERHEAD
        down = padded + packets * FRAME_OVERHEAD
        busiest = max(up, down)
    elif mode == "thc-gloo":
        busiest = 2 * (workers - 1) / workers * thc.THCCodec().padded_length(d)
    elif mode in HOOK_DTYPES:
        busiest = 2 * (workers - 1) / workers * 2 * d
    else:
        busiest = 2 * (workers - 1) / workers * 4 * d
    return busiest * 8 / (rate_mbit * 1e6)


# --------------------------------------------------------------------------- worker side

def compressed_mean(x: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
    """The mean over the process group as torch's fp16/bf16_compress_hook computes it: cast,
    divide by the world size, all_reduce(SUM) in that dtype, cast back."""
    compressed = x.to(dtype).div_(world)
    dist.all_reduce(compressed)
    return compressed.to(x.dtype)


def worker(args) -> None:
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=120))
    state = None
    if args.mode in AGG_MODES:
        state = thc_hook_state(aggregator=args.aggregator, job=1, pool_size=args.pool_size,
                               job_config=Path(args.out).parent / "job.json",
                               worker_address=(args.ip, WORKER_UDP_PORT), timeout=60,
                               values_per_packet=args.values_per_packet,
                               pipeline_values=args.pipeline_values)
    elif args.mode == "thc-gloo":
        state = thc_hook_state(pipeline_values=args.pipeline_values)
    results = {"peak_bytes": {}}
    for key, mb in enumerate(args.sizes_mb):
        d = int(mb * (1 << 20)) // 4
        x = torch.from_numpy(np.random.default_rng(args.rank).standard_normal(d)
                             .astype(np.float32))
        times, cpu, busy, base = [], [], [], None
        for rep in range(args.reps + 1):                 # the first is a warm-up
            if rep == 1:
                base = _reset_peak_rss()                 # after the warm-up's allocations
            dist.barrier()
            machine0, cpu0 = machine_cpu_ticks(), time.process_time()
            t0 = time.perf_counter()
            if args.mode in HOOK_DTYPES:
                compressed_mean(x, HOOK_DTYPES[args.mode], args.world)
            elif state is None:
                y = x.clone()
                dist.all_reduce(y)
                y /= args.world
            else:
                state.reduce(x, key)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            used = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
            busy_fraction = machine_busy(machine0, machine_cpu_ticks())
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used)                        # every worker's CPU for the call
            if rep:
                times.append(float(elapsed))
                cpu.append(float(used))
                busy.append(busy_fraction)
        results[str(mb)] = times
        results.setdefault("worker_cpu_s", {})[str(mb)] = cpu
        results.setdefault("machine_busy", {})[str(mb)] = busy
        peak = torch.tensor([_peak_rss() - base if base is not None else -1.0],
                            dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        results["peak_bytes"][str(mb)] = float(peak) if float(peak) >= 0 else None
    if state is not None:
        # Where rank 0's time went (all sizes and reps together), and the transport's view.
        results["seconds"] = dict(state.allreduce.seconds)
        if args.mode in AGG_MODES:
            results["transport"] = state.allreduce.exchange.transport.stats.as_dict()
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all the machine's CPUs (/proc/stat), everything on it:
    the workers, the switch, the kernel's network work."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)      # idle + iowait
    total = sum(fields[:8])                                       # guest time is in user
    return total - idle, total


MIN_TICKS = 10                 # jiffies (10 ms each): fewer say nothing about a busy fraction


def machine_busy(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The machine's CPUs' busy fraction between two machine_cpu_ticks readings; None
    when too little time passed to tell (a call shorter than a few jiffies)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total >= MIN_TICKS else None


def resource_bound(median_s: float, wire_s: float, busy: float | None) -> str:
    """What held a cell: the wire when the time is within 25 % of the wire bound, the CPU
    when the machine's cores were at least 90 % busy, else waiting on each other
    (synchronisation and latency: neither resource saturated)."""
    if median_s <= 1.25 * wire_s:
        return "wire"
    if busy is not None and busy >= 0.9:
        return "cpu"
    return "sync"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> int | None:
    """Reset this process's peak RSS to its current RSS (Linux clear_refs 5); the RSS, or
    None where the kernel does not allow it."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS")
    except (OSError, KeyError):
        return None


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


# --------------------------------------------------------------------------- the parent

def _run_mode(tb, mode, args, tmp: Path) -> dict:
    n = args.workers
    out = tmp / f"{mode}.json"
    # ports mode (DPDK switch): the process group uses the unshaped control network.
    ports = tb.layout == "ports"
    env = python_env(GLOO_SOCKET_IFNAME="ctl0" if ports else "eth0")
    if args.gso and tb.gso:
        env["THC_GSO"] = "1"
    master = tb.control_ip(0) if ports else tb.host_ip(0)
    procs = []
    for w in range(n):
        argv = [sys.executable, "-m", "host.experiments.bench_allreduce", "--worker", "--rank", str(w),
                "--world", str(n), "--master", f"{master}:{GLOO_PORT}", "--mode", mode,
                "--ip", tb.host_ip(w), "--aggregator", f"{tb.switch_ip}:{AGG_PORT}",
                "--sizes-mb", ",".join(str(s) for s in args.sizes_mb), "--reps", str(args.reps),
                "--pool-size", str(args.pool_size), "--out", str(out),
                "--values-per-packet", str(args.values_per_packet),
                "--pipeline-values", str(args.pipeline_values)]
        procs.append(tb.popen(w, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=args.timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{mode}: workers did not finish in {args.timeout} s")
    if any(p.returncode for p in procs) or not out.exists():
        bad = [w for w, p in enumerate(procs) if p.returncode]
        raise SystemExit(f"{mode}: workers {bad} failed:\n" + "\n".join(
            logs[w][-2000:] for w in bad))
    return json.loads(out.read_text())


def _rows(times, mode, rate, tb, args) -> list[dict]:
    rows = []
    for mb in args.sizes_mb:
        t = float(np.median(times[str(mb)]))
        bound = wire_bound_seconds(mode, int(mb * (1 << 20)), args.workers, rate,
                                   args.values_per_packet)
        cpu = times.get("worker_cpu_s", {}).get(str(mb))
        busy = [b for b in times.get("machine_busy", {}).get(str(mb), []) if b is not None]
        busy = float(np.median(busy)) if busy else None
        rows.append({"rate_mbit": rate, "mode": mode, "size_mb": mb, "median_s": t,
                     "bound_s": bound, "qdisc": tb.qdisc, "reps": args.reps,
                     "worker_cpu_s": float(np.median(cpu)) if cpu else None,
                     "machine_busy": busy, "resource_bound": resource_bound(t, bound, busy),
                     "workers": args.workers, "times_s": times[str(mb)],
                     "peak_bytes": times["peak_bytes"].get(str(mb)),
                     "values_per_packet": args.values_per_packet, "mtu": tb.mtu,
                     "pipeline_values": args.pipeline_values,
                     "gso": args.gso and tb.gso})
    for key in ("seconds", "transport"):
        if key in times:
            rows[-1][key] = times[key]
    return rows


def run_benchmark(args) -> list[dict]:
    from host.netlab.topology import Topology
    rows = []
    mtu = link_mtu(args.values_per_packet)
    bridged = [m for m in args.modes if m != "thc-dpdk"]
    bar = tqdm(total=len(args.rates_mbit) * len(args.modes), desc="bench_allreduce")
    for rate in args.rates_mbit:
        if bridged:
            with Topology(args.workers, rate, mtu=mtu) as tb, \
                    tempfile.TemporaryDirectory() as tmp:
                config = job_config(tb, args.pool_size,
                                    values_per_packet=args.values_per_packet)
                config.save(Path(tmp) / "job.json")       # the workers' job_config
                agg = start_reference(tb, config, Path(tmp)) \
                    if "thc-agg" in bridged else None
                try:
                    for mode in bridged:
                        rows += _rows(_run_mode(tb, mode, args, Path(tmp)), mode, rate, tb, args)
                        bar.update(1)
                finally:
                    stop(agg)
        if "thc-dpdk" in args.modes:
            with Topology(args.workers, rate, layout="ports", mtu=mtu) as tb, \
                    tempfile.TemporaryDirectory() as tmp:
                config = job_config(tb, args.pool_size,
                                    values_per_packet=args.values_per_packet)
                config.save(Path(tmp) / "job.json")       # the workers' job_config
                switch = start_dpdk(tb, config, Path(tmp), args.switch_ring)
                try:
                    rows += _rows(_run_mode(tb, "thc-dpdk", args, Path(tmp)), "thc-dpdk", rate,
                                  tb, args)
                    bar.update(1)
                finally:
                    stop(switch)
                stats = Path(tmp) / "dpdk_stats.json"
                if stats.exists():
                    full = json.loads(stats.read_text())
                    rows[-1]["switch_stats"] = full.get("global")
                    rows[-1]["switch_ports"] = full.get("ports")
    bar.close()
    return rows


def add_ratios(rows) -> None:
    """Give each THC row its time over each baseline's at the same rate and size
    (`time_vs_bf16-hook`, `time_vs_fp32-gloo`; None where the baseline did not run)."""
    for row in rows:
        if row["mode"] not in THC_MODES:
            continue
        for base in BASELINES:
            other = next((r for r in rows if r["mode"] == base
                          and (r["rate_mbit"], r["size_mb"]) == (row["rate_mbit"], row["size_mb"])),
                         None)
            row[f"time_vs_{base}"] = row["median_s"] / other["median_s"] if other else None


def _cells(rows):
    """{(rate, size): {mode: row}} in rate, size order."""
    cells = {}
    for r in sorted(rows, key=lambda r: (r["rate_mbit"], r["size_mb"])):
        cells.setdefault((r["rate_mbit"], r["size_mb"]), {})[r["mode"]] = r
    return cells


def _print_grid(cells, title: str, cell_text, width: int) -> None:
    print(f"\n{title}\n{'link':>9} {'size MB':>8} " + " ".join(f"{m:>{width}}" for m in MODES))
    for (rate, mb), row in cells.items():
        print(f"{rate / 1000:>7g}G {mb:>8g} " + " ".join(
            f"{cell_text(row[m], mb) if m in row else '-':>{width}}" for m in MODES))


def print_table(rows) -> None:
    cells = _cells(rows)
    _print_grid(cells, "median ms, slowest worker", lambda r, mb: f"{r['median_s'] * 1e3:.1f}", 10)
    _print_grid(cells, "wire bound ms, one worker link", lambda r, mb: f"{r['bound_s'] * 1e3:.1f}",
                10)
    _print_grid(cells, "what bound it (machine CPU busy during the call)",
                lambda r, mb: r["resource_bound"] + ("" if r.get("machine_busy") is None else
                                                     f" {100 * r['machine_busy']:.0f}%"), 10)
    _print_grid(cells, "CPU ms per call, all workers together",
                lambda r, mb: "-" if r.get("worker_cpu_s") is None else
                f"{r['worker_cpu_s'] * 1e3:.0f}", 10)
    _print_grid(cells, "peak MB (x tensor)", lambda r, mb: "-" if r.get("peak_bytes") is None else
                f"{r['peak_bytes'] / 2**20:.1f} ({r['peak_bytes'] / (mb * 2**20):.2f}x)", 16)
    print("\nTHC's time / the baseline's, same rate and size, this run (below 1: THC faster)")
    for (rate, mb), row in cells.items():
        parts = [f"{m} / {base} {row[m][f'time_vs_{base}']:.2f}"
                 for m in THC_MODES if m in row for base in BASELINES
                 if row[m].get(f"time_vs_{base}") is not None]
        print(f"{rate / 1000:>7g}G {mb:>8g} MB: " + (", ".join(parts) or "no THC mode or "
                                                       "no baseline in --modes"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m host.experiments.bench_allreduce",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", default="1,4,16",
                    help="tensor sizes in MiB (the full study goes to 256; default keeps the "
                         "shared 2-core machine usable)")
    ap.add_argument("--rates-mbit", default="1000,10000", help="link rates in Mbit/s")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--pool-size", type=int, default=256)
    ap.add_argument("--values-per-packet", type=int, default=VALUES_PER_PACKET,
                    help=f"values per AGG packet (1..{MAX_VALUES}, the software aggregators' "
                         "limit; above 1440 the links get jumbo frames)")
    ap.add_argument("--pipeline-values", type=int, default=DEFAULT_PIPELINE_VALUES,
                    help="THC: padded values per pipeline chunk (0: whole tensors)")
    ap.add_argument("--gso", action="store_true",
                    help="THC through an aggregator: send with UDP GSO (THC_GSO=1; the "
                         "ports testbed cuts the super-datagrams at each host's link end)")
    ap.add_argument("--switch-ring", type=int, default=1024,
                    help="thc-dpdk: frames in each af_packet ring of the switch")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mode and rate")
    ap.add_argument("--json", help="write the rows to this file")
    # worker-side (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--ip", help=argparse.SUPPRESS)
    ap.add_argument("--aggregator", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes_mb = [float(s) if "." in s else int(s) for s in str(args.sizes_mb).split(",")]
    args.rates_mbit = [float(r) for r in str(args.rates_mbit).split(",")] \
        if isinstance(args.rates_mbit, str) else args.rates_mbit
    args.modes = [m for m in str(args.modes).split(",") if m]
    if not args.worker and "thc-dpdk" in args.modes:
        if not SWITCH_BIN.is_file():
            print(f"bench_allreduce: no thc-dpdk column: {SWITCH_BIN} is not built "
                  "(make build)", file=sys.stderr)
            args.modes.remove("thc-dpdk")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {MODES}")
    if not args.worker and args.workers * 30 > 255 and set(AGG_MODES) & set(args.modes):
        ap.error("thc-agg: at most 8 workers fit the 8-bit switch lanes")
    if not 1 <= args.values_per_packet <= MAX_VALUES:
        ap.error(f"--values-per-packet {args.values_per_packet}: give 1..{MAX_VALUES}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # The workers share this machine: each codec takes its share of the cores (host.allreduce).
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(args.workers))
    if args.worker:
        worker(args)
        return 0
    from host.netlab.links import netns_available
    reason = netns_available()
    if reason:
        print(f"bench_allreduce: {reason}", file=sys.stderr)
        return 2
    rows = run_benchmark(args)
    add_ratios(rows)
    print_table(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": os.uname().release,
                                               "cores": os.cpu_count()}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
