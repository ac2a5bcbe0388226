"""THC as FSDP2's reduce-scatter: `THCReduceScatter` and `thc_fully_shard_comm`.

    for layer in model: fully_shard(layer)
    fully_shard(model)
    state = thc_fully_shard_comm(model)               # THC over the process group
    state = thc_fully_shard_comm(model, {"aggregator": "127.0.0.1:50000",
                                         "job_config": "job.json"})   # through an aggregator
    module.set_custom_reduce_scatter(THCReduceScatter(state))   # or one FSDPModule by hand

What FSDP2 hands a ReduceScatter (torch 2.13, `foreach_reduce` in
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): one flat input of W * S values,
row r of `input.view(W, S)` being rank r's shard of every gradient of the module (each
padded on dim 0 to a multiple of W), in the reduce dtype (the gradients' dtype unless
MixedPrecisionPolicy.reduce_dtype says otherwise); an output of S values from `allocate`;
the shard group; and the op. The op says where FSDP divides: AVG (float32/bfloat16, the
default: FSDP divides nowhere else), SUM (float16 or set_force_sum_reduction_for_comms:
FSDP divides the input before and the output after) or PREMUL_SUM(1/f)
(set_gradient_divide_factor(f)). THC's result is the mean, so it is scaled by 1, W or
W/f to give what the op asks for.

Shards and RHT partitions: each rank's shard is coded as a vector of its own, padded to
whole RHT partitions (P = codec.padded_length(S) values) and laid out back to back (shard
r at [r*P, (r+1)*P)). A rotation therefore never mixes two ranks' shards: rank r's output
is exactly what THCAllreduce would give for shard r alone (own max norms, own rounding key
`key + r * CHUNK_KEY_STRIDE`, as a pipeline chunk of host/allreduce.py), and rank r
decodes (inverse RHT) only its own P values, 1/W of the work of decoding the whole input.
Partitions cut over the concatenated input instead would straddle two shards whenever S
is not a multiple of the partition size, so every rank would have to decode both. The
price is the padding of each shard's tail partition to its power of two, which
thc_fully_shard_comm keeps small with partitions of FSDP_PARTITION_SIZE values.

The integer sums (table values, as host/allreduce.py describes):
* over the process group (a state built without an aggregator): the lanes of all W shards
  go into one dist.reduce_scatter_single(SUM) (torch 2.13's name for reduce_scatter_tensor)
  on the state's lane type (uint8 where W*g <= 255, else int32). gloo reduce-scatters
  both (as NCCL does), so no all_reduce is needed: each rank receives only its own
  shard's P sums and sends (W-1)/W of the lanes, half of what an allreduce sends;
* through the aggregator: every rank contributes to every shard, so all W shards' packed
  indices go up as one tensor; the aggregator multicasts every sum back, and each rank
  decodes only its own shard's. DLCP marks these packets by the magnitude of the rotated
  values they carry (host/dlcp/marking.py), the front FSDP modules in the higher bands.

Error feedback lives per FSDP buffer (one per THCReduceScatter, i.e. per FSDPModule, as
the DDP hook keeps it per bucket), in the rotated domain: W*P floats, this worker's
quantization error for every shard it sent, added into the next call's rotation. It is
dropped when the buffer's size changes.

A call runs on the calling thread (FSDP calls it synchronously inside its reduce-scatter
stream) with the state's collectives on the state's group (THC's own by default, so they
never interleave with FSDP's all-gathers). A module's buffer goes in one piece (no
pipelining); error_domain="gradient" and loss_bound > 0 are refused when the
THCReduceScatter is built.
"""
from __future__ import annotations

import itertools
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import thc
from host.allreduce import (CHUNK_KEY_STRIDE, SUPPORTED_DTYPES, AllreduceError,
                            SumAllreduceExchange, THCAllreduce, _all_finite, _flat_float32)
from host.ddp_hook import INNETWORK_PARTITION_SIZE, THCHookState, thc_hook_state

FSDP_KEY_BASE = 1 << 16       # tensor keys of FSDP buffers (a DDP hook's buckets use 0, 1, ..)
# RHT partition of the codec thc_fully_shard_comm builds: a shard's tail is padded to its
# own power of two, so small partitions keep the padding of a shard small (a 2^20
# partition nearly doubles a 33 K-value shard); the in-network path's default as well.
FSDP_PARTITION_SIZE = INNETWORK_PARTITION_SIZE

# Per THCAllreduce: the next FSDP buffer key. Every rank builds its reduce-scatters in the
# same order (the module order), so the same buffer gets the same key everywhere.
_NEXT_KEY: "weakref.WeakKeyDictionary[THCAllreduce, itertools.count]" = \
    weakref.WeakKeyDictionary()


class THCReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter with THC, attached to one FSDPModule with
    `module.set_custom_reduce_scatter(THCReduceScatter(state))`.

    state: a host.ddp_hook.THCHookState (thc_hook_state(...)) or a THCAllreduce; its
    world must be the FSDP shard group's. Give each FSDPModule its own instance (its
    error feedback and tensor key); layer / num_layers: its place among them for DLCP's
    bands on the in-network path (thc_fully_shard_comm sets both).
    """

    def __init__(self, state, *, layer: int = 0, num_layers: int = 1):
        allreduce = _allreduce_of(state)
        ef = allreduce.error_feedback
        if ef is not None and not ef.rotated:
            raise ValueError("THCReduceScatter keeps error feedback in the rotated domain: "
                             "build the state with error_domain=\"rotated\" (the default)")
        if allreduce.loss_bound:
            raise ValueError(f"THCReduceScatter decodes exact sums: build the state with "
                             f"loss_bound=0 (got {allreduce.loss_bound})")
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer must be in 0..num_layers-1, got layer={layer}, "
                             f"num_layers={num_layers}")
        # Its own collectives on the state's group (the max-norm exchange) must not meet a
        # worker still asking for a THC call's sums there: calls on this state end with
        # their agreement (THCAllreduce.defer_end_agreement).
        allreduce.defer_end_agreement = False
        self.allreduce = allreduce
        self.key = FSDP_KEY_BASE + next(_NEXT_KEY.setdefault(allreduce, itertools.count()))
        self.layer, self.num_layers = layer, num_layers
        self._failed: BaseException | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        """output_tensor = op-reduction of shard `rank in group` of every rank's input."""
        if async_op:
            raise ValueError("THCReduceScatter runs synchronously (FSDP2 calls it with "
                             "async_op=False); call it without async_op")
        if self._failed is not None:
            raise AllreduceError(
                f"an earlier THC reduce-scatter on this worker failed "
                f"({type(self._failed).__name__}: {self._failed}); the workers are out of "
                "step: restart the job") from self._failed
        world = self._check_group(group)
        scale = op_scale(op, world)
        shard = _check_shapes(output_tensor, input_tensor, world)
        try:
            self._reduce_scatter(output_tensor, input_tensor, shard, scale)
        except BaseException as exc:
            if not getattr(exc, "thc_agreed", False):     # agreed errors leave it usable
                self._failed = exc
            raise
        return None

    def _check_group(self, group) -> int:
        """FSDP's shard group must be the state's workers, in the state's rank order."""
        ar = self.allreduce
        world = dist.get_world_size(group)
        if world != ar.world:
            raise ValueError(
                f"FSDP reduce-scatters over a group of {world} ranks but the THC state was "
                f"built for {ar.world} workers: build it with thc_hook_state(group=<FSDP's "
                "shard group>) (with HSDP, the mesh's shard dimension's group)")
        if dist.get_rank(group) != ar.rank:
            raise ValueError(
                f"this worker is rank {dist.get_rank(group)} of FSDP's shard group but rank "
                f"{ar.rank} of the THC state's group: build the state with "
                "thc_hook_state(group=<FSDP's shard group>)")
        return world

    def _reduce_scatter(self, output, inp, shard: int, scale: float) -> None:
        ar, codec = self.allreduce, self.allreduce.codec
        ar.start()
        t_start = time.perf_counter()
        # As THCAllreduce's own calls: the same float32 view and the same (fast) check.
        good_dtype = inp.dtype in SUPPORTED_DTYPES
        flat = _flat_float32(inp) if good_dtype else inp.detach().reshape(-1)
        finite = good_dtype and _all_finite(flat)
        # Every worker learns together of a bad dtype, size or NaN and raises alike.
        if ar._check_agreement(flat.numel(), finite, good_dtype, self.key, flat.device,
                               inp.dtype):
            ar.nonfinite_calls += 1          # nonfinite="propagate": an inf step everywhere
            output.fill_(float("inf"))
            return
        # A new buffer size: the stored error no longer fits. The size lives in the state
        # (not here) so that a state restored from a checkpoint keeps its error.
        previous = ar.verified_sizes.get(self.key)
        if previous is not None and previous != flat.numel() and ar.error_feedback is not None:
            ar.error_feedback.reset(self.key)
        ar.verified_sizes[self.key] = flat.numel()
        rnd = ar.calls.get(self.key, 0)
        ar.calls[self.key] = rnd + 1
        padded = codec.padded_length(shard)
        error = ar.error_feedback.rotated_error(self.key, ar.world * padded, flat) \
            if ar.error_feedback is not None else None
        rotated, norms = self._rotate_shards(flat, shard, padded, error)
        max_norms = self._max_norms(norms, flat.device)
        parts = codec.num_partitions(shard)
        packed = [codec.quantize(rotated[r * padded:(r + 1) * padded],
                                 max_norms[r * parts:(r + 1) * parts], worker=ar.rank,
                                 round=rnd, tensor=self.key + r * CHUNK_KEY_STRIDE,
                                 error_out=None if error is None
                                 else error[r * padded:(r + 1) * padded])
                  for r in range(ar.world)]
        own = slice(ar.rank * parts, (ar.rank + 1) * parts)
        self._exchange_and_decode(torch.cat(packed), rotated, padded, shard,
                                  max_norms[own], output, scale)
        ar.seconds["total"] += time.perf_counter() - t_start
        ar.call_seconds.append(time.perf_counter() - t_start)

    def _rotate_shards(self, flat, shard: int, padded: int, error):
        """Every rank's shard rotated into its own padded slot of one buffer (with this
        worker's rotated error for it added, error: None without error feedback), and the
        norms of all their partitions."""
        ar, codec = self.allreduce, self.allreduce.codec
        rotated = torch.empty(ar.world * padded, dtype=torch.float32, device=flat.device)
        norms = []
        for r in range(ar.world):
            slot = slice(r * padded, (r + 1) * padded)
            _, shard_norms = codec.rotate_and_norms(
                flat[r * shard:(r + 1) * shard], f"shard {r}", out=rotated[slot],
                add=None if error is None else error[slot])
            norms.append(shard_norms)
        return rotated, np.concatenate(norms)

    def _max_norms(self, norms: np.ndarray, device) -> torch.Tensor:
        """The max over all workers of every shard partition's norm (one MAX exchange)."""
        ar = self.allreduce
        agreed = torch.from_numpy(np.ascontiguousarray(norms, np.float32)).to(device)
        t0 = time.perf_counter()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ar.group)
        ar.seconds["norms"] += time.perf_counter() - t0
        ar.control_bytes += 4 * agreed.numel()
        return agreed

    def _exchange_and_decode(self, packed, rotated, padded: int, shard: int, max_norms,
                             output, scale: float) -> None:
        """Sum every worker's lanes of this rank's shard and decode them into output."""
        ar = self.allreduce
        t0 = time.perf_counter()
        if isinstance(ar.exchange, SumAllreduceExchange):
            sums, counts = self._reduce_scatter_lanes(packed, padded)
            self._decode(sums, counts, max_norms, shard, output, scale)
            ar.seconds["exchange"] += time.perf_counter() - t0
            return
        stream = ar.exchange.open(ar.world * padded, self.key, layer=self.layer,
                                  num_layers=self.num_layers)
        try:
            stream.submit(0, ar.world * padded, packed, rotated)
            sums, counts = stream.result(0, ar.world * padded)
            ar.seconds["exchange"] += time.perf_counter() - t0
            own = slice(ar.rank * padded, (ar.rank + 1) * padded)
            counts = counts if np.isscalar(counts) else np.asarray(counts)[own]
            self._decode(sums[own], counts, max_norms, shard, output, scale)
            stream.finish()
        except BaseException:
            stream.close()
            raise

    def _reduce_scatter_lanes(self, packed, padded: int):
        """(this rank's shard's lane sums, W): dist.reduce_scatter_single(SUM) of the table
        values of every shard (reduce_scatter_tensor's name since torch 2.13)."""
        ar, ex = self.allreduce, self.allreduce.exchange
        lanes = torch.as_tensor(ar.codec.lookup(packed)).to(ex.lane_dtype)
        own = torch.empty(padded, dtype=ex.lane_dtype, device=lanes.device)
        dist.reduce_scatter_single(own, lanes, op=dist.ReduceOp.SUM, group=ex.group)
        ex.bytes_sent += int((ar.world - 1) / ar.world * lanes.numel() * lanes.element_size())
        return own, ar.world

    def _decode(self, sums, counts, max_norms, shard: int, output, scale: float) -> None:
        codec = self.allreduce.codec
        if output.is_cuda and not isinstance(sums, torch.Tensor):
            sums = torch.as_tensor(np.asarray(sums)).to(output.device)
        direct = output.dtype == torch.float32 and output.is_contiguous()
        mean = codec.decode(sums, counts, max_norms, shard,
                            out=output.view(-1) if direct else None)
        if not direct:
            output.copy_(torch.as_tensor(mean).view_as(output))
        if scale != 1.0:
            output.mul_(scale)


def op_scale(op, world: int) -> float:
    """What FSDP's reduce op asks of the mean: AVG 1, SUM W, PREMUL_SUM(f) W*f."""
    kind = getattr(op, "op", op)           # ReduceOp.PREMUL_SUM(f) is an object; others enums
    if kind == ReduceOp.AVG:
        return 1.0
    if kind == ReduceOp.SUM:
        return float(world)
    if kind == ReduceOp.PREMUL_SUM:
        return float(world) * float(op.factor)
    raise ValueError(f"THCReduceScatter reduces gradients with AVG, SUM or PREMUL_SUM (what "
                     f"FSDP2 passes), got {op}: use dist.reduce_scatter_single for other ops")


def thc_fully_shard_comm(model: torch.nn.Module, state_or_options=None):
    """Make THC the reduce-scatter of every FSDPModule in `model` (after fully_shard).

    state_or_options: a THCHookState or THCAllreduce, or a dict of thc_hook_state keyword
    arguments (None: {} = THC over the process group, no aggregator). Returns the state
    (close() it at the end, as with the DDP hook). Every module gets its own
    THCReduceScatter, in module order (the same on every rank)."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no FSDPModule in the model: call torch.distributed.fsdp.fully_shard "
                         "on its layers and on the model first")
    if state_or_options is None or isinstance(state_or_options, dict):
        state_or_options = thc_hook_state(**_with_fsdp_codec(dict(state_or_options or {})))
    _allreduce_of(state_or_options)        # refuse anything else before touching the model
    for layer, module in enumerate(modules):
        module.set_custom_reduce_scatter(
            THCReduceScatter(state_or_options, layer=layer, num_layers=len(modules)))
    return state_or_options


def _with_fsdp_codec(options: dict) -> dict:
    """thc_hook_state options, with a codec of FSDP_PARTITION_SIZE partitions on the
    collective path unless one is given (the in-network path's default has them already)."""
    if options.get("aggregator") is None and options.get("codec") is None:
        options["codec"] = thc.THCCodec(seed=options.get("seed", 0),
                                        partition_size=FSDP_PARTITION_SIZE)
    return options


def _allreduce_of(state) -> THCAllreduce:
    if isinstance(state, THCHookState):
        return state.allreduce
    if isinstance(state, THCAllreduce):
        return state
    raise TypeError(f"expected a THCHookState (host.ddp_hook.thc_hook_state(...)), a "
                    f"THCAllreduce or a dict of thc_hook_state options, got "
                    f"{type(state).__name__}")


def _check_shapes(output, inp, world: int) -> int:
    """The shard length S: input of W*S values, output of S (S >= 1), both contiguous."""
    if not isinstance(inp, torch.Tensor) or not isinstance(output, torch.Tensor):
        raise TypeError(f"expected torch.Tensor output and input, got "
                        f"{type(output).__name__} and {type(inp).__name__}")
    if not inp.is_contiguous() or not output.is_contiguous():
        raise ValueError("THCReduceScatter needs contiguous input and output tensors (FSDP2 "
                         "allocates them so): pass .contiguous() ones")
    if inp.numel() == 0 or inp.numel() % world:
        raise ValueError(f"input of {inp.numel()} values cannot be cut into {world} equal "
                         f"non-empty shards (one per rank): pad it to a multiple of {world}")
    if output.numel() != inp.numel() // world:
        raise ValueError(f"output holds {output.numel()} values but each of the {world} "
                         f"shards of the input has {inp.numel() // world}: allocate the "
                         "output with input.numel() // world_size values")
    return inp.numel() // world


__all__ = ["THCReduceScatter", "thc_fully_shard_comm", "op_scale", "FSDP_KEY_BASE"]
