"""PyTorch integration: a DDP communication hook and a plain function for custom loops.

    state = thc_hook_state(aggregator="127.0.0.1:50000", job=1, pool_size=256)  # in-network
    state = thc_hook_state()                      # THC over dist.all_reduce(SUM), no switch
    model.register_comm_hook(state, thc_hook)

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

import os
import socket

import torch
import torch.distributed as dist

import thc
from host.allreduce import (DEFAULT_PIPELINE_VALUES, AggregatorExchange, SumAllreduceExchange,
                            THCAllreduce)
from host.dlcp.marking import DlcpPolicy
from host.transport import AggregatorTransport, parse_address
from thc.layout import DEFAULT_PARTITION_SIZE

DEFAULT_POOL_SIZE = 256
INNETWORK_PARTITION_SIZE = 1 << 14     # RHT partition of the default in-network codec


class THCHookState:
    """What the hook needs between calls: the allreducer and per-bucket sizes."""

    def __init__(self, allreduce: THCAllreduce):
        self.allreduce = allreduce
        self.bucket_sizes: dict[int, int] = {}
        self.steps = 0

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


def thc_hook_state(*, aggregator=None, job: int = 1, pool_size: int = DEFAULT_POOL_SIZE,
                   worker_address=None, codec: thc.THCCodec | None = None, group=None,
                   timeout: float = 30.0, policy=None, error_feedback: bool = True,
                   values_per_packet: int = 1024, seed: int = 0,
                   start_timeout: float = 60.0,
                   pipeline_values: int = DEFAULT_PIPELINE_VALUES,
                   error_domain: str = "rotated", loss_bound: float = 0.0,
                   loss_wait: float = 2.0) -> THCHookState:
    """Build the hook state on this worker (call after dist.init_process_group).

    aggregator: None for THC over dist.all_reduce(SUM) (gloo/NCCL, no switch), or the
    aggregator's "HOST:PORT" / (host, port) for the in-network path. worker_address:
    (ip, port) this worker binds, as installed in the aggregator's membership table
    (default: THC_WORKER_IP / THC_WORKER_PORT_BASE + rank from the environment, as under
    torchrun; else any port). codec: a thc.THCCodec identical on every worker
    (default: b=4, g=30, p=1/32, this seed; RHT partitions of 2^14 values in-network, so
    that DLCP can rank a bucket's partitions, else 2^20). start_timeout: seconds the first
    call waits for every worker (the error names the missing rank); timeout: seconds
    without progress in an exchange before AggregatorTimeout. policy: the per-packet
    DSCP/ECN hook of the in-network path; default DLCP marking (host.dlcp.DlcpPolicy: front
    buckets in higher bands, every packet of an RHT partition whose RMS is above the
    median ECT); host.transport.default_policy turns marking off. pipeline_values: padded
    values per pipeline chunk of a large tensor (quantize the next chunk while this one is
    on the wire; 0 = whole tensors), the same on every worker. group: the process group of
    the control exchanges (default: one of THC's own over all ranks, made at the first
    call); with a group of yours, issue no collectives of your own on it while an
    exchange is pending. error_domain: where the error feedback lives, "rotated" (after the RHT, one inverse RHT per call: faster) or
    "gradient" (the paper's order, the max-norm exchange overlaps the RHT).
    loss_bound: DLCP's bounded loss p on the in-network path (0 = exact, the default): a
    tensor may finish once (1 - p) of its chunks came back with every contributor; after
    one re-request of the others and loss_wait retransmission timeouts (default 2; 0 =
    finish at once, as DLCP's receiver does) the rest decodes as zero in the rotated
    domain, every worker agreeing on the same lost chunks first, and each worker's own
    share of them goes back into its error feedback (docs/dlcp.md, "DLCP on the
    in-network THC path").
    """
    if not dist.is_initialized():
        raise RuntimeError("call torch.distributed.init_process_group before thc_hook_state")
    if codec is None:
        # In-network, the DLCP marks rank RHT partitions: smaller ones than the codec's
        # default, so that a bucket has several (docs/dlcp.md, the in-network section).
        codec = thc.THCCodec(seed=seed, partition_size=DEFAULT_PARTITION_SIZE if aggregator
                             is None else INNETWORK_PARTITION_SIZE)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if aggregator is None:
        exchange = SumAllreduceExchange(codec, group)
    else:
        codec.check_workers(world)          # 8-bit lanes on the switch: refuse n*g > 255
        if world > 32:
            raise ValueError(f"{world} workers: an aggregator job has at most 32 members")
        host, port = parse_address(aggregator)
        local = worker_address or _worker_address_from_env(rank) or \
            ("127.0.0.1" if host.startswith("127.") else "0.0.0.0", 0)
        transport = AggregatorTransport((host, port), job=job, worker=rank,
                                        expected=(1 << world) - 1, pool_size=pool_size,
                                        values_per_packet=values_per_packet, timeout=timeout,
                                        local=local,
                                        policy=DlcpPolicy() if policy is None else policy)
        exchange = AggregatorExchange(transport, codec)
    return THCHookState(THCAllreduce(codec, exchange, group=group, error_feedback=error_feedback,
                                     start_timeout=start_timeout,
                                     pipeline_values=pipeline_values,
                                     error_domain=error_domain, loss_bound=loss_bound,
                                     loss_wait=loss_wait))


def _worker_address_from_env(rank: int):
    """(THC_WORKER_IP or 0.0.0.0, THC_WORKER_PORT_BASE + rank) under torchrun, else None."""
    base = os.environ.get("THC_WORKER_PORT_BASE")
    if not base:
        return None
    if not base.isdigit() or not 0 < int(base) + rank < 65536:
        raise ValueError(f"THC_WORKER_PORT_BASE={base!r}: need a port number such that "
                         f"base + rank ({rank}) is in 1..65535")
    return os.environ.get("THC_WORKER_IP", "0.0.0.0"), int(base) + rank


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port nobody uses right now (for tests and the main job's member table)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


__all__ = ["THCHookState", "thc_hook", "thc_hook_state", "allreduce_gradients",
           "free_udp_port"]
