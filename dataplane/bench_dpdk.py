"""Benchmark: the DPDK switch's aggregation rate on one core.

Side by side in one run, on the same packets (4 workers, 1024 values per packet by
default, every slot of a pool in turn, rounds advancing under the window rule):

  * dpdk aggregate  thc_switch --bench: mbufs from the mempool filled by an in-memory
                    generator (no pcap I/O), full path: validation, slot state machine,
                    result multicast, DLCP, tx burst to net_null ports;
  * dpdk forward    the same binary and generator with --forward-only: l2fwd's MAC
                    rewrite and tx burst, no aggregation (the bound);
  * reference       dataplane.reference.ReferenceSwitch.process on the same frames.

Rates are per CPU-second of the one thread doing the work (the switch's lcore, the
Python thread), so other load on a shared machine does not count; medians of --repeat
runs. Prints a table; --json PATH writes the numbers.

    python -m dataplane.bench_dpdk [--packets 2000000] [--values 1024] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dataplane.config import Job, Member, SwitchConfig
from dataplane.dpdk_config import write_config
from dataplane.dpdk_runner import SWITCH_BIN, build, eal_args
from dataplane.reference import ReferenceSwitch

TABLE = (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 24, 27, 30)
SWITCH_MAC, SWITCH_IP = "02:00:00:00:00:fe", "10.0.0.254"


def bench_config(workers: int, pool_size: int) -> SwitchConfig:
    members = tuple(Member(w, w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.1.{w + 1}", 40000 + w)
                    for w in range(workers))
    return SwitchConfig(SWITCH_MAC, SWITCH_IP, (Job(1, pool_size, TABLE, members),))


def run_switch(config_path: Path, workers: int, packets: int, values: int,
               forward_only: bool) -> dict:
    vdevs = [f"net_null{p}" for p in range(workers)]
    cmd = [str(SWITCH_BIN), *eal_args(vdevs), "--", "--config", str(config_path),
           "--bench", str(packets), "--bench-values", str(values)]
    if forward_only:
        cmd.append("--forward-only")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    m = re.search(r"^BENCH (\{.*\})$", res.stdout, re.M)
    if res.returncode != 0 or m is None:
        raise RuntimeError(f"thc_switch --bench failed ({res.returncode}): {res.stderr}")
    return json.loads(m.group(1))


def reference_frames(config: SwitchConfig, packets: int, values: int, rng) -> list:
    """The stream the binary's generator makes: worker k % n, slot (k // n) % pool,
    round (k // n) // pool, one random payload per worker, ToS band 0 + ECT(0)."""
    from host.packets import AGG_PORT_BASE, encode_data, wrap_frames
    job = config.jobs[0]
    n = len(job.members)
    templates = []
    for m in job.members:
        packed = rng.integers(0, 256, (values + 1) // 2).astype(np.uint8)
        bufs, lengths = encode_data(packed, values, values, job=job.job, worker=m.worker,
                                    tensor=0, slots=0, rounds=0, expected=job.expected_all)
        templates.append((m, bufs, lengths))
    frames = []
    for k in range(packets):
        m, bufs, lengths = templates[k % n]
        chunk = k // n
        b = bufs.copy()
        b[0, 4:6] = divmod(chunk % job.pool_size, 256)
        b[0, 8:12] = np.frombuffer(int(chunk // job.pool_size).to_bytes(4, "big"), np.uint8)
        frame = wrap_frames(b, lengths, src_mac=m.mac, dst_mac=SWITCH_MAC, src_ip=m.ip,
                            dst_ip=SWITCH_IP, sport=m.udp_port, dport=AGG_PORT_BASE,
                            tos=(32 << 2) | 2)[0]
        frames.append((m.port, frame))
    return frames


def run_reference(config: SwitchConfig, frames: list) -> dict:
    ref = ReferenceSwitch(config, clock=lambda: 0.0)
    start, wall = time.thread_time(), time.perf_counter()
    for port, frame in frames:
        ref.process(port, frame, now=0.0)
    # CPU time of this thread, like the switch's own figure (the machine is shared).
    secs = time.thread_time() - start
    wall = time.perf_counter() - wall
    c = ref.counters()["jobs"][1]
    return {"packets": len(frames), "cpu_seconds": secs, "wall_seconds": wall,
            "packets_per_s": len(frames) / secs,
            "aggregated": c["aggregated"], "results": c["results_multicast"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="DPDK switch vs plain forwarder vs reference")
    ap.add_argument("--packets", type=int, default=2_000_000, help="per DPDK run")
    ap.add_argument("--ref-packets", type=int, default=4000, help="for the Python reference")
    ap.add_argument("--values", type=int, default=1024, help="values per packet")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pool", type=int, default=256, help="slots in the job's pool")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="bar chart of packets/s (PNG)")
    args = ap.parse_args(argv)

    build()
    config = bench_config(args.workers, args.pool)
    runs = {"aggregate": [], "forward": [], "reference": []}
    with tempfile.TemporaryDirectory() as tmp:
        conf = write_config(config, Path(tmp) / "bench.conf")
        frames = reference_frames(config, args.ref_packets, args.values,
                                  np.random.default_rng(0))
        for _ in tqdm(range(args.repeat), desc="bench rounds"):
            # Interleaved so load changes on the shared machine hit all three alike.
            runs["forward"].append(run_switch(conf, args.workers, args.packets, args.values, True))
            runs["aggregate"].append(run_switch(conf, args.workers, args.packets, args.values, False))
            runs["reference"].append(run_reference(config, frames))

    med = {k: statistics.median(r["packets_per_s"] for r in v) for k, v in runs.items()}
    agg_ok = all(r["results"] * args.workers == r["packets"] for r in runs["aggregate"])
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.node()}".strip(),
        "workers": args.workers, "values_per_packet": args.values, "pool": args.pool,
        "packets_per_s": med,
        "values_per_s": {k: v * args.values for k, v in med.items()},
        "aggregate_vs_forward": med["aggregate"] / med["forward"],
        "aggregate_vs_reference": med["aggregate"] / med["reference"],
        "every_round_completed": agg_ok,
        "runs": runs,
    }
    print(f"\n{'mode':<28}{'packets/s':>14}{'values/s':>16}{'vs aggregate':>14}")
    for name, label in (("forward", "dpdk plain forwarder"), ("aggregate", "dpdk aggregate"),
                        ("reference", "python reference")):
        print(f"{label:<28}{med[name]:>14,.0f}{med[name] * args.values:>16,.0f}"
              f"{med['aggregate'] / med[name]:>13.2f}x")
    print(f"aggregate / forwarder = {result['aggregate_vs_forward']:.2f} (target >= 0.5); "
          f"aggregate / reference = {result['aggregate_vs_reference']:.0f}x (target >= 20x); "
          f"all rounds completed: {agg_ok}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = ["dpdk forward", "dpdk aggregate", "python reference"]
        vals = [med["forward"], med["aggregate"], med["reference"]]
        ax.bar(names, vals, color=["grey", "tab:blue", "tab:orange"])
        ax.set_yscale("log")
        ax.set_ylabel("packets/s (one core, log)")
        ax.set_title(f"{args.workers} workers, {args.values} values/packet")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
