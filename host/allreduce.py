"""THC allreduce: the mean of one gradient tensor over all workers, THC-compressed.

One call, for each pipeline chunk k of the tensor:

  x_k = RHT(grad_k) + e_k, norms_k             error feedback in the rotated domain, fused
                                               into the RHT, which also gives the norms
  control exchange (all_reduce MAX, 2W+4 floats, with chunk 0's norms) sizes agree? any
                                               NaN/Inf? -> clear error on every worker at
                                               once, before anything is sent, never a hang
  norms_k: all_reduce MAX, one per group of chunks (chunks 1, 2-3, 4-7, ...: a group
                                               as long as the chunks before it, where the
                                               chunks rotate in place; else one per chunk),
                                               overlapped with the quantization before it
  packed_k = quantize(x_k, max norms_k),       4-bit indices, counter-based RNG; the new
  e_k = x_k - own quantized values_k           error in the same pass (no inverse RHT)
  sums_k, counts_k = exchange(packed_k)        integer sums of table values
  mean_k = decode(sums_k, counts_k, norms_k)   m + (Y/count)(M-m)/g, inverse RHT, written
                                               straight into the output

error_domain="gradient" keeps the paper's order instead: x_k = grad_k + e_k, its norms
exchanged while the RHT runs, and e_k = x_k - RHT^-1(own quantized values) after the
decode (a second inverse RHT and two more passes per call; docs/perf.md measures both).

Pipelining: a large tensor is cut into chunks of whole RHT partitions (`pipeline_values`
padded values, a multiple of the partition size and of the packet size); chunk k+1 is
compensated, normed, rotated and quantized while chunk k is on the wire, and chunk k-1
is decoded as soon as its sums are in. Chunk k is coded as a vector of its own (the
tensor's partitions, its own rounding key); a tensor of one chunk is coded exactly as
before. A chunk rotated after the control exchange goes into its own slice of the
error-feedback buffer (on the CPU, where nothing needs the rotated values after
quantization, which overwrites them with the new error in the same pass), so peak memory
is the output and chunk 0's rotation, not several copies of the tensor.

The max-norm exchanges run between the workers, not through the aggregator: a few floats
per partition, they need MAX (the aggregator only adds small integers). On the CPU they go
over direct TCP connections among the process group's workers (host.control_channel),
else over the group itself (gloo or NCCL).

Two exchanges for the integer sums:
* `AggregatorExchange`: the in-network path, packed indices to the aggregator over UDP
  (host.transport, streamed chunk by chunk), 4 bits up and 8 bits down per value;
* `SumAllreduceExchange`: any cluster without a switch. Each worker looks its indices up in
  the table (uint8 values 0..g) and runs torch.distributed.all_reduce(SUM) on those integer
  lanes (asynchronously, one per chunk). THC is homomorphic, so the integer sum decodes to
  exactly the mean the aggregator would give. Lanes are uint8 when n*g <= 255, else int32:
  the integer types both gloo and NCCL reduce (gloo has no int16 all_reduce).

Asynchronous use: `THCAllreduce.submit` returns a torch.futures.Future and runs the call
on the process's exchange thread (`exchange_thread()`): one thread, calls in submission
order, so the buckets of a DDP step complete in order while backward goes on. An error
in the thread reaches whoever waits on the future, as the same exception; an error that
every worker raised together (sizes, dtype, NaN) leaves the state usable, any other
(a dead worker, a timeout) makes later calls fail at once instead of hanging. A worker
that died is named (WorkerLostError, after a roll call through the process group's
store); an aggregator that stops answering is, by default, no error: the call is redone
over the collective and later calls stay there until it answers again (THCAllreduce
`fallback`).
"""
from __future__ import annotations

import collections
import atexit
import datetime
import math
import os
import queue
import sys
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

import thc
from host.control_channel import ControlChannel, ControlWork
from host.transport import AggregatorTimeout, AggregatorUnreachable, default_policy
from thc.layout import Layout

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEFAULT_PIPELINE_VALUES = 1 << 20      # padded values per pipeline chunk (4 MB of floats)
CHUNK_KEY_STRIDE = 1 << 32             # rounding key of chunk k > 0: tensor key + k * stride
CALL_HISTORY = 100_000                 # call times kept (THCAllreduce.call_seconds)
FALLBACKS = ("collective", "raise")    # THCAllreduce(fallback=): when the aggregator is silent
DEFAULT_PROBE_INTERVAL = 10.0          # seconds between probes of a silent aggregator
HEARTBEAT_INTERVAL = 1.0               # seconds between a worker's liveness beats
ROLL_CALL_BEATS = 3                    # beats a worker may miss before a roll call names it
# An aggregator exchange that failed for these reasons failed because the aggregator did
# not answer (a dead worker also shows as AggregatorTimeout: the roll call tells them apart).
AGGREGATOR_SILENT = (AggregatorTimeout, AggregatorUnreachable)
STATE_FORMAT = 1                       # version of THCAllreduce.state_dict()
THCALLREDUCE_STATE_ENTRIES = frozenset(
    {"format", "config", "world", "rank", "calls", "verified_sizes", "error_feedback"})


class AllreduceError(RuntimeError):
    """Workers disagree about a call (sizes), or a worker reported a bad gradient."""


class WorkerLostError(AllreduceError):
    """A call failed and some workers did not answer the roll call: `workers` (global
    ranks) exited, were killed or hang."""

    def __init__(self, message: str, workers: list[int]):
        super().__init__(message)
        self.workers = workers


class SizeMismatchError(AllreduceError):
    pass


class RescueWaitWarning(UserWarning):
    """A worker that lacks sums of its last call has waited long for the others' next THC
    call (THCAllreduce._rescue_exchange): the message names the likely cause and the fix."""


RESCUE_WARN_S = 10.0


# --------------------------------------------------------------------------- exchange thread

class ExchangeThread:
    """One thread per process that runs submitted calls one at a time, in order.

    submit(fn, *args) -> torch.futures.Future completed with fn's result, or its exception.
    Started on first use (and again in a forked child, which does not inherit it), with
    the Numba thread count of the thread that started it (Numba's setting is per thread:
    a worker that limits itself with numba.set_num_threads keeps that limit here).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._queue = None
        self._pid = None
        self._thread = None

    def submit(self, fn, *args) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self._lock:
            if self._pid != os.getpid():
                self._queue = queue.SimpleQueue()
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run,
                                                args=(self._queue, _numba_threads()),
                                                name="thc-exchange", daemon=True)
                self._thread.start()
            self._queue.put((fut, fn, args))
        return fut

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = 30.0) -> bool:
        """End the thread once the calls already submitted ran, and wait for it (a later
        submit starts a new one); False if it is still running after `timeout` seconds.
        A daemon thread still alive at interpreter exit is ended by the interpreter inside
        whatever it runs, which aborts the process when that is torch's C++ code
        (THCHookState.close)."""
        with self._lock:
            thread, jobs = self._thread, self._queue
            if thread is None or self._pid != os.getpid():
                return True
            self._thread = self._queue = self._pid = None
            jobs.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)
        return not thread.is_alive()

    @staticmethod
    def _run(jobs: queue.SimpleQueue, numba_threads: int | None) -> None:
        if numba_threads:
            import numba    # loaded already (see _numba_threads); host.allreduce never loads it
            numba.set_num_threads(numba_threads)
        while True:
            job = jobs.get()
            if job is None:                   # stop()
                return
            fut, fn, args = job
            try:
                result = fn(*args)
            except BaseException as exc:      # the waiter gets it, the thread goes on
                fut.set_exception(exc)
            else:
                fut.set_result(result)


def _numba_threads() -> int | None:
    """Codec threads of the exchange thread (None: Numba not loaded, nothing to set)."""
    if "numba" not in sys.modules:
        return None
    return codec_threads(sys.modules["numba"].get_num_threads())


def codec_threads(available: int) -> int:
    """How many of `available` Numba threads a worker's codec uses: its share of the
    machine's cores (torchrun's LOCAL_WORLD_SIZE workers share them), at least 1. More
    would not make the memory-bound codec faster. Where libgomp spins (its default wait
    policy: each idle codec thread busy-waits after every parallel region), one core of the
    share is left to the worker's other threads, the training thread and the datagram
    path's I/O thread: on 2 cores a lone worker's 16 MB call took 117 ms of CPU and 134 ms
    of wall time with 2 spinning codec threads, 66 and 114 ms with one (docs/perf.md,
    "One worker's CPU"). With OMP_WAIT_POLICY=passive in the environment the whole share
    is used."""
    local_workers = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    share = max(1, (os.cpu_count() or 1) // local_workers)
    if share > 1 and os.environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive":
        share -= 1
    return max(1, min(available, share))


_EXCHANGE_THREAD = ExchangeThread()


def exchange_thread() -> ExchangeThread:
    """The process's exchange thread (shared by every THCAllreduce)."""
    return _EXCHANGE_THREAD


class _Heartbeat:
    """A thread that counts this worker's key (its global rank) up in the default process
    group's store every HEARTBEAT_INTERVAL seconds, whatever the exchange thread is doing;
    THCAllreduce's roll call reads the counts. One per process, started by the first
    THCAllreduce.start (again in a forked child), stopped at interpreter exit."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid = None
        self._stop = threading.Event()
        self._thread = None
        self.store = None

    def start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            try:
                # The default group's store (private API, no public accessor): every worker
                # of the job reaches it, whichever worker died.
                store = dist.distributed_c10d._get_default_store()
            except (AttributeError, RuntimeError, ValueError):
                return
            self._pid, self.store = os.getpid(), dist.PrefixStore("thc-heartbeat/", store)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._beat, name="thc-heartbeat",
                                            args=(self.store, str(dist.get_rank()), self._stop),
                                            daemon=True)
            self._thread.start()

    @staticmethod
    def _beat(store, key: str, stop: threading.Event) -> None:
        while True:
            try:
                store.add(key, 1)
            except (RuntimeError, OSError):
                return                  # the store has gone: the job is ending
            if stop.wait(HEARTBEAT_INTERVAL):
                return

    def stop(self) -> None:
        """End the thread (a daemon thread inside torch's store code at interpreter exit
        could abort the process)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
            self._pid = None
        if thread is not None and thread is not threading.current_thread():
            thread.join(2 * HEARTBEAT_INTERVAL)


_HEARTBEAT = _Heartbeat()
atexit.register(_HEARTBEAT.stop)


def _silent_ranks(store, ranks: list[int]) -> list[int]:
    """The ranks whose heartbeat count did not move for ROLL_CALL_BEATS beats (polled, so
    an all-alive answer takes about one beat)."""
    first = {r: store.add(str(r), 0) for r in ranks}
    silent = list(ranks)
    deadline = time.monotonic() + ROLL_CALL_BEATS * HEARTBEAT_INTERVAL
    while silent and time.monotonic() < deadline:
        time.sleep(HEARTBEAT_INTERVAL / 10)
        silent = [r for r in silent if store.add(str(r), 0) == first[r]]
    return silent


# --------------------------------------------------------------------------- exchanges

def _check_full_results(transport) -> None:
    """Bounded loss counts a chunk as back only with every member's contribution in it.
    With partial aggregation (min_count k below the members) every result completes at k
    contributors, so every chunk would be decoded as lost: refused at set-up."""
    members = bin(transport.expected).count("1")
    if transport.min_count not in (0, members):
        raise ValueError(
            f"loss_bound > 0 with partial aggregation (the transport's min_count "
            f"{transport.min_count} of {members} members): every result would complete "
            f"with {transport.min_count} contributors and count as lost. Use loss_bound=0 "
            "(partial aggregation already bounds the wait for stragglers), or min_count=0")


class AggregatorExchange:
    """Integer sums through an in-network aggregator (host.transport.AggregatorTransport)."""

    name = "aggregator"

    def __init__(self, transport, codec):
        self.transport = transport
        self.codec = codec

    @property
    def values_per_packet(self) -> int:
        return self.transport.vpp

    def start(self, group, timeout: float) -> None:
        """Flush the job's slots, then wait for every worker (no flush after a contribution)."""
        self.transport.flush()
        _barrier(group, "waiting for every worker to flush the aggregator slots", timeout)

    def open(self, padded: int, tensor: int, *, layer=0, num_layers=1,
             background=False) -> "_AggregatorStream":
        """A tensor's stream; background: an I/O thread keeps its window full while this
        thread quantizes the next chunk (host.transport.TensorStream)."""
        return _AggregatorStream(self, self.transport.open_stream(
            padded, tensor, layer=layer, num_layers=num_layers, background=background))

    def sum(self, packed, padded: int, tensor: int, *, rotated=None, layer=0, num_layers=1):
        """The sums and counts of one whole tensor (one submission)."""
        stream = self.open(padded, tensor, layer=layer, num_layers=num_layers)
        stream.submit(0, padded, packed, rotated)
        result = stream.result(0, padded)
        stream.finish()
        return result

    @property
    def bytes_sent(self) -> int:
        return self.transport.stats.bytes_sent

    def close(self) -> None:
        self.transport.close()


class _AggregatorStream:
    """One tensor through the aggregator, submitted and read back range by range."""

    def __init__(self, exchange: AggregatorExchange, stream):
        self.exchange, self.stream = exchange, stream
        self.packed = {}                 # lo -> this worker's packed range (for give-ups)
        self.first_tos = []              # the ToS each chunk was first sent with
        # The rotated values only matter to a DLCP policy; skip the copy (GPU -> host) else.
        self.wants_values = exchange.transport.policy is not default_policy
        # ... and one that marks by partition norms does not read them either.
        self.reads_rotated = self.wants_values and not getattr(
            exchange.transport.policy, "marks_partitions", False)

    def submit(self, lo: int, hi: int, packed, rotated, max_norms=None,
               send: bool = True) -> None:
        """Padded values [lo, hi) of the tensor; max_norms: the agreed L2 norms of their
        RHT partitions (what a DLCP policy ranks, see host.dlcp.marking). send=False: the
        caller waits for sums next, and that wait sends them (one round less)."""
        packed_np = _to_numpy(packed)
        self.packed[lo] = packed_np
        policy = self.exchange.transport.policy
        marks = {}
        if max_norms is not None and getattr(policy, "marks_partitions", False):
            # The norms decide importance; the rotated values are not needed (no copy).
            layout = Layout.from_padded(hi - lo, self.exchange.codec.partition_size)
            marks = {"partition_norms": _to_numpy(max_norms),
                     "partition_sizes": layout.sizes()}
            rotated = None
        values = _to_numpy(rotated) if rotated is not None and self.wants_values else None
        self.stream.submit(packed_np, hi - lo, values=values, send=send, **marks)
        vpp = self.exchange.transport.vpp
        self.first_tos.append(self.stream.packets.tos[lo // vpp: -(-hi // vpp)].copy())

    @property
    def n_chunks(self) -> int:
        """The tensor's chunks (packets per worker), as the transport cut it."""
        return self.stream.ex.n_chunks

    def pump(self) -> None:
        self.stream.pump()

    def ready(self, hi: int) -> bool:
        return self.stream.values_done() >= hi

    def settle(self, loss_bound: float, wait_rto: float = 2.0) -> np.ndarray:
        """Bounded loss: wait until at least (1 - loss_bound) of the tensor's chunks came
        back with the full contributor set, then give the missing ones wait_rto
        retransmission timeouts (0: none, DLCP's immediate finish); give up what is
        still missing. The overdue ones (past their retransmission deadline: likely lost)
        are re-requested at once (a retransmitted DATA is re-served when its round
        completed, protocol.md §4.2); the others are only late and keep their timers: re-
        sending them all loaded the bottleneck queue at every tensor's end, and made DLCP's
        calls slower than exact ones (docs/dlcp.md, "A window that fits the queue").

        Returns this worker's missing chunks (bool per chunk): not back, or back with
        fewer contributors than the job has. The deadline is noticed at the exchange
        loop's next wake-up (an arrival or a retransmission timer)."""
        stream, transport = self.stream, self.exchange.transport
        ex = stream.ex
        members = bin(transport.expected).count("1")
        need = math.ceil((1.0 - loss_bound) * ex.n_chunks)
        # Every result comes with the full contributor set (_check_full_results), so `need`
        # done chunks is the rule: the wait and its grace period in one call (in C on the
        # native path, with no hand-off to this thread between them).
        stream.wait_grace(need, wait_rto)
        stream.give_up_rest()
        return ~(ex.done & (ex.counts == members))

    def result(self, lo: int, hi: int, missing=None):
        """(sums, counts) of padded values [lo, hi), waiting for them. missing: the
        chunks every worker agreed to treat as lost (bool per chunk of the tensor): their
        count is 0, which the codec decodes to 0 in the rotated domain."""
        self.stream.wait_values(hi)
        if missing is not None:
            self.packed.pop(lo, None)
            vpp = self.exchange.transport.vpp
            c0 = lo // vpp
            lost_chunks = np.asarray(missing, bool)[c0: -(-hi // vpp)]
            counts = self.stream.counts(lo, hi)
            if not lost_chunks.any():
                return self.stream.sums[lo:hi], counts
            lost = np.repeat(lost_chunks, vpp)[lo - c0 * vpp: hi - c0 * vpp]
            per_value = np.broadcast_to(np.asarray(counts), (hi - lo,))
            return self.stream.sums[lo:hi], np.where(lost, 0, per_value)
        sums, counts = self.stream.sums[lo:hi], self.stream.counts(lo, hi)
        if not np.isscalar(counts) and (np.asarray(counts) == 0).any():
            # Chunks given up after a straggler notice: use this worker's own values there.
            own = np.asarray(self.exchange.codec.lookup(self.packed[lo]))
            missing = np.asarray(counts) == 0
            sums = sums.copy()
            sums[missing] = own[missing]
            counts = np.where(missing, 1, counts)
        self.packed.pop(lo, None)
        return sums, counts

    def finish(self) -> None:
        self.stream.finish()

    def close(self) -> None:
        self.stream.close()


class _GuardedStream:
    """An aggregator stream whose failure to get answers (AGGREGATOR_SILENT) is kept in
    `down` instead of raised; from then on every operation does nothing and `result` and
    `settle` return None. The call goes on with its norm exchanges and quantization on
    every worker alike, so that the workers can agree and redo it over the collective
    (THCAllreduce fallback="collective")."""

    def __init__(self, stream: _AggregatorStream):
        self.stream = stream
        self.down: BaseException | None = None

    def _guard(self, operation, *args):
        if self.down is not None:
            return None
        try:
            return operation(*args)
        except AGGREGATOR_SILENT as exc:
            self.down = exc
            self.stream.close()
            return None

    @property
    def first_tos(self) -> list:
        return self.stream.first_tos

    @property
    def reads_rotated(self) -> bool:
        return self.stream.reads_rotated

    @property
    def n_chunks(self) -> int:
        return self.stream.n_chunks

    def submit(self, lo: int, hi: int, packed, rotated, max_norms=None,
               send: bool = True) -> None:
        self._guard(self.stream.submit, lo, hi, packed, rotated, max_norms, send)

    def pump(self) -> None:
        self._guard(self.stream.pump)

    def ready(self, hi: int) -> bool:
        return self.down is None and self.stream.ready(hi)

    def settle(self, loss_bound: float, wait_rto: float = 2.0):
        return self._guard(self.stream.settle, loss_bound, wait_rto)

    def result(self, lo: int, hi: int, missing=None):
        return self._guard(self.stream.result, lo, hi, missing)

    def finish(self) -> None:
        self._guard(self.stream.finish)

    def close(self) -> None:
        self.stream.close()


class SumAllreduceExchange:
    """Integer sums with torch.distributed.all_reduce(SUM) on table-value lanes."""

    name = "sum-allreduce"
    values_per_packet = 1

    def __init__(self, codec, group=None):
        self.codec = codec
        self.group = group
        world = dist.get_world_size(group)
        g = int(np.max(codec.table))
        top = world * g
        # 8-bit lanes like the switch when they fit, else int32: gloo and NCCL both reduce
        # uint8 and int32 (gloo has no int16 all_reduce), so any worker count works here.
        self.lane_dtype = torch.uint8 if top <= 255 else torch.int32
        self.world = world
        self.bytes_sent = 0

    def start(self, group, timeout: float) -> None:
        _barrier(group, "waiting for every worker to join the THC allreduce", timeout)

    def open(self, padded: int, tensor: int, *, layer=0, num_layers=1,
             background=False) -> "_SumStream":
        return _SumStream(self)

    def sum(self, packed, padded: int, tensor: int, *, rotated=None, layer=0, num_layers=1):
        stream = self.open(padded, tensor)
        stream.submit(0, padded, packed, rotated)
        return stream.result(0, padded)


class _SumStream:
    """Each submitted range is one asynchronous all_reduce(SUM) of its lanes."""

    def __init__(self, exchange: SumAllreduceExchange):
        self.exchange = exchange
        self.pending = {}                # lo -> (hi, lanes, work)

    def submit(self, lo: int, hi: int, packed, rotated, max_norms=None,
               send: bool = True) -> None:
        ex = self.exchange
        lanes = torch.as_tensor(ex.codec.lookup(packed)).to(ex.lane_dtype)
        if isinstance(packed, torch.Tensor):
            lanes = lanes.to(packed.device)
        work = dist.all_reduce(lanes, op=dist.ReduceOp.SUM, group=ex.group, async_op=True)
        self.pending[lo] = (hi, lanes, work)
        # A ring allreduce sends 2(n-1)/n of the buffer per worker.
        ex.bytes_sent += int(2 * (ex.world - 1) / ex.world * lanes.numel()
                             * lanes.element_size())

    def pump(self) -> None:
        pass                             # gloo/NCCL progress on their own threads

    def ready(self, hi: int) -> bool:
        return all(work.is_completed() for h, _, work in self.pending.values() if h <= hi)

    def result(self, lo: int, hi: int):
        _, lanes, work = self.pending.pop(lo)
        work.wait()
        return lanes, self.exchange.world

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self.pending.clear()             # after an error: the works keep their own buffers


# --------------------------------------------------------------------------- allreduce

class THCAllreduce:
    """Mean of a tensor over the process group with THC compression.

    codec: thc.THCCodec shared (same seed/config) by every worker; exchange: an
    AggregatorExchange or SumAllreduceExchange; group: the torch process group of the
    control and norm exchanges (None: a group of its own over every rank, made at the
    first call, so the exchange thread's collectives never interleave with the training
    thread's); pipeline_values: padded values per pipeline chunk (rounded up to whole
    partitions and packets; 0: the whole tensor at once); error_domain: "rotated" (error
    feedback kept after the RHT: one inverse RHT per call) or "gradient" (the paper's).
    Every worker must use the same codec, pipeline_values and error_domain (the control
    exchange checks pipeline_values). nonfinite: "raise" (a NaN/Inf gradient on any worker
    raises thc.NonFiniteError on every worker) or "propagate" (every worker's mean of that
    call is all inf instead, nothing is sent and no error feedback changes, so that a
    torch.amp.GradScaler skips the step on every worker alike).

    fallback (the aggregator path): "collective" (default) or "raise". When the aggregator
    does not answer a call (AggregatorTimeout after the transport's no-progress timeout, or
    AggregatorUnreachable at once) on any worker, every worker learns it in one MAX exchange
    at the end of the call and, with "collective", redoes the call's integer sums over the
    process group (SumAllreduceExchange) from the very indices it sent, so the mean and the
    error feedback are the ones the aggregator would have given; it warns once and stays on
    the collective. On THC's own process group (group=None) that exchange costs nothing
    while every worker gets all its sums: a worker that got them returns at once, and one
    that lacks some (the aggregator stopped answering it, or bounded loss gave chunks up)
    asks the others in their next control exchange (or in close(), which every worker
    calls), the first collective each of them makes after the call (_rescue_exchange).
    Until then `on_collective` of the workers that got their sums still says where that
    call went. A collective on another group between two calls would wait for the worker
    that lacks sums while it waits for the others: DDP's bucket rebuild after its first
    step is one, so the DDP hook ends a process's first DDP step with the agreement
    (submit's agree_at_end). DDP's buffer broadcast before each forward (a model with
    buffers, e.g. BatchNorm, and broadcast_buffers=True) is another, as is any collective
    of the training loop's own between THC calls: there set defer_end_agreement = False,
    which puts the agreement back at the end of every call (host.fsdp does: its own
    max-norm exchange shares the group). Every
    probe_interval seconds (any worker's clock, agreed in the control exchange) each
    worker probes the aggregator at the next call
    (AggregatorTransport.probe); when every probe is answered, all go back to it at that
    call, after a FLUSH of the job's slots. "raise": the call raises, as without fallback.
    A worker that dies is told apart by a roll call (`WorkerLostError` names it).
    """

    def __init__(self, codec, exchange, *, group=None, error_feedback: bool = True,
                 start_timeout: float = 60.0, pipeline_values: int = DEFAULT_PIPELINE_VALUES,
                 error_domain: str = "rotated", loss_bound: float = 0.0,
                 loss_wait: float = 2.0, nonfinite: str = "raise",
                 fallback: str = "collective",
                 probe_interval: float = DEFAULT_PROBE_INTERVAL):
        if not dist.is_initialized():
            raise RuntimeError("THCAllreduce needs torch.distributed initialized "
                               "(dist.init_process_group) for the norm exchange")
        if pipeline_values < 0:
            raise ValueError(f"pipeline_values must be >= 0 (0: no pipelining), got "
                             f"{pipeline_values}")
        if error_domain not in ("rotated", "gradient"):
            raise ValueError(f"error_domain must be 'rotated' or 'gradient', got "
                             f"{error_domain!r}")
        if not 0.0 <= loss_bound < 1.0:
            raise ValueError(f"loss_bound must be in [0, 1) (the fraction of a tensor's chunks "
                             f"that may be decoded as lost; 0 = exact), got {loss_bound}")
        if loss_wait < 0:
            raise ValueError(f"loss_wait must be >= 0 retransmission timeouts, got {loss_wait}")
        if nonfinite not in ("raise", "propagate"):
            raise ValueError(f"nonfinite must be 'raise' or 'propagate' (GradScaler: every "
                             f"worker gets an inf mean and skips the step), got {nonfinite!r}")
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS} (what a call does when the "
                             f"aggregator does not answer), got {fallback!r}")
        if not probe_interval > 0:
            raise ValueError(f"probe_interval must be > 0 seconds (how often a silent aggregator "
                             f"is probed), got {probe_interval}")
        self.nonfinite = nonfinite
        self.nonfinite_calls = 0               # calls answered with inf (nonfinite="propagate")
        # Falling back needs an aggregator to fall back from.
        self.fallback = fallback if exchange.name == "aggregator" else "raise"
        self.probe_interval = float(probe_interval)
        self.fallback_calls = 0                # calls whose sums came over the collective
        self.aggregator_returns = 0            # times every worker went back to the aggregator
        self._collective = None                # the fallback's SumAllreduceExchange
        self._on_collective = False            # agreed by every worker: aggregator not used
        self._probe_now = False                # agreed: probe before this call's control
        self._probe_answered = False
        self._last_probe = 0.0
        self.codec = codec
        self.exchange = exchange
        self.group = group
        self.loss_wait = float(loss_wait)
        # Bounded loss applies where packets can be lost: the in-network path.
        self.loss_bound = float(loss_bound) if exchange.name == "aggregator" else 0.0
        if self.loss_bound:
            _check_full_results(exchange.transport)
        self.loss_stats = {"tensors": 0, "chunks": 0, "missing_here": 0, "missing_agreed": 0}
        self.last_missing = None               # the last tensor's agreed lost chunks
        self._own_group = group is None and dist.get_world_size() > 1
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if exchange.name == "aggregator":
            thc.check_lanes(self.world, int(np.max(codec.table)))   # the switch's 8-bit lanes
        self.error_feedback = ChunkedErrorFeedback(rotated=error_domain == "rotated") \
            if error_feedback else None
        self.pipeline_values = int(pipeline_values)
        self.calls: dict[int, int] = {}        # per tensor key: rounds of the RNG
        self.verified_sizes: dict[int, int] = {}   # per tensor key: size all workers agreed
        # Where the time goes (main job): "total" per call, blocked on the sums
        # ("exchange") and on the control and norm exchanges ("norms").
        # exchange: waiting for sums, settle and the end agreement (those two also apart)
        self.seconds = {"total": 0.0, "exchange": 0.0, "norms": 0.0, "settle": 0.0,
                        "agree": 0.0}
        self.control_bytes = 0
        # the newest calls' times (tail latency), bounded for long jobs
        self.call_seconds: collections.deque[float] = collections.deque(maxlen=CALL_HISTORY)
        self.start_timeout = start_timeout
        self._started = False
        self._failed: BaseException | None = None
        # Calls on THC's own group end without an agreement (_end_with_every_sum):
        # the last such call's indices, for a redo a worker lacking sums may ask for.
        self._last_call = None
        self._deferred_calls = False           # close() then holds one last control exchange
        # False: every call ends with its agreement, as on a caller's group (a user of the
        # group between calls: host.fsdp's reduce-scatter)
        self.defer_end_agreement = True
        # A worker lacking sums warns after waiting this long for its rescue (_rescue_exchange).
        self.rescue_warn_s = RESCUE_WARN_S
        self._slots_of_size: dict[int, int] = {}   # tensor size -> norms of its chunk 0
        # The MAX exchanges' own connections (host.control_channel), made at start();
        # None: they go over the group's gloo (THC_GLOO_CONTROL=1, or no direct route).
        self._channel: ControlChannel | None = None

    def close(self, destroy_group: bool = True) -> None:
        """Close the exchange's socket (in-network path) and, with destroy_group, THC's own
        process group: only once no call is pending (THCHookState.close stops the exchange
        thread first)."""
        if destroy_group and self._deferred_calls and self._failed is None:
            # One still inside the exchange (a worker that has not closed yet) keeps the
            # group: destroying it waits for that exchange.
            destroy_group = self._closing_exchange()
        close_exchange = getattr(self.exchange, "close", None)
        if close_exchange is not None:
            close_exchange()
        if destroy_group and self._channel is not None:
            self._channel.close()
            self._channel = None
        if destroy_group and self._own_group and self._started and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None
            self._started = False

    # ----------------------------------------------------------------- checkpoint

    def codec_config(self) -> dict:
        """The settings a saved state must share to continue here: they decide the RHT
        signs, the rounding keys, the padded layout of each tensor and so the meaning of
        its stored error (README, "Using THC from your training loop")."""
        c, ef = self.codec, self.error_feedback
        return {"bits": c.bits, "granularity": c.granularity, "p": c.p,
                "symmetric": c.symmetric, "table": [int(v) for v in np.asarray(c.table)],
                "seed": c.seed, "partition_size": c.partition_size, "rotation": c.rotation,
                "error_feedback": ef is not None,
                "error_domain": None if ef is None else ("rotated" if ef.rotated else "gradient"),
                "pipeline_values": self.pipeline_values, "pipeline_chunk": self._chunk_step()}

    def state_dict(self) -> dict:
        """This worker's state between calls, CPU tensors and plain values (torch.save
        works): the error feedback per tensor key, the per-key call counters (the rounds
        of the rounding keys), the sizes every worker agreed on, and the settings
        (codec_config) with the world size and rank. The error is this worker's own:
        every rank saves its own. Aggregator slot rounds are not in it: start() flushes
        the job's slots and every worker restarts them at 0 (docs/protocol.md §4.6)."""
        ef = self.error_feedback
        return {"format": STATE_FORMAT, "config": self.codec_config(), "world": self.world,
                "rank": self.rank, "calls": dict(self.calls),
                "verified_sizes": dict(self.verified_sizes),
                "error_feedback": {} if ef is None else ef.cpu_errors()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict() of the same rank of a job with the same settings and
        world size; refuses anything else naming both values. Call before the first
        exchange of this process (the counters and errors would otherwise be mixed)."""
        check_state_entries(state, THCALLREDUCE_STATE_ENTRIES, "THCAllreduce")
        if state["format"] != STATE_FORMAT:
            raise ValueError(f"THC state format {state['format']!r}, this version reads "
                             f"format {STATE_FORMAT}: save it again with this version")
        if self.calls or self._started:
            raise RuntimeError("load_state_dict after this THCAllreduce already exchanged "
                               "tensors: load the checkpoint before the first step")
        mine = self.codec_config()
        saved = state["config"]
        for name in sorted(set(mine) | set(saved)):
            if saved.get(name) != mine.get(name):
                raise ValueError(
                    f"the saved THC state has {name}={saved.get(name)!r} but this worker has "
                    f"{name}={mine.get(name)!r}: build the hook state with the settings of the "
                    "job that saved it (same codec, error_domain, pipeline_values)")
        for name, here in (("world", self.world), ("rank", self.rank)):
            if state[name] != here:
                what = "world size" if name == "world" else "rank"
                raise ValueError(
                    f"the saved THC state is of {what} {state[name]} but this worker's {what} "
                    f"is {here}: every rank loads the state it saved itself (its own error "
                    f"feedback), in a job of the same world size")
        self.calls = {int(k): int(v) for k, v in state["calls"].items()}
        self.verified_sizes = {int(k): int(v) for k, v in state["verified_sizes"].items()}
        if self.error_feedback is not None:
            self.error_feedback.load_errors(state["error_feedback"])

    def start(self) -> None:
        """Job start: every worker calls it once (flushes the aggregator's slots)."""
        if self._started:
            return
        if self.fallback == "collective":
            self._flush_slots()         # a silent aggregator: the first call falls back
        else:
            self.exchange.start(self.group, self.start_timeout)
        if self.world > 1:
            _HEARTBEAT.start()          # every worker is here: the roll call can count on it
        if self._own_group:
            # Every rank is here (the barrier said so): make the private group now.
            self.group = dist.new_group(backend=dist.get_backend())
            if isinstance(self.exchange, SumAllreduceExchange):
                self.exchange.group = self.group
        if self._channel is None and os.environ.get("THC_GLOO_CONTROL", "") != "1":
            self._channel = ControlChannel.connect(self.group)
        self._started = True

    def submit(self, tensor: torch.Tensor, key: int = 0, *, layer: int = 0,
               num_layers: int = 1, reset_error: bool = False, then=None,
               agree_at_end: bool = False) -> torch.futures.Future:
        """The THC mean of `tensor`, computed on the exchange thread: a Future of it.

        The tensor is read on that thread: do not change it until the future completes.
        reset_error drops the tensor's stored error-feedback state first (its layout
        changed); then(mean), when given, also runs there and its value completes the
        future (wait() raises the original exception of either). agree_at_end: this call
        ends with the end agreement even where it is deferred (defer_end_agreement), for
        a caller whose next collective is not THC's: a worker that lacks sums would ask
        in a control exchange the others reach only after it."""
        def job():
            if agree_at_end and self.defer_end_agreement:
                self.defer_end_agreement = False
                try:
                    mean = self._guarded(tensor, key, layer, num_layers, reset_error)
                finally:
                    self.defer_end_agreement = True
            else:
                mean = self._guarded(tensor, key, layer, num_layers, reset_error)
            return mean if then is None else then(mean)
        return exchange_thread().submit(job)

    def __call__(self, tensor: torch.Tensor, key: int = 0, *, layer: int = 0,
                 num_layers: int = 1) -> torch.Tensor:
        """The THC mean of `tensor` over all workers (same shape and dtype); blocks."""
        if exchange_thread().on_thread():          # called from a submitted job
            return self._guarded(tensor, key, layer, num_layers, False)
        return self.submit(tensor, key, layer=layer, num_layers=num_layers).wait()

    def _guarded(self, tensor, key, layer, num_layers, reset_error):
        if self._failed is not None:
            raise AllreduceError(
                f"an earlier THC exchange on this worker failed ({type(self._failed).__name__}: "
                f"{self._failed}); the job's aggregator rounds and process group are out of "
                "step, so no further exchange can succeed: restart the job") from self._failed
        try:
            if reset_error and self.error_feedback:
                self.error_feedback.reset(key)
            return self._reduce(tensor, key, layer, num_layers)
        except BaseException as exc:
            if getattr(exc, "thc_agreed", False):
                raise
            lost = self._record_failure(exc)
            if lost is None:
                raise
            raise lost from exc

    def _record_failure(self, exc: BaseException) -> WorkerLostError | None:
        """Keep the failure that puts this worker out of step (later calls raise it);
        a WorkerLostError instead when the roll call finds workers gone."""
        self._failed = exc
        # An AllreduceError says already what went wrong (e.g. the start barrier names
        # the missing rank); any other failure may be a worker that died.
        diagnosed = isinstance(exc, AllreduceError) or not isinstance(exc, Exception)
        lost = None if diagnosed else self._roll_call(exc)
        if lost is not None:
            self._failed = lost
        return lost

    def _roll_call(self, exc: Exception) -> WorkerLostError | None:
        """After a failed call: which workers are gone. Every worker's heartbeat counts its
        key up in the process group's store (_Heartbeat, also while it waits in a
        collective); a worker whose count does not move for ROLL_CALL_BEATS beats exited,
        was killed or hangs. None when every worker is alive, or when there is no
        heartbeat to read (the original error stands)."""
        store = _HEARTBEAT.store
        if store is None:
            return None
        me = dist.get_rank()
        ranks = list(range(dist.get_world_size())) if self.group is None \
            else dist.get_process_group_ranks(self.group)
        try:
            gone = _silent_ranks(store, [r for r in ranks if r != me])
        except (RuntimeError, OSError) as store_exc:
            return WorkerLostError(
                f"this THC call failed ({type(exc).__name__}: {exc}), and the process group's "
                f"store does not answer either ({store_exc}): the process that hosts it (rank "
                "0 under init_method tcp:// or env://, else the launcher) has gone; see its "
                "log", [])
        if not gone:
            return None
        return WorkerLostError(
            f"worker(s) {gone} of {self.world} (global ranks) stopped: no heartbeat for "
            f"{ROLL_CALL_BEATS * HEARTBEAT_INTERVAL:g} s after this worker's THC call failed "
            f"({type(exc).__name__}: {exc}); they exited, were killed or hang: see their "
            "logs, then restart the job", gone)

    # ----------------------------------------------------------------- one call

    def _reduce(self, tensor, key, layer, num_layers) -> torch.Tensor:
        self.start()
        t_start = time.perf_counter()
        # Agreed at the previous call (on the collective): its answer goes into this call's
        # control vector, which decides whether this call goes back to the aggregator.
        self._probe_answered = self._probe_now and self.exchange.transport.probe()
        if not isinstance(tensor, torch.Tensor):
            raise _agreed(TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}"))
        # Agree first (dtype, size, finiteness) so a bad worker fails every worker at once,
        # instead of failing alone and leaving the others blocked in the next collective.
        good_dtype = tensor.dtype in SUPPORTED_DTYPES
        flat = _flat_float32(tensor) if good_dtype else tensor.detach().reshape(-1)
        d = flat.numel()
        finite = good_dtype and _all_finite(flat)
        local = (d, finite, good_dtype, key, flat.device, tensor.dtype)
        ranges = self.chunk_ranges(d)
        padded = np.cumsum([0] + [self.codec.padded_length(hi - lo) for lo, hi in ranges])
        ranges = [(lo, hi, int(plo), int(phi))           # and each chunk's padded range
                  for (lo, hi), plo, phi in zip(ranges, padded[:-1], padded[1:])]
        padded_total = int(padded[-1])
        first = None
        if key in self.verified_sizes:
            # Every worker verified this tensor's size before, so all agree on the length
            # of one combined exchange: [chunk 0's norms of the verified layout | control].
            first = self._combined_exchange(flat, local, ranges)
            nonfinite = first is _NONFINITE
        else:
            # First call for this tensor: the control fields alone (fixed length) first.
            nonfinite = bool(self._check_agreement(*local))
        self.verified_sizes[key] = d
        if nonfinite:
            # nonfinite="propagate": the same inf mean on every worker, decided from the
            # agreed control vector; no data sent, error feedback and rounds untouched.
            self.nonfinite_calls += 1
            return torch.full_like(tensor, float("inf"))
        rnd = self.calls.get(key, 0)
        self.calls[key] = rnd + 1
        mean = torch.empty(d, dtype=torch.float32, device=flat.device)
        exchange = self.exchange
        if self._on_collective:
            exchange = self._collective_exchange()
            self.fallback_calls += 1
        stream = exchange.open(padded_total, key, layer=layer, num_layers=num_layers,
                               background=len(ranges) > 1)
        if self.fallback == "collective" and exchange is self.exchange:
            stream = _GuardedStream(stream)
        try:
            self._pipeline(stream, flat, key, rnd, ranges, first, mean)
        except BaseException:
            stream.close()
            raise
        self.seconds["total"] += time.perf_counter() - t_start
        self.call_seconds.append(time.perf_counter() - t_start)
        return mean.to(tensor.dtype).reshape(tensor.shape)

    def chunk_ranges(self, d: int) -> list[tuple[int, int]]:
        """The pipeline chunks of a d-float tensor: (lo, hi) ranges of whole partitions."""
        step = self._chunk_step()
        if not step or d <= step:
            return [(0, d)]
        return [(lo, min(lo + step, d)) for lo in range(0, d, step)]

    def _chunk_step(self) -> int:
        if not self.pipeline_values:
            return 0
        unit = math.lcm(self.codec.partition_size, self.exchange.values_per_packet)
        return -(-self.pipeline_values // unit) * unit

    def _pipeline(self, stream, flat, key, rnd, ranges, first, mean) -> None:
        """Chunks prepared (compensated, normed, rotated; their norm exchange started) a
        group at a time (_norm_group_end: one exchange per group, where the chunks are
        rotated in place; else one chunk per group), the next group before the last chunk
        of the one before is quantized, so that its exchange overlaps that work; quantized
        while earlier ones are on the wire, and decoded in order as their sums come in.

        Through a _GuardedStream an aggregator that stops answering stops only the
        exchange: every chunk is still normed and quantized (the same collectives on every
        worker), then the workers agree, and the call is redone over the collective."""
        prepared, in_flight = [], []              # prepared, not sent / sent, not decoded
        guarded = isinstance(stream, _GuardedStream)
        sent = []                        # guarded or bounded: every chunk quantized, for a redo
        bounded = self.loss_bound and not self._on_collective
        upcoming = 0
        if first is not None:
            prepared.append(first)
            upcoming = 1
        in_place = self._rotates_in_place(stream, flat)
        for k in range(len(ranges)):
            while upcoming < len(ranges) and upcoming <= k + 1:
                # A group's rotations are held until each chunk is quantized: only where
                # they go into the error buffer (no memory of their own) do groups grow.
                end = _norm_group_end(upcoming, len(ranges)) if in_place else upcoming + 1
                prepared += self._prepare(flat, key, ranges[upcoming:end], ranges[-1][3],
                                          in_place)
                upcoming = end
                stream.pump()
            chunk = prepared.pop(0)
            t0 = time.perf_counter()
            max_norms = chunk.wait_norms()
            self.seconds["norms"] += time.perf_counter() - t0
            self.control_bytes += 4 * chunk.num_norms
            chunk.packed = self.codec.quantize(chunk.rotated, max_norms, worker=self.rank,
                                               round=rnd, tensor=key + k * CHUNK_KEY_STRIDE,
                                               error_out=chunk.error_out)
            # Bounded loss decodes a chunk early only once its sums are all in: a chunk
            # back at any worker is never decoded as lost (_agree_end).
            final = k + 1 == len(ranges)
            last = final and not bounded
            # The last chunk is sent by the wait that follows (for its sums just below, or
            # settle's), not by a round of its own.
            stream.submit(*chunk.padded, chunk.packed, chunk.rotated, max_norms,
                          send=not final)
            chunk.rotated = None
            in_flight.append(chunk)
            if guarded or bounded:
                sent.append(chunk)
            while in_flight and (last or stream.ready(in_flight[0].padded[1])):
                if not self._decode(stream, in_flight[0], key, mean):
                    break                         # the aggregator did not answer
                in_flight.pop(0)
        settled = None
        if bounded:
            t0 = time.perf_counter()
            settled = stream.settle(self.loss_bound, self.loss_wait)
            elapsed = time.perf_counter() - t0
            self.seconds["settle"] += elapsed
            self.seconds["exchange"] += elapsed
        if not (guarded or bounded):
            stream.finish()
            return
        n_chunks = stream.n_chunks if bounded else 0
        t0 = time.perf_counter()
        if self._own_group and guarded and self.defer_end_agreement:
            self._deferred_calls = True
            if stream.down is None and (settled is None or not settled.any()):
                self._end_with_every_sum(stream, sent, in_flight, key, mean, settled,
                                         n_chunks)
                return
            # This worker lacks sums: the others hold the agreement with it in their next
            # control exchange, once it asks there.
            self._last_call = None
            self._rescue_exchange()
        # One exchange at the end of the call for both agreements: whether the aggregator
        # answered every worker, and (bounded loss) which chunks are back where.
        silent, lost, partial = self._agree_end(stream.down if guarded else None, settled,
                                                n_chunks, mean.device)
        elapsed = time.perf_counter() - t0
        self.seconds["agree"] += elapsed
        self.seconds["exchange"] += elapsed
        if silent:
            self._go_to_collective(silent, stream.down)
            stream.close()
            self._redo_over_collective(sent, key, mean)
            return
        if partial:
            # A chunk came back to some workers only: the call's sums over the collective.
            # The stream still finishes (its missing chunks were given up in settle), so
            # its slots advance as on every other worker: a worker that had every sum
            # finished its stream, and the aggregator's copies moved on with the rounds
            # sent; a slot left behind would send a round the aggregator has completed
            # and be answered with that round's old RESULT, or a straggler notice.
            self._record_missing(np.asarray(settled, bool), np.zeros(n_chunks, bool))
            stream.finish()
            self._redo_over_collective(sent, key, mean)
            return
        if bounded:
            # Decode only once every worker knows the same lost chunks.
            self._record_missing(np.asarray(settled, bool), lost)
            self._count_lost_marks(lost, np.concatenate(stream.first_tos))
            for chunk in in_flight:
                self._decode(stream, chunk, key, mean, lost)
        stream.finish()

    def _end_with_every_sum(self, stream, sent, in_flight, key, mean, settled,
                            n_chunks: int) -> None:
        """The end of a call on THC's own group whose sums all came back here (bounded
        loss: nothing missing after settle): decode and return without a collective.
        Every worker's indices reached the aggregator, so only a worker lacking sums can
        need anything; it asks in our next control exchange (_rescue_exchange), where we
        join the end agreement it holds (_join_rescue) with the indices kept here."""
        if settled is not None:
            nothing = np.zeros(n_chunks, bool)
            self._record_missing(settled, nothing)
            for chunk in in_flight:
                self._decode(stream, chunk, key, mean, nothing)
        stream.finish()
        self._last_call = (sent, key, len(mean), mean.device, n_chunks)

    def _rescue_exchange(self) -> None:
        """This worker lacks sums of a call that ended without an agreement: join the other
        workers' next control exchange (the first collective each makes after the call:
        the next call's, or close()'s) with only its rescue field set, so that they hold
        the end agreement (_agree_end) with it. Its length is the one they use
        (_control_length: it depends only on the sizes every worker verified)."""
        vector = torch.zeros(self._control_length(), dtype=torch.float64)
        vector[self._norm_slots() + self._rescue_field(self.rank)] = 1.0
        if dist.get_backend(self.group) == "nccl":
            vector = vector.cuda()
        work = self._max_exchange(vector)
        if isinstance(work, ControlWork) and not work.done_within(self.rescue_warn_s):
            warnings.warn(RescueWaitWarning(
                f"THC worker {self.rank} lacks sums of its last call and has waited "
                f"{self.rescue_warn_s:g} s for the other workers' next THC call, where they "
                "give them to it. If they are in a collective of another group first (DDP's "
                "buffer broadcast before a forward, for a model with buffers such as "
                "BatchNorm, or one of the training loop's own), each waits for the other "
                "until that group's timeout: set defer_end_agreement = False on the "
                "THCAllreduce (for the DDP hook: state.allreduce), which ends every call "
                "with the agreement"), stacklevel=2)
        work.wait()
        self.control_bytes += 8 * vector.numel()

    def _rescued(self, control) -> list[int]:
        """The workers that asked for the end agreement of the last call (_rescue_exchange)."""
        return [r for r in range(self.world) if control[self._rescue_field(r)] > 0]

    def _join_rescue(self, asking: list[int]) -> None:
        """Workers that lack sums of the last call asked in this control exchange: hold
        its end agreement with them, as a worker with every chunk, and give them the sums
        over the collective when it says so (every chunk was decoded here, so nothing here
        changes)."""
        last, self._last_call = self._last_call, None
        if last is None:
            raise AllreduceError(
                f"worker(s) {asking} ask for help with the last THC call, which this "
                "worker did not keep: every worker must use the same process group")
        sent, key, d, device, n_chunks = last
        silent, _, partial = self._agree_end(None, np.zeros(n_chunks, bool), n_chunks, device)
        if silent:
            self._go_to_collective(silent, None)
        if silent or partial:
            self._redo_over_collective(sent, key, torch.empty(d, device=device))

    def _closing_exchange(self) -> bool:
        """close() after calls with a deferred end agreement: one last control exchange,
        so that a worker still waiting for the last call's redo gets it. Every worker
        closes; one that does not within start_timeout seconds only costs a warning.
        Returns whether the exchange completed."""
        if not dist.is_initialized():
            return False              # the process group is gone already (destroyed)
        try:
            device = torch.device("cuda" if dist.get_backend(self.group) == "nccl" else "cpu")
            self._control_exchange(None, lambda: torch.zeros(self._control_fields(),
                                                             dtype=torch.float64), device,
                                   timeout=self.start_timeout)
        except Exception as exc:      # a worker gone already, or not closing in time
            warnings.warn(f"THC: close() could not hold its last control exchange "
                          f"({type(exc).__name__}: {exc}); THC's process group is left "
                          "as it is", RuntimeWarning, stacklevel=3)
            return False
        return True

    def _count_lost_marks(self, missing, tos) -> None:
        """loss_stats["lost_marks"]: agreed lost chunks by (DSCP, ECN) of first sending."""
        marks = self.loss_stats.setdefault("lost_marks", {})
        for t in tos[missing[:len(tos)]]:
            name = f"dscp{int(t) >> 2}/{'ect' if int(t) & 3 else 'not-ect'}"
            marks[name] = marks.get(name, 0) + 1

    def _agree_end(self, down: BaseException | None, settled, n_chunks: int, device):
        """The end-of-call agreement, one MAX exchange of bytes over the process group (the
        control channel): [aggregator silent here? (one byte per worker) | chunks back here
        | chunks missing here (one byte per chunk each, bounded loss)]. Returns (the
        workers the aggregator did not answer, the chunks back nowhere: lost alike on
        every worker, whether a chunk is back at some workers only: then the call is
        redone over the collective). A silent worker sends no chunks."""
        w = self.world
        vector = torch.zeros(w + 2 * n_chunks, dtype=torch.uint8)
        vector[self.rank] = down is not None
        if n_chunks and settled is not None and down is None:
            missing = np.asarray(settled, bool)
            vector[w:] = torch.from_numpy(np.concatenate([~missing, missing]).astype(np.uint8))
        if device.type == "cuda" and dist.get_backend(self.group) == "nccl":
            vector = vector.to(device)
        self._max_exchange(vector).wait()
        self.control_bytes += vector.numel()
        vector = vector.cpu()
        silent = torch.nonzero(vector[:w]).flatten().tolist()
        if silent or not n_chunks:
            return silent, None, False
        back = vector[w:w + n_chunks].numpy().astype(bool)
        missing_somewhere = vector[w + n_chunks:].numpy().astype(bool)
        return silent, ~back, bool(np.any(back & missing_somewhere))

    def _record_missing(self, mine: np.ndarray, agreed: np.ndarray) -> None:
        self.last_missing = agreed
        st = self.loss_stats
        st["tensors"] += 1
        st["chunks"] += len(agreed)
        st["missing_here"] += int(mine.sum())
        st["missing_agreed"] += int(agreed.sum())

    # ----------------------------------------------------------------- fallback

    def _go_to_collective(self, silent: list, down: BaseException | None) -> None:
        """The aggregator did not answer the workers `silent` this call (fallback=
        "collective"): this and every later call go over the collective (the first time
        with a warning) until a probe finds it answering every worker again."""
        self._on_collective = True
        self._probe_now = False
        self._last_probe = time.monotonic()
        if self.fallback_calls == 0:
            host, port = self.exchange.transport.aggregator
            reason = f"; here: {type(down).__name__}: {down}" if down is not None else ""
            warnings.warn(
                f"THC: the aggregator {host}:{port} did not answer worker(s) {silent}{reason}. "
                "This call and the next ones go over the process group's collective (the same "
                "THC codec and rounds, so the same means); the aggregator is probed every "
                f"{self.probe_interval:g} s and used again once it answers every worker",
                RuntimeWarning, stacklevel=2)

    def _redo_over_collective(self, chunks: list, key, mean) -> None:
        """This call's integer sums again, over the process group: every worker's chunks
        as they were quantized and sent (same indices: the mean the aggregator would have
        given), decoded; error feedback only where the aggregator's sums were not decoded
        (decoding sets it, whatever the sums)."""
        stream = self._collective_exchange().open(0, key)
        for chunk in chunks:
            stream.submit(*chunk.padded, chunk.packed, None)
        for chunk in chunks:
            self._decode(stream, chunk, key, mean, update_error=not chunk.decoded)
        self.fallback_calls += 1

    def _collective_exchange(self) -> "SumAllreduceExchange":
        """The fallback's exchange over THC's process group, made at first use."""
        if self._collective is None:
            self._collective = SumAllreduceExchange(self.codec, self.group)
        return self._collective

    @property
    def on_collective(self) -> bool:
        """Whether calls go over the collective now (the aggregator did not answer)."""
        return self._on_collective

    @property
    def collective_bytes(self) -> int:
        """Lane bytes sent over the collective by fallback calls."""
        return 0 if self._collective is None else self._collective.bytes_sent

    def _path_fields(self) -> list[float]:
        """The control vector's fallback fields: [probe due, aggregator silent on rank r
        (one per worker)]; MAX-reduced (_follow_path reads them)."""
        fields = [0.0] * (1 + self.world)
        if self._on_collective:
            fields[0] = float(time.monotonic() - self._last_probe >= self.probe_interval)
            fields[1 + self.rank] = 0.0 if self._probe_answered else 1.0
        return fields

    def _follow_path(self, control) -> None:
        """On the collective: probe at the next call when any worker's probe_interval has
        passed; go back to the aggregator at this call when every worker probed it at the
        start of this call and got an answer. Every worker reads the same agreed fields
        (the control vector's _path_fields)."""
        if not self._on_collective:
            return
        fields = control[2 * self.world + 4:3 * self.world + 5]
        probed, self._probe_now = self._probe_now, bool(fields[0] > 0)
        if probed:
            self._last_probe = time.monotonic()
            if not any(float(f) > 0 for f in fields[1:]):
                self._return_to_aggregator()

    def _flush_slots(self) -> None:
        """AggregatorExchange.start, where a silent aggregator is no error: the next
        exchange finds it out, on every worker alike."""
        try:
            self.exchange.transport.flush()
        except AGGREGATOR_SILENT:
            pass
        _barrier(self.group, "waiting for every worker to flush the aggregator slots",
                 self.start_timeout)

    def _return_to_aggregator(self) -> None:
        """FLUSH every slot of the job (the rounds restart at 0 on every worker), then wait
        for every worker, so no flush lands after a contribution (as at job start)."""
        self._flush_slots()
        self._on_collective = self._probe_now = False
        self.aggregator_returns += 1
        host, port = self.exchange.transport.aggregator
        warnings.warn(f"THC: the aggregator {host}:{port} answers every worker again: THC calls "
                      "go through it again", RuntimeWarning, stacklevel=2)

    def _prepare(self, flat, key, rngs, padded_total: int, in_place: bool) -> list:
        """A group of chunks' values, norms and RHT, with one norm exchange for the group
        (each exchange is a collective on every worker: fewer of them cost less CPU and
        scheduling than one per chunk). The exchange runs during the RHT (gradient-domain
        error feedback) or after it (rotated domain: the norms are of the rotated,
        compensated values; the exchange overlaps the quantization of the chunk before the
        group)."""
        chunks = [self._chunk_values(flat, key, rng, padded_total, in_place) for rng in rngs]
        norms = torch.cat([_as_torch(c.norms, flat.device).float() for c in chunks])
        work = self._max_exchange(norms)
        at = 0
        for chunk in chunks:
            n = len(chunk.norms)
            chunk.norms, chunk.num_norms, chunk.work = norms[at:at + n], n, work
            at += n
            if chunk.rotated is None:
                chunk.rotated = self.codec.rotate(chunk.x)
        return chunks

    def _rotates_in_place(self, stream, flat) -> bool:
        """Whether chunks rotated after the control exchange may go into their slice of the
        rotated error-feedback buffer: the quantizer reads them and writes the new error
        there in one pass, so nothing is allocated; only on the CPU (the CUDA kernels do
        not fuse the add into the RHT, so a rotation there allocates anyway and a group
        would hold several in GPU memory) and when the stream does not read the rotated
        values after quantization (a DLCP policy that marks by values).
        Chunk 0 is not where its rotation overlaps the control exchange (every call after
        a tensor's first: _combined_exchange), whose refusal must leave the error feedback
        as it was."""
        ef = self.error_feedback
        return (ef is not None and ef.rotated and flat.device.type == "cpu"
                and not getattr(stream, "reads_rotated", False))

    def _chunk_values(self, flat, key, rng, padded_total: int,
                      in_place: bool = False) -> "_Chunk":
        """The chunk rng = (lo, hi, padded lo, padded hi) with its (compensated) values and
        host norms; rotated already in the rotated error-feedback domain (the norms come
        out of the RHT, with the error added in the same pass; in_place: into the error's
        own slice, which then holds x_k until quantize writes e_k), else not yet."""
        lo, hi, plo, phi = rng
        ef = self.error_feedback
        if ef is not None and ef.rotated:
            e = ef.rotated_error(key, padded_total, flat)
            rotated, norms = self.codec.rotate_and_norms(
                flat[lo:hi], add=e[plo:phi], out=e[plo:phi] if in_place else None)
            chunk = _Chunk(rng, flat[lo:hi], rotated, norms)
            chunk.error_out = e[plo:phi]
            return chunk
        x = ef.compensate_range(key, flat, lo, hi) if ef is not None else flat[lo:hi]
        return _Chunk(rng, x, None, self.codec.partition_norms(x))

    def _decode(self, stream, chunk: "_Chunk", key, mean, missing=None,
                update_error: bool = True) -> bool:
        """Decode the chunk's sums into mean and update its error feedback (update_error:
        False when redoing a chunk decoded before). False, with nothing done, when a
        _GuardedStream's aggregator did not answer."""
        t0 = time.perf_counter()
        if missing is None:
            got = stream.result(*chunk.padded)
        else:
            got = stream.result(*chunk.padded, missing=missing)
        self.seconds["exchange"] += time.perf_counter() - t0
        if got is None:
            return False
        sums, counts = got
        max_norms = chunk.max_norms
        lost = None
        if missing is not None and not np.isscalar(counts):
            lost = np.asarray(counts) == 0
            if mean.is_cuda:
                counts = torch.as_tensor(np.asarray(counts)).to(mean.device)
        if mean.is_cuda:
            sums = torch.as_tensor(np.asarray(sums) if not isinstance(sums, torch.Tensor)
                                   else sums).to(mean.device)
        n = chunk.hi - chunk.lo
        self.codec.decode(sums, counts, max_norms, n, out=mean[chunk.lo:chunk.hi])
        if update_error:
            self._update_error(chunk, key, mean, lost)
        chunk.decoded = True
        chunk.x = chunk.error_out = None      # a redo needs only packed and max_norms
        return True

    def _update_error(self, chunk: "_Chunk", key, mean, lost) -> None:
        """The error feedback of a decoded chunk (lost: its chunks decoded as lost)."""
        max_norms, n = chunk.max_norms, chunk.hi - chunk.lo
        if lost is not None and self.error_feedback and self.error_feedback.rotated:
            # What was lost is not dropped: this worker's quantized values there go back
            # into its error, so the next round carries them (as error feedback does for
            # sparsification). In the gradient domain the same follows from "own" below.
            own = self.codec.dequantize(chunk.packed, max_norms)
            _add_where(chunk.error_out, own, lost)
        if self.error_feedback and not self.error_feedback.rotated:
            # e = x - RHT^-1(own quantized values), in the gradient's domain.
            own = self.codec.dequantize(chunk.packed, max_norms)
            if lost is not None:
                own = _zero_where(own, lost)
            own = self.codec.inverse_rotate(own, n)
            self.error_feedback.update_range(key, chunk.lo, chunk.x, _as_torch(own, mean.device),
                                             len(mean))

    def _combined_exchange(self, flat, local, ranges):
        """One MAX exchange of chunk 0's norms and the control fields; RHT while it runs.

        A worker whose tensor is bad (size, dtype, NaN) still sends a vector of the agreed
        length (zero norms), so every worker gets the control fields and raises the same
        error; nobody is left waiting in a collective. Returns chunk 0 prepared, or None
        when every worker changed the size (e.g. DDP rebuilt its buckets).
        """
        d, finite, good_dtype, key, device, dtype = local
        verified = self.chunk_ranges(self.verified_sizes[key])[0]
        parts = self.codec.num_partitions(verified[1] - verified[0])
        usable = finite and good_dtype and d == self.verified_sizes[key]
        norms = torch.zeros(parts, dtype=torch.float64)
        chunk = overlap = None
        if usable:
            chunk = self._chunk_values(flat, key, ranges[0], ranges[-1][3])
            norms[:] = torch.from_numpy(np.asarray(chunk.norms, np.float64))
            if chunk.rotated is None:
                def overlap():                                # runs during the exchange
                    chunk.rotated = self.codec.rotate(chunk.x)
        head, control = self._control_exchange(
            norms, lambda: self._control_vector(d, finite, good_dtype), device, overlap)
        self._follow_path(control)
        if self._raise_on_disagreement(control, d, good_dtype, key, dtype):
            return _NONFINITE
        if not usable:
            # No error, so every worker has the same new size: chunk 0's norms of the new
            # layout go separately, once.
            return None
        chunk.num_norms = parts
        chunk.max_norms = head[:parts].float().to(device)
        if not isinstance(chunk.rotated, torch.Tensor):
            chunk.max_norms = chunk.max_norms.cpu().numpy()
        return chunk

    def _control_exchange(self, norms, make_control, device, overlap=None, timeout=None):
        """The first collective of every call (and of close()): one MAX exchange of
        [norms, zero-padded to the norm slots | the control fields]. A rescue asked for in
        it (_rescue_exchange) is joined, then the exchange is held again, with fields made
        afresh. Returns the reduced (norm slots, control fields) on the CPU. timeout
        (seconds): at most this long for each exchange (default: the group's)."""
        slots = self._norm_slots()
        while True:
            head = torch.zeros(slots, dtype=torch.float64)
            if norms is not None:
                head[:len(norms)] = norms
            vector = torch.cat([head, make_control()])
            if device.type == "cuda" and dist.get_backend(self.group) == "nccl":
                vector = vector.to(device)
            work = self._max_exchange(vector)
            if overlap is not None:
                overlap()
                overlap = None
            t0 = time.perf_counter()
            if timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout))
            self.seconds["norms"] += time.perf_counter() - t0
            vector = vector.cpu()
            self.control_bytes += 8 * (vector.numel() - (0 if norms is None else len(norms)))
            # Read field by field below: numpy's element reads cost a tenth of torch's.
            control = vector[slots:].numpy()
            asking = self._rescued(control)
            if not asking:
                return vector[:slots], control
            self._join_rescue(asking)

    def _max_exchange(self, vector: torch.Tensor):
        """Start a MAX all_reduce of a control or norm vector over THC's group: on the
        control channel where it fits, else gloo/NCCL. Returns its Work (wait())."""
        if self._channel is not None and self._channel.fits(vector):
            return self._channel.all_reduce_max(vector)
        return dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def _norm_slots(self) -> int:
        """Norms in the first exchange of a call: the most chunk 0 of any tensor size
        verified so far has, so that the length depends only on what every worker
        verified (a worker waiting for a redo knows it without knowing the next call)."""
        slots = 0
        for size in self.verified_sizes.values():
            if size not in self._slots_of_size:
                lo, hi = self.chunk_ranges(size)[0]
                self._slots_of_size[size] = self.codec.num_partitions(hi - lo)
            slots = max(slots, self._slots_of_size[size])
        return slots

    def _control_fields(self) -> int:
        return 4 * self.world + 5

    def _control_length(self) -> int:
        return self._norm_slots() + self._control_fields()

    def _rescue_field(self, rank: int) -> int:
        return 3 * self.world + 5 + rank

    def _control_vector(self, d: int, finite: bool, good_dtype: bool) -> torch.Tensor:
        """[bad dtype one-hot (W), bad values one-hot (W), d, -d, chunk, -chunk, fallback
        fields (1 + W, _path_fields), rescue one-hot (W, set only by _rescue_exchange)];
        MAX-reduced."""
        w = self.world
        control = np.zeros(self._control_fields(), dtype=np.float64)
        control[2 * w + 4:3 * w + 5] = self._path_fields()
        control[self.rank] = 0.0 if good_dtype else 1.0
        control[w + self.rank] = 0.0 if finite or not good_dtype else 1.0
        control[2 * w], control[2 * w + 1] = d, -d
        step = self._chunk_step()
        control[2 * w + 2], control[2 * w + 3] = step, -step
        return torch.from_numpy(control)

    def _check_agreement(self, d: int, finite: bool, good_dtype: bool, key: int, device,
                         dtype) -> list[int]:
        """The control fields alone (zero norms), in one MAX exchange; returns the
        workers with a non-finite tensor (nonfinite="propagate"; else they raise)."""
        _, control = self._control_exchange(
            None, lambda: self._control_vector(d, finite, good_dtype), device)
        self._follow_path(control)
        return self._raise_on_disagreement(control, d, good_dtype, key, dtype)

    def _raise_on_disagreement(self, control, d, good_dtype, key, dtype) -> list[int]:
        """Raise what every worker raises alike (the same control vector everywhere); with
        nonfinite="propagate" return the workers whose tensor holds NaN/Inf instead."""
        w = self.world
        bad_dtype = [r for r in range(w) if control[r] > 0]
        if bad_dtype:
            mine = f" (this worker: {dtype})" if not good_dtype else ""
            raise _agreed(TypeError(
                f"tensor {key}: worker(s) {bad_dtype} passed a tensor that is not floating"
                f"{mine}; THC allreduce supports {[str(t) for t in SUPPORTED_DTYPES]}: reduce "
                "integer tensors with dist.all_reduce"))
        largest, smallest = int(control[2 * w]), -int(control[2 * w + 1])
        if largest != smallest:
            raise _agreed(SizeMismatchError(
                f"tensor {key}: workers passed different sizes (this worker {d}, smallest "
                f"{smallest}, largest {largest}); every worker must reduce the same tensors "
                "in the same order"))
        largest, smallest = int(control[2 * w + 2]), -int(control[2 * w + 3])
        if largest != smallest:
            raise AllreduceError(
                f"tensor {key}: workers use different pipeline chunks (this worker "
                f"{self._chunk_step()} values, others between {smallest} and {largest}): give "
                "every worker the same pipeline_values and codec partition size")
        bad = [r for r in range(w) if control[w + r] > 0]
        if bad and self.nonfinite == "propagate":
            return bad
        if bad:
            raise _agreed(thc.NonFiniteError(
                f"tensor {key}: NaN or Inf gradient on worker(s) {bad}; nothing was sent "
                "(lower the learning rate or enable gradient clipping; with a "
                "torch.amp.GradScaler pass nonfinite=\"propagate\" so the step is skipped)"))
        return []


_NONFINITE = object()       # _combined_exchange's answer when a worker's tensor is NaN/Inf


class _Chunk:
    """One pipeline chunk in flight: its values, norm exchange, packed indices."""

    def __init__(self, rng, x, rotated, norms):
        self.lo, self.hi, plo, phi = rng
        self.padded = (plo, phi)
        self.x, self.rotated, self.norms = x, rotated, norms
        self.work, self.num_norms = None, len(norms)
        self.max_norms = None
        self.packed = None
        self.decoded = False             # its sums were decoded into the mean
        self.error_out = None            # rotated error feedback: where quantize puts e_rot

    def wait_norms(self):
        """The max norms over all workers (torch when the values are torch, else numpy)."""
        if self.max_norms is None:
            self.work.wait()
            self.max_norms = self.norms if isinstance(self.rotated, torch.Tensor) \
                else self.norms.cpu().numpy()
        return self.max_norms


class ChunkedErrorFeedback(thc.ErrorFeedback):
    """Error feedback chunk by chunk, in place.

    Rotated domain (rotated=True, the default of THCAllreduce): one float32 buffer of the
    tensor's padded length holds e_rot; chunk k's RHT adds its slice (codec.rotate_and_norms
    add=) and its quantizer writes the new error there (codec.quantize error_out=): no
    inverse RHT and no extra pass for the feedback. Gradient domain: one array of the
    tensor's length; compensate_range returns grad[lo:hi] + e[lo:hi] (the gradient's own
    slice on the first round), update_range writes x - own decoded into e[lo:lo+len(x)].
    """

    def cpu_errors(self) -> dict:
        """Every key's stored error as a CPU float32 torch tensor (a copy, for torch.save)."""
        return {key: (e.detach().cpu().clone() if isinstance(e, torch.Tensor)
                      else torch.from_numpy(np.array(e, np.float32)))
                for key, e in self._errors.items()}

    def load_errors(self, errors: dict) -> None:
        """Replace every stored error by `errors` (cpu_errors() of a saved state); each moves
        to the device of its tensor at its next use (_stored)."""
        self._errors = {int(key): torch.as_tensor(e, dtype=torch.float32).clone()
                        for key, e in errors.items()}

    def _stored(self, key, device):
        """The stored error of `key` on `device` (a loaded one arrives on the CPU)."""
        e = self._errors.get(key)
        if isinstance(e, torch.Tensor) and e.device != device:
            e = self._errors[key] = e.to(device)
        return e

    def rotated_error(self, key, padded: int, like):
        """The padded-length e_rot buffer of `key` (zeros before the first call)."""
        e = self._stored(key, like.device) if isinstance(like, torch.Tensor) \
            else self._errors.get(key)
        if e is None or e.shape[0] != padded or isinstance(e, torch.Tensor) != \
                isinstance(like, torch.Tensor):
            e = torch.zeros(padded, dtype=torch.float32, device=like.device) \
                if isinstance(like, torch.Tensor) else np.zeros(padded, np.float32)
            self._errors[key] = e
        return e

    def compensate_range(self, key, grad, lo: int, hi: int):
        e = self._stored(key, grad.device)
        if e is None:
            return grad[lo:hi]
        if tuple(e.shape) != (grad.shape[0],):
            raise ValueError(f"error feedback for {key!r}: stored shape {tuple(e.shape)} "
                             f"!= gradient shape {tuple(grad.shape)}")
        return grad[lo:hi] + e[lo:hi]

    def update_range(self, key, lo: int, x, own_decoded, length: int) -> None:
        e = self._stored(key, own_decoded.device)
        if e is None or e.shape[0] != length:
            e = torch.zeros(length, dtype=torch.float32, device=own_decoded.device)
            self._errors[key] = e
        torch.sub(x, own_decoded, out=e[lo:lo + len(x)])


def _agreed(exc: BaseException) -> BaseException:
    """Mark an error every worker raises together, before any data moved (the state stays
    usable for the next call)."""
    exc.thc_agreed = True
    return exc


# --------------------------------------------------------------------------- helpers

def check_state_entries(state, expected: frozenset, what: str) -> None:
    """A saved state must be a dict with exactly the entries `what`.state_dict() writes."""
    if not isinstance(state, dict):
        raise TypeError(f"{what}.load_state_dict takes the dict {what}.state_dict() returned, "
                        f"got {type(state).__name__}")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"not a {what} state: missing entries {missing}, unexpected entries "
                         f"{unexpected} (expected {sorted(expected)}): pass what "
                         f"{what}.state_dict() returned")


def _norm_group_end(start: int, n_chunks: int) -> int:
    """The end of the group of chunks whose norms are exchanged together, from `start`:
    chunk 0 alone (its norms ride the control exchange), then groups as long as the chunks
    before them (1, 2-3, 4-7, ...), so a call of n chunks holds 1 + ceil(log2 n) norm
    exchanges, and no group is longer than what was submitted before it."""
    return min(n_chunks, max(1, 2 * start))


def _all_finite(flat: torch.Tensor) -> bool:
    """No NaN/Inf in flat (float32). On CPU a float32 dot product first (0.5 ms for 16 MB
    vs 9 ms for isfinite().all()): NaN and Inf propagate through a sum of squares, so a
    finite x.x proves every value finite; only a non-finite one (or an overflow of the
    squares past 3.4e38) needs the exact elementwise check."""
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous():
        a = flat.detach().numpy()
        if np.isfinite(np.dot(a, a)):
            return True
    return bool(torch.isfinite(flat).all())


def _flat_float32(tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"THC allreduce supports floating tensors {[str(t) for t in SUPPORTED_DTYPES]}"
                        f", got {tensor.dtype}: reduce integer tensors with dist.all_reduce")
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.float32 else flat.float()


def _as_torch(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def _add_where(dst, src, mask: np.ndarray) -> None:
    """dst[mask] += src[mask] in place (numpy or torch, any device)."""
    if isinstance(dst, torch.Tensor):
        m = torch.from_numpy(mask).to(dst.device)
        dst[m] += _as_torch(src, dst.device)[m]
    else:
        dst[mask] += np.asarray(src)[mask]


def _zero_where(x, mask: np.ndarray):
    if isinstance(x, torch.Tensor):
        x = x.clone()
        x[torch.from_numpy(mask).to(x.device)] = 0
        return x
    x = np.array(x, copy=True)
    x[mask] = 0
    return x


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _barrier(group, what: str, timeout_s: float = 60.0) -> None:
    """A barrier that names the missing rank (gloo's monitored barrier) instead of hanging."""
    if dist.get_backend(group) == "gloo":
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            hint = "" if dist.get_rank(group) == 0 else \
                " (rank 0 checks every rank and names the missing one in its error)"
            raise AllreduceError(f"while {what} ({timeout_s:g} s): {exc}{hint}") from exc
    else:
        dist.barrier(group=group)
