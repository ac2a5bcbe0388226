"""THC allreduce: the mean of one gradient tensor over all workers, THC-compressed.

One call (notes/thc.md §3, DESIGN.md §3):

  x = grad + e                                 error feedback (thc.ErrorFeedback)
  control exchange (all_reduce MAX, W+2 floats) sizes agree? any NaN/Inf? -> clear error on
                                               every worker at once, never a hang
  norms: all_reduce MAX, overlapped with the RHT   (one float per partition per worker)
  packed = quantize(RHT(x), max norms)         4-bit indices, counter-based RNG
  sums, counts = exchange(packed)              integer sums of table values
  mean = decode(sums, counts, max norms)       m + (Y/count)(M-m)/g, inverse RHT
  e = x - own decoded                          error feedback update

The max-norm exchange runs through the torch process group (gloo or NCCL), not through the
aggregator: it is W floats per partition, it needs MAX (the aggregator only adds small
integers), and the process group is there anyway for DDP. It is started asynchronously
before the RHT and waited for after it, so the two overlap.

Two exchanges for the integer sums:
* `AggregatorExchange`: the in-network path, packed indices to the aggregator over UDP
  (host.transport), 4 bits up and 8 bits down per value;
* `SumAllreduceExchange`: any cluster without a switch. Each worker looks its indices up in
  the table (uint8 values 0..g) and runs torch.distributed.all_reduce(SUM) on those integer
  lanes. THC is homomorphic, so the integer sum decodes to exactly the mean the aggregator
  would give. Lanes are uint8 when n*g <= 255, else int16/int32 (wider lanes, documented).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

import thc
from host.transport import default_policy

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class AllreduceError(RuntimeError):
    """Workers disagree about a call (sizes), or a worker reported a bad gradient."""


class SizeMismatchError(AllreduceError):
    pass


# --------------------------------------------------------------------------- exchanges

class AggregatorExchange:
    """Integer sums through an in-network aggregator (host.transport.AggregatorTransport)."""

    name = "aggregator"

    def __init__(self, transport, codec):
        self.transport = transport
        self.codec = codec

    def start(self, group, timeout: float) -> None:
        """Flush the job's slots, then wait for every worker (no flush after a contribution)."""
        self.transport.flush()
        _barrier(group, "waiting for every worker to flush the aggregator slots", timeout)

    def sum(self, packed, padded: int, tensor: int, *, rotated=None, layer=0, num_layers=1):
        packed_np = _to_numpy(packed)
        # The rotated values only matter to a DLCP policy; skip the copy (GPU -> host) else.
        wants_values = self.transport.policy is not default_policy
        values = _to_numpy(rotated) if rotated is not None and wants_values else None
        res = self.transport.allreduce(packed_np, padded, tensor, values=values, layer=layer,
                                       num_layers=num_layers)
        counts = res.counts_per_value(padded)
        sums = res.sums
        if not np.isscalar(counts) and (np.asarray(counts) == 0).any():
            # Chunks given up after a straggler notice: use this worker's own values there.
            own = np.asarray(self.codec.lookup(packed_np))
            missing = np.asarray(counts) == 0
            sums = sums.copy()
            sums[missing] = own[missing]
            counts = np.where(missing, 1, counts)
        return sums, counts

    @property
    def bytes_sent(self) -> int:
        return self.transport.stats.bytes_sent


class SumAllreduceExchange:
    """Integer sums with torch.distributed.all_reduce(SUM) on table-value lanes."""

    name = "sum-allreduce"

    def __init__(self, codec, group=None):
        self.codec = codec
        self.group = group
        world = dist.get_world_size(group)
        g = int(np.max(codec.table))
        top = world * g
        # The narrowest lane that holds n*g: 8-bit lanes like the switch when they fit.
        self.lane_dtype = (torch.uint8 if top <= 255 else torch.int16 if top <= 32767
                           else torch.int32)
        self.world = world
        self.bytes_sent = 0

    def start(self, group, timeout: float) -> None:
        _barrier(group, "waiting for every worker to join the THC allreduce", timeout)

    def sum(self, packed, padded: int, tensor: int, *, rotated=None, layer=0, num_layers=1):
        values = self.codec.lookup(packed)
        lanes = torch.as_tensor(values).to(self.lane_dtype)
        if isinstance(packed, torch.Tensor):
            lanes = lanes.to(packed.device)
        dist.all_reduce(lanes, op=dist.ReduceOp.SUM, group=self.group)
        # A ring allreduce sends 2(n-1)/n of the buffer per worker.
        self.bytes_sent += int(2 * (self.world - 1) / self.world * lanes.numel()
                               * lanes.element_size())
        return lanes, self.world


# --------------------------------------------------------------------------- allreduce

class THCAllreduce:
    """Mean of a tensor over the process group with THC compression.

    codec: thc.THCCodec shared (same seed/config) by every worker; exchange: an
    AggregatorExchange or SumAllreduceExchange; group: the torch process group used for
    the control and norm exchanges (default group when None).
    """

    def __init__(self, codec, exchange, *, group=None, error_feedback: bool = True,
                 start_timeout: float = 60.0):
        if not dist.is_initialized():
            raise RuntimeError("THCAllreduce needs torch.distributed initialized "
                               "(dist.init_process_group) for the norm exchange")
        self.codec = codec
        self.exchange = exchange
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if exchange.name == "aggregator":
            thc.check_lanes(self.world, int(np.max(codec.table)))   # the switch's 8-bit lanes
        self.error_feedback = thc.ErrorFeedback() if error_feedback else None
        self.calls: dict[int, int] = {}        # per tensor key: rounds of the RNG
        self.verified_sizes: dict[int, int] = {}   # per tensor key: size all workers agreed
        self.seconds = {"total": 0.0, "exchange": 0.0}   # where the time goes (main job)
        self.control_bytes = 0
        self.start_timeout = start_timeout
        self._started = False

    def start(self) -> None:
        """Job start: every worker calls it once (flushes the aggregator's slots)."""
        if not self._started:
            self.exchange.start(self.group, self.start_timeout)
            self._started = True

    def __call__(self, tensor: torch.Tensor, key: int = 0, *, layer: int = 0,
                 num_layers: int = 1) -> torch.Tensor:
        """The THC mean of `tensor` over all workers (same shape and dtype)."""
        self.start()
        t_start = time.perf_counter()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        # Agree first (dtype, size, finiteness) so a bad worker fails every worker at once,
        # instead of failing alone and leaving the others blocked in the next collective.
        good_dtype = tensor.dtype in SUPPORTED_DTYPES
        flat = _flat_float32(tensor) if good_dtype else tensor.detach().reshape(-1)
        d = flat.numel()
        finite = good_dtype and _all_finite(flat)
        local = (d, finite, good_dtype, key, flat.device, tensor.dtype)
        combined = None
        if key in self.verified_sizes:
            # Every worker verified this tensor's size before, so all agree on the length
            # of one combined exchange: [norms of the verified layout | control fields].
            combined = self._combined_exchange(flat, local)
        else:
            # First call for this tensor: the control fields alone (fixed length) first.
            self._check_agreement(*local)
        if combined is None:
            # The norms, exchanged while the RHT runs.
            x = self.error_feedback.compensate(key, flat) if self.error_feedback else flat
            norms = _as_torch(self.codec.partition_norms(x), flat.device).float()
            pending = dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=self.group,
                                      async_op=True)
            rotated = self.codec.rotate(x)
            pending.wait()
            self.verified_sizes[key] = d
        else:
            x, norms, rotated = combined
        self.control_bytes += 4 * norms.numel()
        max_norms = norms if isinstance(rotated, torch.Tensor) else norms.cpu().numpy()
        rnd = self.calls.get(key, 0)
        self.calls[key] = rnd + 1
        packed = self.codec.quantize(rotated, max_norms, worker=self.rank, round=rnd,
                                     tensor=key)
        padded = self.codec.padded_length(d)
        t_exchange = time.perf_counter()
        sums, counts = self.exchange.sum(packed, padded, key, rotated=rotated, layer=layer,
                                         num_layers=num_layers)
        self.seconds["exchange"] += time.perf_counter() - t_exchange
        if isinstance(rotated, torch.Tensor):
            sums = torch.as_tensor(np.asarray(sums) if not isinstance(sums, torch.Tensor)
                                   else sums).to(rotated.device)
        mean = _as_torch(self.codec.decode(sums, counts, max_norms, d), flat.device)
        if self.error_feedback:
            # e = x - RHT^-1(own quantized values), in the gradient's domain.
            own = self.codec.inverse_rotate(self.codec.dequantize(packed, max_norms), d)
            self.error_feedback.update(key, x, _as_torch(own, flat.device))
        self.seconds["total"] += time.perf_counter() - t_start
        return mean.to(tensor.dtype).reshape(tensor.shape)

    def _combined_exchange(self, flat, local):
        """One MAX exchange of the norms and the control fields; RHT while it runs.

        A worker whose tensor is bad (size, dtype, NaN) still sends a vector of the agreed
        length (zero norms), so every worker gets the control fields and raises the same
        error; nobody is left waiting in a collective.
        """
        d, finite, good_dtype, key, device, dtype = local
        parts = self.codec.num_partitions(self.verified_sizes[key])
        usable = finite and good_dtype and d == self.verified_sizes[key]
        x = flat
        norms = torch.zeros(parts, dtype=torch.float64)
        if usable:
            x = self.error_feedback.compensate(key, flat) if self.error_feedback else flat
            norms[:] = torch.from_numpy(np.asarray(self.codec.partition_norms(x), np.float64))
        vector = torch.cat([norms, self._control_vector(d, finite, good_dtype)])
        if device.type == "cuda" and dist.get_backend(self.group) == "nccl":
            vector = vector.to(device)
        pending = dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group,
                                  async_op=True)
        rotated = self.codec.rotate(x) if usable else None   # overlaps with the exchange
        pending.wait()
        vector = vector.cpu()
        self.control_bytes += 8 * (vector.numel() - parts)
        self._raise_on_disagreement(vector[parts:], d, good_dtype, key, dtype)
        if not usable:
            # No error, so every worker has the same new size (e.g. DDP rebuilt its
            # buckets): exchange the norms of the new layout separately, once.
            return None
        return x, vector[:parts].float().to(device), rotated

    def _control_vector(self, d: int, finite: bool, good_dtype: bool) -> torch.Tensor:
        """[bad dtype one-hot (W), bad values one-hot (W), d, -d]; MAX-reduced."""
        w = self.world
        control = torch.zeros(2 * w + 2, dtype=torch.float64)
        control[self.rank] = 0.0 if good_dtype else 1.0
        control[w + self.rank] = 0.0 if finite or not good_dtype else 1.0
        control[2 * w], control[2 * w + 1] = d, -d
        return control

    def _check_agreement(self, d: int, finite: bool, good_dtype: bool, key: int, device,
                         dtype) -> None:
        """The control fields alone, in one MAX exchange of fixed length."""
        control = self._control_vector(d, finite, good_dtype)
        if device.type == "cuda" and dist.get_backend(self.group) == "nccl":
            control = control.to(device)
        dist.all_reduce(control, op=dist.ReduceOp.MAX, group=self.group)
        self.control_bytes += 8 * control.numel()
        self._raise_on_disagreement(control.cpu(), d, good_dtype, key, dtype)

    def _raise_on_disagreement(self, control, d, good_dtype, key, dtype) -> None:
        w = self.world
        bad_dtype = [r for r in range(w) if control[r] > 0]
        if bad_dtype:
            mine = f" (this worker: {dtype})" if not good_dtype else ""
            raise TypeError(
                f"tensor {key}: worker(s) {bad_dtype} passed a tensor that is not floating"
                f"{mine}; THC allreduce supports {[str(t) for t in SUPPORTED_DTYPES]}: reduce "
                "integer tensors with dist.all_reduce")
        largest, smallest = int(control[2 * w]), -int(control[2 * w + 1])
        if largest != smallest:
            raise SizeMismatchError(
                f"tensor {key}: workers passed different sizes (this worker {d}, smallest "
                f"{smallest}, largest {largest}); every worker must reduce the same tensors "
                "in the same order")
        bad = [r for r in range(w) if control[w + r] > 0]
        if bad:
            raise thc.NonFiniteError(
                f"tensor {key}: NaN or Inf gradient on worker(s) {bad}; nothing was sent "
                "(lower the learning rate or enable gradient clipping / loss scaling)")


# --------------------------------------------------------------------------- helpers

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


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _barrier(group, what: str, timeout_s: float = 60.0) -> None:
    """A barrier that names the missing rank (gloo's monitored barrier) instead of hanging."""
    import datetime
    if dist.get_backend(group) == "gloo":
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            hint = "" if dist.get_rank(group) == 0 else \
                " (rank 0 checks every rank and names the missing one in its error)"
            raise AllreduceError(f"while {what} ({timeout_s:g} s): {exc}{hint}") from exc
    else:
        dist.barrier(group=group)
