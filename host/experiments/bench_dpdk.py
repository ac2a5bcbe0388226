"""Benchmark: the DPDK switch's aggregation rate on one core.

Side by side in one run, on the same packets (4 workers, 1024 values per packet by
default, every slot of a pool in turn, rounds advancing under the window rule):

  * dpdk aggregate  thc_switch --bench: an in-memory generator stands in for port 0's
                    rx inside the live poll loop (mbufs from the mempool, no pcap I/O),
                    full path: validation, slot state machine, result multicast, DLCP,
                    tx burst to net_null ports;
  * dpdk forward    the same binary and generator with --forward-only: l2fwd's MAC
                    rewrite and tx burst, no aggregation (the bound);
  * reference       dataplane.reference.ReferenceSwitch.process on the same frames.

Both DPDK modes run with the adaptive poll loop (the default) and with --busy-poll:
under load the back-off must cost no throughput (adaptive / busy ~ 1).

Live, on a veth pair (root), the cost of the back-off the other way round:
  * idle CPU      share of a core the switch process uses with no traffic
                  (/proc/<pid>/stat over --live-seconds), af_packet and tap ports;
  * wake-up RTT   a frame routed straight back through the switch after 20 ms of
                  silence each, adaptive vs busy (median of --probes);
  * pick-up delay ports with nothing to sleep on (pcap) back off with timed sleeps:
                  --bench-gap-us offers a burst after each 1 ms of idle and measures
                  how late the loop picks it up.

Rates are per CPU-second of the one thread doing the work (the switch's lcore, the
Python thread), so other load on a shared machine does not count; medians of --repeat
runs. Prints a table; --json PATH writes the numbers.

    python -m host.experiments.bench_dpdk [--packets 2000000] [--values 1024] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dataplane.config import MAX_VALUES, Job, Member, Route, SwitchConfig
from dataplane.dpdk_config import write_config
from dataplane.dpdk_runner import (SWITCH_BIN, LiveSwitch, af_packet_vdevs, build, eal_args,
                                   process_cpu_seconds)
from dataplane.reference import ReferenceSwitch
from host.packets import AGG_PORT_BASE, encode_data, wrap_frames

TABLE = (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 24, 27, 30)
SWITCH_MAC, SWITCH_IP = "02:00:00:00:00:fe", "10.0.0.254"


def bench_config(workers: int, pool_size: int, values_per_packet: int = 1024) -> SwitchConfig:
    """The benchmark's job; its values_per_packet must cover the generator's --bench-values
    (the switch refuses longer packets than the job says)."""
    members = tuple(Member(w, w, f"02:00:00:00:01:{w + 1:02x}", f"10.0.1.{w + 1}", 40000 + w)
                    for w in range(workers))
    return SwitchConfig(SWITCH_MAC, SWITCH_IP,
                        (Job(1, pool_size, TABLE, members, values_per_packet),)).validate()


def run_switch(config_path: Path, workers: int, packets: int, values: int,
               forward_only: bool, busy_poll: bool = False, gap_us: int = 0) -> dict:
    vdevs = [f"net_null{p}" for p in range(workers)]
    cmd = [str(SWITCH_BIN), *eal_args(vdevs), "--", "--config", str(config_path),
           "--bench", str(packets), "--bench-values", str(values)]
    if forward_only:
        cmd.append("--forward-only")
    if busy_poll:
        cmd.append("--busy-poll")
    if gap_us:
        cmd += ["--bench-gap-us", str(gap_us)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    m = re.search(r"^BENCH (\{.*\})$", res.stdout, re.M)
    if res.returncode != 0 or m is None:
        raise RuntimeError(f"thc_switch --bench failed ({res.returncode}): {res.stderr}")
    return json.loads(m.group(1))


def reference_frames(config: SwitchConfig, packets: int, values: int, rng) -> list:
    """The stream the binary's generator makes: worker k % n, slot (k // n) % pool,
    round (k // n) // pool, one random payload per worker, ToS band 0 + ECT(0)."""
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


# ---------------------------------------------------------------------------- live

HOST_MAC, HOST_IP = "02:00:00:00:0b:01", "10.77.0.1"


class VethPair:
    """A veth pair (switch end, host end) for the live measurements; removed on exit."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.switch_end, self.host_end = f"tbd{tag}s", f"tbd{tag}h"

    def __enter__(self):
        subprocess.run(["ip", "link", "add", self.switch_end, "type", "veth", "peer", "name",
                        self.host_end], check=True, capture_output=True)
        for dev in (self.switch_end, self.host_end):
            subprocess.run(["sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                           capture_output=True)
            subprocess.run(["ip", "link", "set", dev, "mtu", "9000", "up"], check=True,
                           capture_output=True)
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "link", "del", self.switch_end], capture_output=True)


def live_skip_reason() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (veth pairs)"
    return None


def echo_config() -> SwitchConfig:
    """No jobs; 10.0.0.0/8 goes back out of port 0 to the host end."""
    return SwitchConfig(SWITCH_MAC, SWITCH_IP, (), routes=(Route("10.0.0.0/8", 0, HOST_MAC),))


def idle_cpu(vdevs: list[str], busy_poll: bool, seconds: float) -> float:
    """Share of a core the switch uses with no traffic."""
    with LiveSwitch(echo_config(), vdevs, extra_args=["--busy-poll"] if busy_poll else []) as sw:
        time.sleep(0.5)
        cpu0, t0 = process_cpu_seconds(sw.proc.pid), time.monotonic()
        time.sleep(seconds)
        return (process_cpu_seconds(sw.proc.pid) - cpu0) / (time.monotonic() - t0)


def wake_rtts(veth: VethPair, busy_poll: bool, probes: int, gap_s: float) -> list[float]:
    """Round trips (us) of a frame routed straight back, each after gap_s of silence."""
    switch_mac = bytes.fromhex(SWITCH_MAC.replace(":", ""))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    sock.bind((veth.host_end, 0))
    sock.settimeout(1.0)
    rtts = []
    with sock, LiveSwitch(echo_config(), af_packet_vdevs([veth.switch_end]),
                          extra_args=["--busy-poll"] if busy_poll else []):
        time.sleep(0.3)
        for k in range(probes):
            ip = bytearray(20)
            ip[0], ip[2:4], ip[8], ip[9] = 0x45, (86).to_bytes(2, "big"), 64, 253
            ip[12:16], ip[16:20] = bytes([10, 77, 0, 1]), bytes([10, 1, 1, 1])
            frame = switch_mac + bytes.fromhex(HOST_MAC.replace(":", "")) + b"\x08\x00" + \
                bytes(ip) + k.to_bytes(4, "big") + bytes(62)
            t0 = time.perf_counter()
            sock.send(frame)
            try:
                while True:
                    back = sock.recv(16384)
                    if back[6:12] == switch_mac and back[34:38] == k.to_bytes(4, "big"):
                        rtts.append((time.perf_counter() - t0) * 1e6)
                        break
            except socket.timeout:
                pass
            time.sleep(gap_s)
    return rtts


def live_measurements(args) -> dict:
    out = {"idle_cpu": {}, "wake_rtt_us": {}}
    with VethPair() as veth:
        ports = {"af_packet": af_packet_vdevs([veth.switch_end]),
                 "tap": [f"net_tap0,iface=tbd{os.getpid() % 100000}t"]}
        for name, vdevs in tqdm(ports.items(), desc="idle CPU"):
            out["idle_cpu"][name] = {mode: idle_cpu(vdevs, mode == "busy", args.live_seconds)
                                     for mode in ("adaptive", "busy")}
        runs = {"adaptive": [], "busy": []}
        for _ in tqdm(range(2), desc="wake-up RTT"):   # interleaved against load changes
            for mode in runs:
                runs[mode] += wake_rtts(veth, mode == "busy", args.probes // 2, 0.02)
        for mode, rtts in runs.items():
            rtts.sort()
            out["wake_rtt_us"][mode] = {
                "probes": len(rtts), "median": statistics.median(rtts) if rtts else None,
                "p90": rtts[int(0.9 * len(rtts))] if rtts else None}
    return out


def pickup_delays(conf: Path, workers: int, values: int, gap_us: int) -> dict:
    """Timed back-off (no descriptor to sleep on): how late a burst offered after
    gap_us of idle is picked up, adaptive vs busy."""
    return {mode: run_switch(conf, workers, 32 * 300, values, False, mode == "busy", gap_us)
            for mode in ("adaptive", "busy")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m host.experiments.bench_dpdk",
                                 description="DPDK switch vs plain forwarder vs reference")
    ap.add_argument("--packets", type=int, default=2_000_000, help="per DPDK run")
    ap.add_argument("--ref-packets", type=int, default=4000, help="for the Python reference")
    ap.add_argument("--values", type=int, default=1024,
                    help=f"values per packet, 1..{MAX_VALUES} (the job says the same)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pool", type=int, default=256, help="slots in the job's pool")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--live-seconds", type=float, default=3.0, help="per idle-CPU measurement")
    ap.add_argument("--probes", type=int, default=100, help="wake-up round trips per mode")
    ap.add_argument("--no-live", action="store_true", help="skip the live measurements")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="bar chart of packets/s (PNG)")
    args = ap.parse_args(argv)
    if not 1 <= args.values <= MAX_VALUES:
        ap.error(f"--values {args.values}: give 1..{MAX_VALUES} (the switch's limit)")

    build()
    config = bench_config(args.workers, args.pool, args.values)
    runs = {"aggregate": [], "forward": [], "aggregate_busy": [], "forward_busy": [],
            "reference": []}
    with tempfile.TemporaryDirectory() as tmp:
        conf = write_config(config, Path(tmp) / "bench.conf")
        frames = reference_frames(config, args.ref_packets, args.values,
                                  np.random.default_rng(0))
        for _ in tqdm(range(args.repeat), desc="bench rounds"):
            # Interleaved so load changes on the shared machine hit all alike.
            for busy in (False, True):
                tag = "_busy" if busy else ""
                runs["forward" + tag].append(run_switch(conf, args.workers, args.packets,
                                                        args.values, True, busy))
                runs["aggregate" + tag].append(run_switch(conf, args.workers, args.packets,
                                                          args.values, False, busy))
            runs["reference"].append(run_reference(config, frames))
        pickup = pickup_delays(conf, args.workers, args.values, 1000)

    med = {k: statistics.median(r["packets_per_s"] for r in v) for k, v in runs.items()}
    agg_ok = all(r["results"] * args.workers == r["packets"]
                 for k in ("aggregate", "aggregate_busy") for r in runs[k])
    why_not_live = "--no-live" if args.no_live else live_skip_reason()
    live = live_measurements(args) if why_not_live is None else {"skipped": why_not_live}
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.node()}".strip(),
        "load_average": os.getloadavg(),
        "workers": args.workers, "values_per_packet": args.values, "pool": args.pool,
        "packets_per_s": med,
        "values_per_s": {k: v * args.values for k, v in med.items()},
        "aggregate_vs_forward": med["aggregate"] / med["forward"],
        "aggregate_vs_reference": med["aggregate"] / med["reference"],
        "adaptive_vs_busy": {"aggregate": med["aggregate"] / med["aggregate_busy"],
                             "forward": med["forward"] / med["forward_busy"]},
        "every_round_completed": agg_ok,
        "pickup_after_1ms_idle_us": {m: {k: r[k] for k in ("pickup_us_median", "pickup_us_p99",
                                                           "pickup_us_mean", "bursts_after_gap")}
                                     for m, r in pickup.items()},
        "live": live,
        "runs": runs,
    }
    print(f"\n{'mode':<34}{'packets/s':>14}{'values/s':>16}{'vs aggregate':>14}")
    for name, label in (("forward_busy", "dpdk plain forwarder, busy poll"),
                        ("forward", "dpdk plain forwarder, adaptive"),
                        ("aggregate_busy", "dpdk aggregate, busy poll"),
                        ("aggregate", "dpdk aggregate, adaptive"),
                        ("reference", "python reference")):
        print(f"{label:<34}{med[name]:>14,.0f}{med[name] * args.values:>16,.0f}"
              f"{med['aggregate'] / med[name]:>13.2f}x")
    print(f"aggregate / forwarder = {result['aggregate_vs_forward']:.2f} (target >= 0.5); "
          f"aggregate / reference = {result['aggregate_vs_reference']:.0f}x (target >= 20x); "
          f"all rounds completed: {agg_ok}")
    ab = result["adaptive_vs_busy"]
    print(f"adaptive / busy polling under load: aggregate {ab['aggregate']:.3f}, "
          f"forward {ab['forward']:.3f} (target >= 0.95)")
    pk = result["pickup_after_1ms_idle_us"]
    print(f"pick-up after 1 ms idle, timed back-off (pcap-like ports), median / p99 us: "
          f"adaptive {pk['adaptive']['pickup_us_median']:.0f} / {pk['adaptive']['pickup_us_p99']:.0f}, "
          f"busy {pk['busy']['pickup_us_median']:.0f} / {pk['busy']['pickup_us_p99']:.0f}")
    if "skipped" in live:
        print(f"live measurements skipped: {live['skipped']}")
    else:
        print(f"\n{'live, no traffic':<34}{'idle CPU adaptive':>20}{'busy poll':>12}")
        for name, c in live["idle_cpu"].items():
            print(f"{name + ' port':<34}{c['adaptive']:>19.1%} {c['busy']:>11.1%}")
        print("(target: adaptive <= 5% of a core)")
        w = live["wake_rtt_us"]
        print(f"wake-up RTT through af_packet after 20 ms idle, median / p90 us: "
              f"adaptive {w['adaptive']['median']:.0f} / {w['adaptive']['p90']:.0f}, "
              f"busy {w['busy']['median']:.0f} / {w['busy']['p90']:.0f}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        import matplotlib       # only --plot needs it (about a second to import)
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
