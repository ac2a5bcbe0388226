"""Phase-1 / phase-2 partial aggregation through the in-network aggregator (AdapCC Sec. IV-C).

The coordinator picks the ready set R.  With N workers of one job:

* Phase 1: the ready workers send their THC indices with ``expected = R`` (the expected-set
  completion rule of docs/protocol.md §4.3): the aggregator completes each chunk once all of R
  contributed and multicasts the RESULT to every member.  The late workers act as relays: they
  add nothing, but their socket receives the phase-1 RESULT, which they collect (listen only)
  when they become ready.
* Phase 2: every worker sends with ``expected = all``; the late workers send their indices, the
  ready ones send index 0 on every lane (table[0] = 0, so they add nothing).  The RESULT holds
  the late workers' lane sums.
* Every worker adds the two lane sums and the two counts: the result equals the full sum over
  all N workers (THC sums are additive; n * g <= 255 keeps the 8-bit lanes exact).

Slot rounds stay identical on every worker: a worker that skips a phase advances its slots'
round counters by the same uses as the workers that ran it.

Faults: once the coordinator declares workers faulty (``faulty_workers``), the survivors call
with ``all_workers`` = the survivors; with nobody late that is a single expected-set round.
"""
from __future__ import annotations

import select
import time
from dataclasses import dataclass

import numpy as np

from host.packets import decode_headers, header_types, scatter_payloads
from host.packets.constants import TYPE_RESULT
from host.transport import AggregatorTimeout, AggregatorTransport, AllreduceResult


@dataclass
class TwoPhaseResult:
    sums: np.ndarray          # uint8 lane sums over all workers
    counts: np.ndarray        # contributors per chunk (N when complete)
    phase1: AllreduceResult
    phase2: AllreduceResult | None     # None when nobody was late


def _chunk_plan(transport: AggregatorTransport, num_values: int):
    n_chunks = -(-num_values // transport.vpp)
    chunks = np.arange(n_chunks)
    slots = chunks % transport.pool_size
    rounds = transport.slot_rounds[slots] + chunks // transport.pool_size
    uses = np.bincount(slots, minlength=transport.pool_size)
    return n_chunks, slots, rounds, uses


def bitmap(workers) -> int:
    out = 0
    for w in workers:
        out |= 1 << int(w)
    return out


def collect_relay_results(transport: AggregatorTransport, num_values: int, tensor: int,
                          timeout: float = 10.0) -> AllreduceResult:
    """Listen-only receive of a round this member did not contribute to (a relay).

    Reads the RESULT multicast of every chunk of ``tensor`` from the transport's socket and then
    advances the slot rounds exactly as the contributing workers' transports did.
    """
    n_chunks, slots, rounds, uses = _chunk_plan(transport, num_values)
    vpp = transport.vpp
    sums = np.zeros(num_values, np.uint8)
    done = np.zeros(n_chunks, bool)
    counts = np.zeros(n_chunks, np.int64)
    contributors = np.zeros(n_chunks, np.uint32)
    buf = np.zeros((1, 32 + 1024), np.uint8)
    view = memoryview(buf[0])
    deadline = time.monotonic() + timeout
    while not done.all():
        wait = deadline - time.monotonic()
        if wait <= 0:
            missing = np.flatnonzero(~done)[:8].tolist()
            raise AggregatorTimeout(
                f"relay of job {transport.job}: no phase-1 RESULT for chunks {missing} of tensor "
                f"{tensor} within {timeout}s; was this worker a member when phase 1 completed?")
        if not select.select([transport.sock], [], [], wait)[0]:
            continue
        try:
            length = transport.sock.recv_into(view)
        except BlockingIOError:
            continue
        if length < 32:
            continue
        hdr = decode_headers(buf, [length])
        h = hdr[0]
        if (header_types(hdr)[0] != TYPE_RESULT or h["job"] != transport.job
                or h["tensor"] != tensor or h["offset"] % vpp):
            continue
        chunk = int(h["offset"]) // vpp
        if chunk >= n_chunks or done[chunk] or h["round"] != rounds[chunk] \
                or h["slot"] != slots[chunk]:
            continue
        scatter_payloads(buf, [length], hdr, sums)
        done[chunk] = True
        counts[chunk] = h["count"]
        contributors[chunk] = h["contributors"]
    transport.slot_rounds += uses
    return AllreduceResult(sums, counts, contributors, vpp)


def two_phase_allreduce(transport: AggregatorTransport, packed: np.ndarray, num_values: int,
                        ready: set[int], all_workers: set[int], tensor_pair: tuple[int, int],
                        relay_timeout: float = 10.0) -> TwoPhaseResult:
    """Run both phases on this worker (call on every worker, ready ones first in practice)."""
    ready, all_workers = set(ready), set(all_workers)
    if not ready or not ready <= all_workers or transport.worker not in all_workers:
        raise ValueError(f"ready set {sorted(ready)} must be a non-empty subset of the job's "
                         f"workers {sorted(all_workers)}, which must include this worker")
    t1, t2 = tensor_pair
    late = all_workers - ready
    if not late:
        # everyone (e.g. all survivors after a fault) is ready: one expected-set round
        saved = transport.expected
        try:
            transport.expected = bitmap(ready)
            phase1 = transport.allreduce(packed, num_values, t1)
        finally:
            transport.expected = saved
        return TwoPhaseResult(phase1.sums.copy(), phase1.counts.copy(), phase1, None)
    saved = transport.expected
    try:
        if transport.worker in ready:
            transport.expected = bitmap(ready)
            phase1 = transport.allreduce(packed, num_values, t1)
            contribution = np.zeros_like(packed)          # index 0 -> table[0] = 0
        else:
            phase1 = collect_relay_results(transport, num_values, t1, relay_timeout)
            contribution = packed
        transport.expected = bitmap(all_workers)
        phase2 = transport.allreduce(contribution, num_values, t2)
    finally:
        transport.expected = saved
    sums = phase1.sums.astype(np.int64) + phase2.sums.astype(np.int64)
    if sums.max(initial=0) > 255:
        raise OverflowError("lane sums exceed 8 bits; the job set-up should have refused n*g > 255")
    # phase-2 RESULTs count every sender; the ready workers' zero lanes add no contribution
    counts = phase1.counts + phase2.counts - len(ready)
    if np.any(counts != len(all_workers)):
        raise RuntimeError(f"two-phase counts {counts.tolist()} != {len(all_workers)} workers")
    return TwoPhaseResult(sums.astype(np.uint8), counts, phase1, phase2)
