"""python -m host.experiments.testbed: build the Mininet testbed, run a command on every host, report.

Exit status 0 when every host reported success. `--json FILE` writes the per-host results
and the aggregator's counters; `--plot FILE` a bar chart of the per-host times.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from tqdm import tqdm

from host.netlab.testbed.network import (SWITCH_KINDS, TestbedError, TestbedOptions,
                                         cleanup_leftovers, run_testbed)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m host.experiments.testbed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=3, help="worker hosts (default %(default)s)")
    ap.add_argument("--switch", default="auto", choices=("auto",) + SWITCH_KINDS,
                    help="switch implementation; auto = bmv2 > dpdk > reference")
    ap.add_argument("--bw", type=float, default=100.0,
                    help="host link bandwidth in Mbit/s, 0 = unlimited (default %(default)s)")
    ap.add_argument("--delay", help="host link delay, e.g. 1ms (needs sch_netem)")
    ap.add_argument("--loss", type=float, default=0.0, help="host link loss in %% (sch_netem)")
    ap.add_argument("--values", type=int, default=4096, help="values per worker")
    ap.add_argument("--values-per-packet", type=int, default=64)
    ap.add_argument("--pool-size", type=int, default=16, help="aggregator slots of the job")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per host command")
    ap.add_argument("--command", help="run this (bash) on every host instead of the worker; "
                    "placeholders {worker} {ip} {config} {aggregator} {job} {values} {seed}")
    ap.add_argument("--workdir", help="keep config, logs and counters here")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--plot", help="save a bar chart of per-host seconds (PNG)")
    ap.add_argument("--cleanup", action="store_true",
                    help="only delete links left by a killed testbed, then exit")
    return ap.parse_args(argv)


def plot(result, path: str) -> None:
    import matplotlib       # only --plot needs it (about a second to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted(result.hosts)
    seconds = [result.hosts[n].get("seconds", 0.0) for n in names]
    fig, ax = plt.subplots(figsize=(max(4, len(names)), 3))
    ax.bar(names, seconds, color=["tab:green" if result.hosts[n].get("ok") else "tab:red"
                                  for n in names])
    ax.set_ylabel("allreduce seconds")
    ax.set_title(f"testbed ({result.switch}): green = sums checked")
    fig.tight_layout()
    fig.savefig(path)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)     # unwinds through run_testbed's finally: tear-down


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cleanup:
        removed = cleanup_leftovers()
        print(f"removed {len(removed)} links: {' '.join(removed)}")
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    opts = TestbedOptions(hosts=args.hosts, bw=args.bw, delay=args.delay, loss=args.loss,
                          switch=args.switch, values=args.values,
                          values_per_packet=args.values_per_packet, pool_size=args.pool_size,
                          seed=args.seed, timeout=args.timeout, command=args.command,
                          workdir=args.workdir)
    try:
        with tqdm(total=args.hosts, desc="hosts done", unit="host") as bar:
            result = run_testbed(opts, progress=bar)
    except TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 2
    print(f"switch: {result.switch}")
    print(f"{'host':>10} {'ok':>4} {'seconds':>8} {'retx':>5}  detail")
    for name in sorted(result.hosts):
        r = result.hosts[name]
        detail = "" if r.get("ok") else (r.get("error") or r.get("stderr", "")[-200:]
                                         or f"mismatches={r.get('mismatches')}")
        print(f"{name:>10} {str(bool(r.get('ok'))):>4} {r.get('seconds', float('nan')):8.3f} "
              f"{r.get('retransmissions', 0):5d}  {detail}")
    if result.counters:
        jobs = result.counters.get("jobs", {})
        for job, c in jobs.items():
            print(f"job {job}: " + " ".join(f"{k}={v}" for k, v in c.items() if v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"switch": result.switch, "ok": result.ok, "hosts": result.hosts,
                       "counters": result.counters}, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
