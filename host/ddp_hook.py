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
"""
# No "from __future__ import annotations": DDP checks the hook's annotations as objects.

import atexit
import os
import socket
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import thc
from dataplane.config import SwitchConfig
from host.allreduce import (DEFAULT_PIPELINE_VALUES, AggregatorExchange, SumAllreduceExchange,
                            THCAllreduce, exchange_thread)
from host.dlcp.marking import DlcpPolicy
from host.transport import AggregatorTransport, parse_address
from thc.layout import DEFAULT_PARTITION_SIZE

INNETWORK_PARTITION_SIZE = 1 << 14     # RHT partition of the default in-network codec
JOB_CONFIG_ENV = "THC_JOB_CONFIG"      # the job description's path, e.g. under torchrun


class JobMismatchError(ValueError):
    """This worker's settings disagree with the job description of its aggregator job."""


class THCHookState:
    """What the hook needs between calls: the allreducer and per-bucket sizes."""

    def __init__(self, allreduce: THCAllreduce):
        self.allreduce = allreduce
        self.bucket_sizes: dict[int, int] = {}
        self.steps = 0
        self.closed = False
        _OPEN_STATES.add(self)

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
        return self.allreduce.exchange.bytes_sent + self.allreduce.control_bytes

    def reduce(self, tensor: torch.Tensor, key: int) -> torch.Tensor:
        """The THC mean of `tensor` (blocks until it is in)."""
        return self.reduce_async(tensor, key).wait()

    def reduce_async(self, tensor: torch.Tensor, key: int, then=None) -> torch.futures.Future:
        """A Future of the THC mean of `tensor`, computed on the exchange thread (and of
        then(mean) when given, run there too)."""
        if self.closed:
            raise RuntimeError("this THCHookState was closed (close()); build a new one with "
                               "thc_hook_state")
        size = tensor.numel()
        # DDP rebuilds its buckets after the first step: the old error no longer fits.
        resized = self.bucket_sizes.get(key, size) != size
        self.bucket_sizes[key] = size
        # DDP fills bucket 0 from the model's last layers, so the highest bucket index holds
        # the front layers: they get the highest DLCP band (layer 0).
        num_buckets = max(self.bucket_sizes) + 1
        return self.allreduce.submit(tensor, key, layer=num_buckets - 1 - key,
                                     num_layers=num_buckets, reset_error=resized, then=then)


def thc_hook(state: THCHookState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: a Future of the THC mean of the bucket's flattened gradients.

    An error in the exchange makes loss.backward() raise a RuntimeError that names it
    (DDP rethrows a failed future as RuntimeError, "...: <ExceptionType>: <message>")."""
    fut = state.reduce_async(bucket.buffer(), bucket.index())
    if bucket.is_last():
        state.steps += 1
    # A C++-level error, so DDP raises it: a Python future's exception is only a value
    # to DDP, which then fails to cast it to a tensor. A callback that raises sets one.
    return fut.then(_value)


def _value(fut):
    return fut.value()


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
                   timeout: float = 30.0, policy=None, error_feedback: bool = True,
                   values_per_packet: int | None = None, seed: int = 0,
                   start_timeout: float = 60.0,
                   pipeline_values: int = DEFAULT_PIPELINE_VALUES,
                   error_domain: str = "rotated", loss_bound: float = 0.0,
                   loss_wait: float = 2.0, nonfinite: str = "raise") -> THCHookState:
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
    names the missing rank); timeout: seconds without progress in an exchange before
    AggregatorTimeout. policy: the per-packet DSCP/ECN hook of the in-network path; default
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
    finish at once, as DLCP's receiver does) the rest decodes as zero in the rotated
    domain, every worker agreeing on the same lost chunks first, and each worker's own
    share of them goes back into its error feedback (docs/dlcp.md, "DLCP on the
    in-network THC path"). nonfinite: "raise" (default: a NaN/Inf gradient on any worker
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
                                     loss_wait=loss_wait, nonfinite=nonfinite))


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


@atexit.register
def _close_open_states() -> None:
    """Close every state still open, and stop the exchange thread, before the interpreter
    tears torch and Numba down (THCHookState.close)."""
    for state in list(_OPEN_STATES):
        state.close()
    exchange_thread().stop()


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port nobody uses right now (for tests and the main job's member table)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


__all__ = ["THCHookState", "thc_hook", "thc_hook_state", "allreduce_gradients",
           "free_udp_port", "worker_job", "WorkerJob", "JobMismatchError", "JOB_CONFIG_ENV"]
