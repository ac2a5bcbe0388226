"""The testbed's default worker: one allreduce of random THC indices, checked against numpy.

    python -m host.experiments.testbed.worker --config job.json --job 1 --worker 0 \
        --aggregator 10.0.0.254:50000 --values 4096 --values-per-packet 64 --seed 7

Every worker draws the indices of ALL members from the shared seed, sends its own
through the aggregator (host.packets codec, slot = packet mod pool, round = packet //
pool, the window rule of protocol.md §4.4), retransmits what stays unanswered, and
compares the RESULT sums with sum_w T[idx_w] computed by numpy. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time

import numpy as np

from dataplane.config import SwitchConfig
from host.packets import (FLAG_RETX, HEADER_LEN, TYPE_RESULT, TYPE_STRAGGLER, decode_headers,
                          encode_data)

RTO_S = 0.2                    # resend what is unanswered after this long


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
    packet_ids = np.arange(n_pkts)
    bufs, lengths = encode_data(pack(indices[rank]), values, values_per_packet, job=job_id,
                                worker=worker, tensor=seed & 0xFFFFFFFF,
                                slots=packet_ids % job.pool_size,
                                rounds=packet_ids // job.pool_size, expected=job.expected_all)
    sums = np.zeros(values, dtype=np.uint8)
    counts = np.zeros(n_pkts, dtype=np.int64)
    got = np.zeros(n_pkts, dtype=bool)
    stats = {"retransmissions": 0, "stragglers": 0, "results": 0}

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((me.ip, me.udp_port))
    start = time.monotonic()
    next_to_send, in_flight, last_progress = 0, {}, start

    def send(k: int, retx: bool = False) -> None:
        row = bufs[k, :lengths[k]].copy()
        if retx:
            row[1] |= FLAG_RETX
        sock.sendto(row.tobytes(), aggregator)
        in_flight[k] = time.monotonic()

    try:
        # the window: one packet per slot in flight (protocol.md §4.4)
        while next_to_send < min(job.pool_size, n_pkts):
            send(next_to_send)
            next_to_send += 1
        while not got.all():
            now = time.monotonic()
            if now - start > timeout:
                break
            ready, _, _ = select.select([sock], [], [], 0.02)
            if ready:
                data = sock.recv(65535)
                if len(data) < HEADER_LEN:
                    continue
                h = decode_headers([data])[0]
                ptype = h["ver_type"] & 0x0F
                if ptype == TYPE_STRAGGLER:
                    stats["stragglers"] += 1
                    continue
                if ptype != TYPE_RESULT or h["job"] != job_id:
                    continue
                k = int(h["offset"]) // values_per_packet
                if not 0 <= k < n_pkts or got[k]:
                    continue
                nv = int(h["num_values"])
                sums[k * values_per_packet:k * values_per_packet + nv] = np.frombuffer(
                    data, dtype=np.uint8, count=nv, offset=HEADER_LEN)
                counts[k] = h["count"]
                got[k] = True
                stats["results"] += 1
                in_flight.pop(k, None)
                last_progress = time.monotonic()
                if next_to_send < n_pkts:       # slot k % pool is free again
                    send(next_to_send)
                    next_to_send += 1
            for k, sent_at in list(in_flight.items()):
                if time.monotonic() - sent_at > RTO_S:
                    send(k, retx=True)
                    stats["retransmissions"] += 1
    finally:
        sock.close()
    seconds = time.monotonic() - start
    want = expected_sums(job.table, indices)
    mismatches = int(np.count_nonzero(sums != want)) if got.all() else values
    ok = bool(got.all() and mismatches == 0 and (counts == len(members)).all())
    return {"worker": worker, "ok": ok, "values": values, "packets": n_pkts,
            "received": int(got.sum()), "mismatches": mismatches, "seconds": round(seconds, 4),
            "idle_s": round(time.monotonic() - last_progress, 4), **stats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m host.experiments.testbed.worker", description=__doc__,
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
