"""PyTorch integration: a DDP communication hook and a plain function for custom loops.

    state = thc_hook_state(aggregator="127.0.0.1:50000", job_config="job.json")  # in-network
    state = thc_hook_state()                      # THC over dist.all_reduce(SUM), no switch
    model.register_comm_hook(state, thc_hook)
    ...
    state.close()                                 # also done at interpreter exit

The in-network path takes its settings from the job description the aggregator serves
(dataplane.config.SwitchConfig, e.g. written by `python -m dataplane.config local`): the
table (the worker's codec is built on it), pool_size, values_per_packet, the member count
(= the world size) and this rank's member address, which it binds (`worker_job`, the job
handshake; an explicit argument that disagrees raises at set-up, naming both values). The
aggregator is not asked: the switch programs have no query for it, so a job description
that differs from the one the aggregator was built from goes unnoticed here.

The hook averages each DDP gradient bucket with THCAllreduce and returns a
torch.futures.Future that the process's exchange thread completes (host.allreduce): the
hook returns at once, backward goes on with the next bucket while this one is exchanged,
as with DDP's own allreduce. The thread takes buckets one at a time in DDP's order (the
same on every worker), so they complete in order; an error in the exchange (a worker
that died, a timeout, a NaN gradient) reaches loss.backward()'s caller as an exception.
Launch with torchrun or torch.multiprocessing; the rank is the worker id on the
aggregator, the world size the job's member count.

For custom loops: `allreduce_gradients(model.parameters(), state)` averages every .grad in
place (flattened into one tensor, one exchange); with async_op=True it returns a Future
at once and the gradients are averaged when it completes.

Checkpoints: `state.state_dict()` (each rank its own: the error feedback is per worker)
saved with the model and optimizer, `state.load_state_dict(sd)` before the first step of
the resumed job: it continues bit for bit as the uninterrupted run (README, "Using THC
from your training loop"). A resumed job that did not restore it gets a ResumeWarning at
its first optimizer step.
"""
# No "from __future__ import annotations": DDP checks the hook's annotations as objects.

import atexit
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

import thc
from dataplane.config import SwitchConfig
from dataplane.ports import free_port
from host.allreduce import (DEFAULT_PIPELINE_VALUES, DEFAULT_PROBE_INTERVAL, AggregatorExchange,
                            SumAllreduceExchange, THCAllreduce, check_state_entries,
                            exchange_thread)
from host.dlcp.marking import DlcpPolicy
from host.transport import AggregatorTransport, parse_address
from thc.layout import DEFAULT_PARTITION_SIZE

INNETWORK_PARTITION_SIZE = 1 << 14     # RHT partition of the default in-network codec
JOB_CONFIG_ENV = "THC_JOB_CONFIG"      # the job description's path, e.g. under torchrun
DEFAULT_TIMEOUT = 10.0                 # seconds without progress before an exchange failed


HOOK_STATE_ENTRIES = frozenset({"allreduce", "bucket_sizes", "bucket_layouts", "steps"})
# DDP's Python reducer (compiled autograd) calls a hook per parameter with (grad, param),
# inside the graph it traces; THC's exchange (a thread, Numba kernels) cannot be traced.
COMPILED_AUTOGRAD_REFUSAL = (
    "thc_hook needs a DDP GradBucket, got a {}: DDP's python_reducer "
    "(torch._dynamo.config.optimize_ddp='python_reducer', which compiled autograd requires) "
    "calls hooks per parameter inside a traced graph, where THC's exchange cannot run. "
    "Compile the model with torch.compile and leave optimize_ddp and compiled_autograd at "
    "their defaults (DDP's C++ reducer calls the hook between compiled graphs)")


class JobMismatchError(ValueError):
    """This worker's settings disagree with the job description of its aggregator job."""


class ResumeWarning(UserWarning):
    """A resumed job whose THC hook state was not restored (THCHookState.load_state_dict)."""


class THCHookState:
    """What the hook needs between calls: the allreducer, per-bucket sizes and layouts, the
    step count; state_dict() / load_state_dict() checkpoint them (module docstring)."""

    def __init__(self, allreduce: THCAllreduce):
        self.allreduce = allreduce
        self.bucket_sizes: dict[int, int] = {}
        # Per bucket: its parameters in buffer order, by their place in the first step's
        # buckets (DDP's first step, the same in every process of a model). DDP rebuilds
        # its buckets after that step, possibly to the same size in another order.
        self.bucket_layouts: dict[int, tuple[int, ...]] = {}
        self.steps = 0
        # DDP steps reduced in this process: DDP rebuilds its buckets after its first one,
        # a collective on its own group that every rank must join (thc_hook).
        self.ddp_steps_here = 0
        self.closed = False
        self.restored = False             # load_state_dict ran
        self._param_index: dict[int, int] = {}      # id(parameter) -> place
        self._param_numel: dict[int, int] = {}      # place -> the parameter's numel
        self._regroup = False             # restored: map the first step's buckets on the saved ones
        self._resume_checked = False      # ResumeWarning decided (_check_resumed)
        _OPEN_STATES.add(self)
        _watch_optimizer_steps()

    def close(self) -> None:
        """Stop the process's exchange thread once the calls already submitted ran, then
        close the aggregator socket and THC's own process group. Idempotent; it also runs
        at interpreter exit for every state still open (a thread left inside torch or
        Numba while the interpreter tears them down can abort the process). A later
        reduce on this state raises."""
        if self.closed:
            return
        self.closed = True
        stopped = exchange_thread().stop()
        # A call still stuck in a collective keeps its group: destroying it under the call
        # could crash the process.
        self.allreduce.close(destroy_group=stopped)

    @property
    def bytes_sent(self) -> int:
        """Gradient bytes this worker sent (AGG headers + payloads, or lane bytes)."""
        return self.allreduce.exchange.bytes_sent + self.allreduce.control_bytes + \
            self.allreduce.collective_bytes

    def reduce(self, tensor: torch.Tensor, key: int) -> torch.Tensor:
        """The THC mean of `tensor` (blocks until it is in)."""
        return self.reduce_async(tensor, key).wait()

    def reduce_async(self, tensor: torch.Tensor, key: int, then=None,
                     layout: tuple[int, ...] | None = None,
                     agree_at_end: bool = False) -> torch.futures.Future:
        """A Future of the THC mean of `tensor`, computed on the exchange thread (and of
        then(mean) when given, run there too). layout: the tensor's parameters
        (layout_of); a key whose size or layout changed restarts its error feedback.
        agree_at_end: the call ends with every worker's agreement (THCAllreduce.submit)."""
        if self.closed:
            raise RuntimeError("this THCHookState was closed (close()); build a new one with "
                               "thc_hook_state")
        size = tensor.numel()
        # DDP rebuilds its buckets after the first step: the old error no longer fits.
        resized = self.bucket_sizes.get(key, size) != size or \
            (layout is not None and self.bucket_layouts.get(key, layout) != layout)
        self.bucket_sizes[key] = size
        if layout is not None:
            self.bucket_layouts[key] = layout
        # DDP fills bucket 0 from the model's last layers, so the highest bucket index holds
        # the front layers: they get the highest DLCP band (layer 0).
        num_buckets = max(self.bucket_sizes) + 1
        return self.allreduce.submit(tensor, key, layer=num_buckets - 1 - key,
                                     num_layers=num_buckets, reset_error=resized, then=then,
                                     agree_at_end=agree_at_end)

    # ----------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict:
        """What this worker needs to continue training exactly, for torch.save (CPU tensors
        and plain values): THCAllreduce.state_dict() (error feedback per bucket, round
        counters, codec settings, world size, rank) and the buckets' sizes and layouts and
        the step count. Waits for the exchanges already submitted. It is this rank's own:
        save one per rank, next to the model and optimizer."""
        if not self.closed and not exchange_thread().on_thread():
            exchange_thread().submit(_nothing).wait()
        return {"allreduce": self.allreduce.state_dict(), "bucket_sizes": dict(self.bucket_sizes),
                "bucket_layouts": {k: list(v) for k, v in self.bucket_layouts.items()},
                "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict() of the same rank: call before the first step, after
        building the hook state as the saved job did. Refuses other settings, world size
        or rank (THCAllreduce.load_state_dict). DDP's first step in a new process presents
        its initial buckets, not the rebuilt ones that were saved: that step is reduced in
        the saved buckets (same keys, errors and rounds) and mapped back, so the run goes
        on as if never interrupted."""
        check_state_entries(state, HOOK_STATE_ENTRIES, "THCHookState")
        if self.steps or self.bucket_sizes:
            raise RuntimeError("load_state_dict after this hook state already reduced "
                               "gradients: load the checkpoint before the first step")
        self.allreduce.load_state_dict(state["allreduce"])
        self.bucket_sizes = {int(k): int(v) for k, v in state["bucket_sizes"].items()}
        self.bucket_layouts = {int(k): tuple(int(i) for i in v)
                               for k, v in state["bucket_layouts"].items()}
        self.steps = int(state["steps"])
        self.restored = True
        self._regroup = bool(self.bucket_layouts)

    def _check_resumed(self, optimizer) -> None:
        """At the first optimizer step over this state's parameters: an optimizer makes its
        per-parameter state (momentum, Adam's moments and step) during its own first step,
        so state already there was loaded from a checkpoint; if this hook state was not,
        warn once (ResumeWarning). An optimizer with no per-parameter state (SGD without
        momentum) shows nothing: such a job is not noticed."""
        ours = [p for group in optimizer.param_groups for p in group["params"]
                if id(p) in self._param_index]
        if not ours:
            return                 # before this state's first exchange, or another model's
        self._resume_checked = True
        if not self.restored and any(optimizer.state.get(p) for p in ours):
            warnings.warn(ResumeWarning(
                "this job resumes from a checkpoint (the optimizer's state was loaded) but "
                "its THC hook state was not: error feedback and rounds restart from zero, so "
                "training goes on but not as the uninterrupted run would. Save "
                "state.state_dict() with the checkpoint on every rank and call "
                "state.load_state_dict(...) before the first step"), stacklevel=4)

    def layout_of(self, params) -> tuple[int, ...]:
        """The parameters' places in the first step's buckets (new ones numbered on)."""
        index, numel = self._param_index, self._param_numel
        layout = tuple(index.setdefault(id(p), len(index)) for p in params)
        for i, p in zip(layout, params):
            numel[i] = p.numel()
        return layout

    def reduce_bucket(self, buffer: torch.Tensor, key: int, params) -> torch.futures.Future:
        """A DDP bucket's mean; on the first step after load_state_dict, through the saved
        buckets it is made of (reduce_regrouped) when DDP presents other ones.

        DDP's first step in a process ends its calls with the end agreement: DDP rebuilds
        its buckets right after it, a collective on DDP's process group, which a worker
        that got every sum would enter while one lacking some still waited in THC's next
        control exchange for its rescue: each waiting for the other (the deferred
        agreement, THCAllreduce). Later steps defer it: their next collective is the next
        step's THC exchange."""
        layout = self.layout_of(params)
        if self._regroup and self.bucket_layouts.get(key) != layout:
            parts = self._saved_parts(layout)
            if parts is not None:
                return self.reduce_regrouped(buffer, layout, parts)
            warnings.warn(ResumeWarning(
                f"DDP bucket {key} ({buffer.numel()} values) is made of no whole saved "
                f"buckets of the restored THC state (saved sizes {self.bucket_sizes}): its "
                "error feedback restarts, so training goes on but not bit for bit as the "
                "uninterrupted run"), stacklevel=3)
        return self.reduce_async(buffer, key, layout=layout,
                                 agree_at_end=self.ddp_steps_here == 0)

    def _saved_parts(self, layout: tuple[int, ...]) -> list[int] | None:
        """The saved bucket keys whose parameters together are exactly `layout`'s, or None."""
        inside = set(layout)
        keys = [k for k, saved in sorted(self.bucket_layouts.items()) if set(saved) <= inside]
        covered = [i for k in keys for i in self.bucket_layouts[k]]
        if not keys or len(covered) != len(inside) or set(covered) != inside:
            return None
        return keys

    def reduce_regrouped(self, buffer: torch.Tensor, layout: tuple[int, ...],
                         keys: list[int]) -> torch.futures.Future:
        """Reduce `buffer` (parameters `layout`) as the saved buckets `keys` would be: each
        one's values gathered in its saved order, reduced under its key (in key order, as
        DDP issues them), and the means scattered back into `buffer`'s order."""
        numel = self._param_numel
        starts, offset = {}, 0
        for i in layout:
            starts[i] = offset
            offset += numel[i]

        def values(k):                     # saved bucket k's slices of the buffer, in order
            return [(starts[i], starts[i] + numel[i]) for i in self.bucket_layouts[k]]

        def scatter(last_mean):            # on the exchange thread, after every key's mean
            out = torch.empty_like(buffer)
            means = [f.value() for f in earlier] + [last_mean]
            for k, mean in zip(keys, means):
                at = 0
                for lo, hi in values(k):
                    out[lo:hi] = mean[at:at + hi - lo]
                    at += hi - lo
            return out

        earlier = []
        for n, k in enumerate(keys):
            gathered = torch.cat([buffer[lo:hi] for lo, hi in values(k)])
            last = n + 1 == len(keys)
            # Only on DDP's first step in this process (after a resume): its end agreement.
            fut = self.reduce_async(gathered, k, layout=self.bucket_layouts[k],
                                    then=scatter if last else None, agree_at_end=True)
            if not last:
                earlier.append(fut)
        return fut


def thc_hook(state: THCHookState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: a Future of the THC mean of the bucket's flattened gradients.

    An error in the exchange makes loss.backward() raise a RuntimeError that names it
    (DDP rethrows a failed future as RuntimeError, "...: <ExceptionType>: <message>")."""
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(COMPILED_AUTOGRAD_REFUSAL.format(type(bucket).__name__))
    fut = state.reduce_bucket(bucket.buffer(), bucket.index(), bucket.parameters())
    if bucket.is_last():
        state.steps += 1
        state.ddp_steps_here += 1
        state._regroup = False        # DDP's buckets of a new process differ on its first step only
    # A C++-level error, so DDP raises it: a Python future's exception is only a value
    # to DDP, which then fails to cast it to a tensor. A callback that raises sets one.
    return fut.then(_value)


def _value(fut):
    return fut.value()


def _nothing():
    return None


def allreduce_gradients(parameters, state: THCHookState, key: int = 0, *,
                        async_op: bool = False):
    """Average the .grad of `parameters` over all workers in place (one THC exchange).

    async_op=True: return a torch.futures.Future at once; the gradients hold the mean
    when it completes (wait() raises what the exchange raised). Do not touch them before.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        raise ValueError("no parameter has a gradient: call backward() first")
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    state.layout_of(params)                # known parameters (the ResumeWarning check)

    def write_back(mean):                  # on the exchange thread
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(mean[offset:offset + n].view_as(p.grad))
            offset += n
    done = state.reduce_async(flat, key, then=write_back)
    state.steps += 1
    if async_op:
        return done
    done.wait()
    return None


def thc_hook_state(*, aggregator=None, job_config=None, job: int = 1,
                   pool_size: int | None = None, worker_address=None,
                   codec: thc.THCCodec | None = None, group=None,
                   timeout: float = DEFAULT_TIMEOUT, policy=None,
                   error_feedback: bool = True,
                   values_per_packet: int | None = None, seed: int = 0,
                   start_timeout: float = 60.0,
                   pipeline_values: int = DEFAULT_PIPELINE_VALUES,
                   error_domain: str = "rotated", loss_bound: float = 0.0,
                   loss_wait: float = 2.0, nonfinite: str = "raise",
                   fallback: str = "collective",
                   probe_interval: float = DEFAULT_PROBE_INTERVAL) -> THCHookState:
    """Build the hook state on this worker (call after dist.init_process_group).

    aggregator: None for THC over dist.all_reduce(SUM) (gloo/NCCL, no switch), or the
    aggregator's "HOST:PORT" / (host, port) for the in-network path, which needs
    job_config: the job description the aggregator serves (a path, or a
    dataplane.config.SwitchConfig; default: the THC_JOB_CONFIG environment variable) and
    job, its job id. From it come, by default, the codec's table, pool_size,
    values_per_packet and this worker's address (the member whose worker id is the rank;
    the world size must be the member count); codec, pool_size, values_per_packet and
    worker_address, when given, must agree with it (`worker_job`). codec: a thc.THCCodec
    identical on every worker (default: b=4, p=1/32, this seed, the job's table or g=30;
    RHT partitions of 2^14 values in-network, so that DLCP can rank a bucket's partitions,
    else 2^20). start_timeout: seconds the first call waits for every worker (the error
    names the missing rank); timeout: seconds without progress in an aggregator exchange
    before it counts as failed (default 10: the time to notice a silent aggregator or a
    dead worker; raise it where a worker may stall that long, e.g. on a crowded machine).
    fallback: what a call does when the aggregator does not answer on any worker
    (AggregatorTimeout after `timeout`, or AggregatorUnreachable at once): "collective"
    (default) redoes it over the process group's all_reduce with the same THC codec and
    rounds (identical means and error feedback on every worker), warns once, keeps using
    the collective, and goes back to the aggregator, after a FLUSH of the job's slots,
    once every worker's probe is answered (a probe every probe_interval seconds, default
    10; host.allreduce.THCAllreduce); "raise" raises AggregatorTimeout /
    AggregatorUnreachable instead. A worker that dies makes the others' call raise
    host.allreduce.WorkerLostError naming its rank (a roll call of its heartbeat, about
    3 s once the call failed: at once in a collective, after `timeout` in an exchange).
    policy: the per-packet DSCP/ECN hook of the in-network path; default
    DLCP marking (host.dlcp.DlcpPolicy: front buckets in higher bands, every packet of an
    RHT partition whose RMS is above the median ECT); host.transport.default_policy turns
    marking off. pipeline_values: padded values per pipeline chunk of a large tensor
    (quantize the next chunk while this one is on the wire; 0 = whole tensors), the same on
    every worker. group: the process group of the control exchanges (default: one of THC's
    own over all ranks, made at the first call); with a group of yours, issue no
    collectives of your own on it while an exchange is pending. error_domain: where the
    error feedback lives, "rotated" (after the RHT, one inverse RHT per call: faster) or
    "gradient" (the paper's order, the max-norm exchange overlaps the RHT).
    loss_bound: DLCP's bounded loss p on the in-network path (0 = exact, the default): a
    tensor may finish once (1 - p) of its chunks came back with every contributor; after
    one re-request of the others and loss_wait retransmission timeouts (default 2; 0 =
    finish at once, as DLCP's receiver does) the chunks back at no worker decode as zero
    in the rotated domain on every worker, each worker's own share of them going back into
    its error feedback; a chunk back at some workers only makes the call's sums come over
    the collective (docs/dlcp.md, "DLCP on the in-network THC path"). nonfinite: "raise" (default: a NaN/Inf gradient on any worker
    makes every worker's backward raise thc.NonFiniteError) or "propagate" (every worker's
    averaged bucket is all inf for that step, error feedback untouched: what a
    torch.amp.GradScaler needs to skip the step everywhere).
    """
    if not dist.is_initialized():
        raise RuntimeError("call torch.distributed.init_process_group before thc_hook_state")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if aggregator is None:
        if codec is None:
            codec = thc.THCCodec(seed=seed, partition_size=DEFAULT_PARTITION_SIZE)
        exchange = SumAllreduceExchange(codec, group)
    else:
        if job_config is None:
            job_config = os.environ.get(JOB_CONFIG_ENV)
        if job_config is None:
            raise ValueError(
                f"aggregator={aggregator!r} needs the job description that aggregator serves: "
                "pass job_config=\"job.json\" (or a dataplane.config.SwitchConfig), or set "
                f"{JOB_CONFIG_ENV}=job.json; write one with `python -m dataplane.config local "
                f"--workers {world} -o job.json`")
        spec = worker_job(job_config, job=job, rank=rank, world=world, codec=codec,
                          pool_size=pool_size, values_per_packet=values_per_packet,
                          worker_address=worker_address, seed=seed)
        codec = spec.codec
        codec.check_workers(world)          # 8-bit lanes on the switch: refuse n*g > 255
        transport = AggregatorTransport(parse_address(aggregator), job=job, worker=rank,
                                        expected=spec.expected, pool_size=spec.pool_size,
                                        values_per_packet=spec.values_per_packet,
                                        timeout=timeout, local=spec.address,
                                        policy=DlcpPolicy() if policy is None else policy)
        exchange = AggregatorExchange(transport, codec)
    return THCHookState(THCAllreduce(codec, exchange, group=group, error_feedback=error_feedback,
                                     start_timeout=start_timeout,
                                     pipeline_values=pipeline_values,
                                     error_domain=error_domain, loss_bound=loss_bound,
                                     loss_wait=loss_wait, nonfinite=nonfinite,
                                     fallback=fallback, probe_interval=probe_interval))


@dataclass(frozen=True)
class WorkerJob:
    """A worker's side of its aggregator job, as the job description gives it."""
    job: int
    worker: int
    codec: thc.THCCodec               # its table is the job's table
    pool_size: int
    values_per_packet: int
    expected: int                     # bitmap of the job's member worker ids
    address: tuple[str, int]          # this member's (ip, udp_port): the worker binds it


def worker_job(job_config, *, job: int, rank: int, world: int, codec=None, pool_size=None,
               values_per_packet=None, worker_address=None, seed: int = 0,
               partition_size: int = INNETWORK_PARTITION_SIZE) -> WorkerJob:
    """The job handshake of worker `rank` of `world` (no torch.distributed needed).

    job_config: a path or a dataplane.config.SwitchConfig. Each explicit argument must
    agree with job `job` of it (pool_size equal, values_per_packet at most the job's: its
    slots hold that many values; worker_address, and THC_WORKER_IP / THC_WORKER_PORT_BASE
    when set, equal to the member's address; codec's table equal to the job's, since the
    aggregator adds the job's table values); else JobMismatchError names both values and
    what to change. Left out, each comes from the job (codec: on the job's table).
    """
    config, source = _load_job_config(job_config)
    try:
        spec = config.job(job)
    except KeyError:
        raise JobMismatchError(f"job={job} is not in {source} (its jobs: "
                               f"{[j.job for j in config.jobs]}): pass job= one of them") \
            from None
    what = f"job {job} of {source}"
    if world != spec.member_count:
        raise JobMismatchError(
            f"{world} workers (the world size) but {what} has {spec.member_count} members: "
            f"launch {spec.member_count} workers, or write the job description for {world} "
            f"(python -m dataplane.config local --workers {world} ...)")
    member = next((m for m in spec.members if m.worker == rank), None)
    if member is None:
        raise JobMismatchError(f"rank {rank} is not a worker id of {what} (its worker ids: "
                               f"{sorted(m.worker for m in spec.members)}): number the "
                               f"members 0..{world - 1}, the ranks")
    address = (member.ip, member.udp_port)
    _check_worker_address(worker_address, "worker_address", address, rank, what)
    _check_worker_address(_worker_address_from_env(rank), "THC_WORKER_IP/THC_WORKER_PORT_BASE",
                          address, rank, what)
    if pool_size is not None and pool_size != spec.pool_size:
        raise JobMismatchError(
            f"pool_size={pool_size} but {what} has pool_size {spec.pool_size}: leave "
            "pool_size out (the job's is used) or change the job description")
    vpp = spec.values_per_packet if values_per_packet is None else values_per_packet
    if vpp > spec.values_per_packet:
        raise JobMismatchError(
            f"values_per_packet={vpp} but {what} has values_per_packet "
            f"{spec.values_per_packet} (its slots hold no more; the aggregator drops longer "
            "packets as drop_bad_length): leave values_per_packet out or lower it")
    table = np.asarray(spec.table)
    if codec is None:
        codec = thc.THCCodec(granularity=int(table[-1]), table=table, seed=seed,
                             partition_size=partition_size)
    elif not np.array_equal(np.asarray(codec.table), table):
        raise JobMismatchError(
            f"codec table {np.asarray(codec.table).tolist()} (granularity "
            f"{codec.granularity}) but {what} has table {table.tolist()} (granularity "
            f"{int(table[-1])}): the aggregator adds the job's table values, so every mean "
            "would be wrong; leave codec out (it is built on the job's table) or build it "
            f"with thc.THCCodec(granularity={int(table[-1])}, table=<the job's table>)")
    return WorkerJob(job, rank, codec, spec.pool_size, vpp, spec.member_mask, address)


def _load_job_config(job_config) -> tuple[SwitchConfig, str]:
    """(the validated description, how messages name it) from a path or a SwitchConfig."""
    if isinstance(job_config, SwitchConfig):
        return job_config.validate(), "the job description passed as job_config"
    if isinstance(job_config, (str, Path)):
        return SwitchConfig.load(job_config).validate(), f"job description {str(job_config)!r}"
    raise TypeError(f"job_config must be a path or a dataplane.config.SwitchConfig, got "
                    f"{type(job_config).__name__}")


def _check_worker_address(given, name: str, address, rank: int, what: str) -> None:
    """A given (ip, port) must be the member's; an ip of 0.0.0.0 (THC_WORKER_IP unset)
    matches any."""
    if given is None:
        return
    ip, port = str(given[0]), int(given[1])
    if port != address[1] or ip not in ("0.0.0.0", address[0]):
        raise JobMismatchError(
            f"{name} gives {ip}:{port} but {what} binds worker {rank} to "
            f"{address[0]}:{address[1]}: leave {name} out (each worker binds its member's "
            "address) or change the member in the job description")


def _worker_address_from_env(rank: int):
    """(THC_WORKER_IP or 0.0.0.0, THC_WORKER_PORT_BASE + rank) when set (older launch
    scripts; worker_job checks it against the member's address), else None."""
    base = os.environ.get("THC_WORKER_PORT_BASE")
    if not base:
        return None
    if not base.isdigit() or not 0 < int(base) + rank < 65536:
        raise ValueError(f"THC_WORKER_PORT_BASE={base!r}: need a port number such that "
                         f"base + rank ({rank}) is in 1..65535")
    return os.environ.get("THC_WORKER_IP", "0.0.0.0"), int(base) + rank


_OPEN_STATES: "weakref.WeakSet[THCHookState]" = weakref.WeakSet()
_OPTIMIZER_WATCH = None         # handle of the optimizer step pre-hook (_watch_optimizer_steps)


def _watch_optimizer_steps() -> None:
    """Watch optimizer steps until every open hook state has seen its first one: a resumed
    job whose hook state was not restored warns then (THCHookState._check_resumed)."""
    global _OPTIMIZER_WATCH
    if _OPTIMIZER_WATCH is None:
        _OPTIMIZER_WATCH = register_optimizer_step_pre_hook(_on_optimizer_step)


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    global _OPTIMIZER_WATCH
    waiting = [s for s in list(_OPEN_STATES) if not s._resume_checked]
    for state in waiting:
        state._check_resumed(optimizer)
    if all(s._resume_checked for s in waiting) and _OPTIMIZER_WATCH is not None:
        _OPTIMIZER_WATCH.remove()       # nothing left to check: no cost on later steps
        _OPTIMIZER_WATCH = None


@atexit.register
def _close_open_states() -> None:
    """Close every state still open, and stop the exchange thread, before the interpreter
    tears torch and Numba down (THCHookState.close)."""
    for state in list(_OPEN_STATES):
        state.close()
    exchange_thread().stop()


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A port nobody uses right now (for tests and the main job's member table):
    dataplane.ports.free_port, which is free for TCP too."""
    return free_port(host)


__all__ = ["THCHookState", "thc_hook", "thc_hook_state", "allreduce_gradients",
           "free_udp_port", "worker_job", "WorkerJob", "JobMismatchError", "ResumeWarning",
           "JOB_CONFIG_ENV"]
