"""The testbed's default worker: one allreduce of random THC indices, checked against numpy.

    python -m host.netlab.testbed.worker --config job.json --job 1 --worker 0 \
        --aggregator 10.0.0.254:50000 --values 4096 --values-per-packet 64 --seed 7

Every worker draws the indices of ALL members from the shared seed, sends its own
through the aggregator with the library's transport (host.transport.AggregatorTransport:
slot = packet mod pool, the window and retransmission rules of docs/protocol.md §4.4),
and compares the RESULT sums with sum_w T[idx_w] computed by numpy. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from dataplane.config import SwitchConfig
from host.transport import AggregatorTransport, TransportError


def all_indices(seed: int, n_members: int, values: int) -> np.ndarray:
    """The 4-bit indices of every member (row = rank in worker-id order)."""
    return np.random.default_rng(seed).integers(0, 16, size=(n_members, values), dtype=np.uint8)


def pack(indices: np.ndarray) -> np.ndarray:
    """Two indices per byte, the even one in the high nibble (protocol.md §2.2)."""
    padded = np.zeros(len(indices) + len(indices) % 2, dtype=np.uint8)
    padded[:len(indices)] = indices
    return (padded[0::2] << 4) | padded[1::2]


def expected_sums(table, indices: np.ndarray) -> np.ndarray:
    return (np.asarray(table, dtype=np.int64)[indices].sum(axis=0) % 256).astype(np.uint8)


def run_worker(config: SwitchConfig, job_id: int, worker: int, aggregator: tuple[str, int],
               values: int, values_per_packet: int, seed: int, timeout: float) -> dict:
    job = config.job(job_id)
    members = sorted(job.members, key=lambda m: m.worker)
    rank = [m.worker for m in members].index(worker)
    me = members[rank]
    indices = all_indices(seed, len(members), values)
    n_pkts = -(-values // values_per_packet)
    report = {"worker": worker, "ok": False, "values": values, "packets": n_pkts,
              "received": 0, "mismatches": values}
    start = time.monotonic()
    # a straggler notice gives its chunk up (count 0): reported as not ok, not raised
    with AggregatorTransport(aggregator, job=job_id, worker=worker, expected=job.expected_all,
                             pool_size=job.pool_size, values_per_packet=values_per_packet,
                             timeout=timeout, local=(me.ip, me.udp_port),
                             on_straggler="skip") as transport:
        try:
            result = transport.allreduce(pack(indices[rank]), values, seed & 0xFFFFFFFF)
        except TransportError as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
            result = None
        stats = transport.stats
    report.update(seconds=round(time.monotonic() - start, 4),
                  retransmissions=stats.retransmissions, stragglers=stats.straggler_notices,
                  results=stats.results_accepted)
    if result is not None:
        got = result.counts > 0
        mismatches = int(np.count_nonzero(result.sums != expected_sums(job.table, indices)))
        report.update(received=int(got.sum()), mismatches=mismatches if got.all() else values,
                      ok=bool(got.all() and mismatches == 0
                              and (result.counts == len(members)).all()))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m host.netlab.testbed.worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--aggregator", required=True, help="IP:PORT of the aggregator")
    ap.add_argument("--values", type=int, default=4096)
    ap.add_argument("--values-per-packet", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    host, port = args.aggregator.rsplit(":", 1)
    result = run_worker(SwitchConfig.load(args.config), args.job, args.worker, (host, int(port)),
                        args.values, args.values_per_packet, args.seed, args.timeout)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
