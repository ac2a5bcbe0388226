"""THCCodec: the worker-side THC codec (RHT, quantization, lookup, decode) behind one API.

The wrapper owns shapes, dtypes and per-partition constants; the arithmetic lives in three
interchangeable backends with identical semantics:
  "numpy" : thc.numpy_kernels over thc.reference (plain numpy, the specification)
  "cpu"   : thc.cpu_kernels (Numba @njit(parallel=True))
  "cuda"  : thc.cuda_kernels (Numba CUDA), picked automatically for CUDA inputs
backend="auto" (the default) uses "cuda" for torch CUDA tensors / CUDA arrays and "cpu"
otherwise. torch in -> torch out (same device), numpy in -> numpy out; CPU torch tensors
are viewed as numpy without copying.
"""
from __future__ import annotations

import numpy as np

from . import cpu_kernels, numpy_kernels, rng
from .arrays import host_numpy, is_cuda, is_torch, torch_module
from .errors import NonFiniteError, check_lanes
from .layout import DEFAULT_PARTITION_SIZE, Layout, check_partition_size
from .tables import check_table, lower_index_table, optimal_table, truncation_threshold

BACKENDS = ("auto", "numpy", "cpu", "cuda")
LAYOUTS_KEPT = 1024          # per codec: tensor lengths whose layouts are kept


def _checked_buffer(buf, length: int, what: str):
    """An output/operand buffer must be a contiguous float32 vector of `length` elements,
    so that the kernels see (and write) its own memory."""
    if is_torch(buf):
        ok = (buf.dtype == torch_module().float32 and buf.is_contiguous()
              and buf.numel() == length)
    else:
        ok = (np.dtype(buf.dtype) == np.float32 and buf.size == length
              and bool(buf.flags["C_CONTIGUOUS"]))
    if not ok:
        raise ValueError(f"{what}: expected a contiguous float32 buffer of {length} elements, "
                         f"got {type(buf).__name__} {getattr(buf, 'dtype', '?')} of "
                         f"{getattr(buf, 'size', '?')}")
    return buf


class THCCodec:
    """THC with a b-bit lookup table on a g-step grid, clamped at t_p standard deviations.

    partition_size: floats per RHT partition (a power of two; default 2^20 = 4 MiB, the
    BytePS partition). A tensor shorter than a partition, and the tail of a longer one, is
    padded only to its own next power of two (at least 2).
    rotate=False skips the RHT (identity rotation); quantization is unchanged.
    """

    def __init__(self, bits: int = 4, granularity: int = 30, p: float = 1 / 32,
                 symmetric: bool = True, seed: int = 0,
                 partition_size: int = DEFAULT_PARTITION_SIZE, rotate: bool = True,
                 table=None, backend: str = "auto"):
        if bits != 4:
            raise ValueError(f"this codec packs 4-bit indices; bits={bits} is not supported "
                             "(use thc.baselines.THCCompressor for other widths)")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        self.bits = bits
        self.granularity = int(granularity)
        self.p = float(p)
        self.symmetric = symmetric
        self.seed = int(seed)
        self.partition_size = check_partition_size(partition_size)
        self.rotation = bool(rotate)
        self.backend = backend
        self.table = (check_table(table) if table is not None
                      else optimal_table(bits, granularity, p, symmetric=symmetric))
        if len(self.table) != 1 << bits or self.table[-1] != self.granularity:
            raise ValueError(f"table {self.table.tolist()} does not fit bits={bits}, "
                             f"granularity={granularity}")
        self.t_p = truncation_threshold(p)
        self.lower = lower_index_table(self.table)
        self.table_u8 = self.table.astype(np.uint8)
        self.table_f32 = self.table.astype(np.float32)
        self.inv_width = (1.0 / np.diff(self.table).astype(np.float64)).astype(np.float32)
        self.sign_key = rng.rademacher_key(self.seed)
        # A call of a small tensor costs mostly this wrapper's own work, not the kernels':
        # its layouts, and the last max norms' constants (a call's quantize and decode use
        # the same ones), are kept rather than made again.
        self._layouts: dict[int, Layout] = {}
        self._constants = None           # (key, (half, scale, step)) of the last max norms

    # ---- shapes ---------------------------------------------------------------------------
    def layout(self, d: int) -> Layout:
        layout = self._layouts.get(d)
        if layout is None:
            if d < 0:
                raise ValueError(f"tensor length must be >= 0, got {d}")
            if len(self._layouts) >= LAYOUTS_KEPT:
                self._layouts.clear()    # a job of ever-new lengths: start again, not grow
            layout = self._layouts[d] = Layout(int(d), self.partition_size)
        return layout

    def padded_length(self, d: int) -> int:
        return self.layout(d).padded

    def num_partitions(self, d: int) -> int:
        return self.layout(d).num_partitions

    def _padded_layout(self, padded: int, what: str) -> Layout:
        # Layout.from_padded is the layout of d = padded: the same kept one.
        layout = self.layout(padded)
        if layout.padded != padded:
            raise ValueError(f"{what}: length {padded} is not a padded length for partition "
                             f"size {self.partition_size} (use codec.padded_length(d))")
        return layout

    def check_workers(self, workers: int) -> None:
        """Raise LaneOverflowError if `workers` sums could overflow the 8-bit lanes."""
        check_lanes(workers, self.granularity)

    # ---- backend choice -------------------------------------------------------------------
    def _kernels(self, x):
        choice = self.backend
        if choice == "auto":
            choice = "cuda" if is_cuda(x) else "cpu"
        if choice == "cuda":
            # imported on the first CUDA input only: numba.cuda takes a quarter of a
            # second to load, which a CPU-only process never needs
            from . import cuda_kernels
            return cuda_kernels
        if is_cuda(x):
            raise ValueError(f"backend {choice!r} cannot take a CUDA tensor; use backend='auto'")
        if choice == "cpu":
            return cpu_kernels
        return numpy_kernels

    def _partition_constants(self, max_norms, layout: Layout, what: str):
        """Per-partition M = t_p * l / sqrt(n), grid scale g / 2M and decode step 2M / g.
        The arrays returned are shared with the next call of the same norms and layout:
        the kernels only read them."""
        norms = host_numpy(max_norms, np.float64).reshape(-1)
        key = (layout.full_partitions, layout.tail_padded, norms.tobytes())
        last = self._constants
        if last is not None and last[0] == key:
            return last[1]
        constants = self._new_partition_constants(norms, layout, what)
        self._constants = (key, constants)
        return constants

    def _new_partition_constants(self, norms, layout: Layout, what: str):
        if len(norms) != layout.num_partitions:
            raise ValueError(f"{what}: {len(norms)} max norms for {layout.num_partitions} "
                             f"partitions (one per partition, see codec.partition_norms)")
        if not np.isfinite(norms).all():
            raise NonFiniteError(f"{what}: max norms hold NaN or Inf: {norms.tolist()[:8]}")
        if (norms < 0).any():
            raise ValueError(f"{what}: max norms must be >= 0, got {norms.tolist()[:8]}")
        sizes = layout.sizes().astype(np.float64)
        half = (self.t_p * norms / np.sqrt(sizes)).astype(np.float32)
        with np.errstate(divide="ignore"):
            scale = np.where(half > 0, self.granularity / (2.0 * half.astype(np.float64)), 0.0)
        step = (2.0 * half.astype(np.float64) / self.granularity)
        return half, scale.astype(np.float32), step.astype(np.float32)

    # ---- the API --------------------------------------------------------------------------
    def partition_norms(self, x, name: str = "tensor"):
        """One L2 norm per partition (float32, host numpy); NonFiniteError on NaN/Inf."""
        kernels = self._kernels(x)
        flat = kernels.as_flat(x, name)
        layout = self.layout(kernels.length(flat))
        return self._checked_norms(kernels.partition_norms(flat, layout), name)

    def _checked_norms(self, norms, name):
        if not np.isfinite(norms).all():
            bad = [k for k, v in enumerate(norms) if not np.isfinite(v)]
            raise NonFiniteError(f"{name}: NaN or Inf in partition(s) {bad[:8]} "
                                 f"(elements {bad[0] * self.partition_size}..)")
        return norms

    def rotate(self, x, name: str = "tensor", *, out=None, add=None):
        """RHT of each zero-padded partition: length padded_length(d), same kind as x.

        add: a rotated-domain vector of the padded length added to the result (rotated-
        domain error feedback; fused into the transform on the CPU). out: a contiguous
        float32 buffer of the padded length (same kind and device as x) to write into and
        return, so that repeated calls do not allocate (a fresh 64 MB array costs about as
        much in page faults as the transform itself)."""
        return self._rotate(x, name, out, add, False)

    def rotate_and_norms(self, x, name: str = "tensor", *, out=None, add=None):
        """(rotate(x, out=out, add=add), the L2 norm of each rotated partition): the norms
        of what will be quantized, computed in the same pass on the CPU (float32 host
        numpy; NonFiniteError on NaN/Inf). The RHT keeps norms, so without `add` they
        equal partition_norms(x)."""
        rotated, norms = self._rotate(x, name, out, add, True)
        return rotated, self._checked_norms(norms, name)

    def _rotate(self, x, name, out, add, with_norms):
        kernels = self._kernels(x)
        flat = kernels.as_flat(x, name)
        layout = self.layout(kernels.length(flat))
        add_flat = (None if add is None
                    else kernels.as_flat(_checked_buffer(add, layout.padded, "add"), "add"))
        out_flat = (None if out is None
                    else kernels.as_flat(_checked_buffer(out, layout.padded, "out"), "out"))
        norms = None
        if self.rotation and getattr(kernels, "FUSED", False):
            rotated = kernels.rotate(flat, layout, self.sign_key, out=out_flat, add=add_flat,
                                     norms=with_norms)
            if with_norms:
                rotated, norms = rotated
        else:
            rotated = (kernels.rotate(flat, layout, self.sign_key) if self.rotation
                       else kernels.pad(flat, layout))
            if add_flat is not None:
                kernels.add_inplace(rotated, add_flat)
            if out_flat is not None:
                kernels.copy_into(out_flat, rotated)
                rotated = out_flat
            if with_norms:
                norms = kernels.partition_norms(rotated, self._padded_layout(layout.padded,
                                                                             name))
        result = out if out is not None else kernels.wrap_like(x, rotated)
        return (result, norms) if with_norms else result

    def inverse_rotate(self, y, d: int, *, out=None):
        """Inverse RHT of a padded rotated-domain vector, un-padded to length d. out: a
        contiguous float32 buffer of length d to write into and return."""
        kernels = self._kernels(y)
        flat = kernels.as_flat(y, "rotated")
        layout = self.layout(d)
        if kernels.length(flat) != layout.padded:
            raise ValueError(f"rotated vector has length {kernels.length(flat)}, expected "
                             f"padded_length({d}) = {layout.padded}")
        out_flat = (None if out is None
                    else kernels.as_flat(_checked_buffer(out, layout.d, "out"), "out"))
        if self.rotation and getattr(kernels, "FUSED", False):
            result = kernels.inverse_rotate(flat, layout, self.sign_key, out=out_flat)
        else:
            result = (kernels.inverse_rotate(flat, layout, self.sign_key) if self.rotation
                      else kernels.unpad(flat, layout))
            if out_flat is not None:
                kernels.copy_into(out_flat, result)
        return out if out is not None else kernels.wrap_like(y, result)

    def quantize(self, rotated, max_norms, *, worker: int, round: int, tensor: int,
                 name: str = "rotated", error_out=None):
        """Packed uint8 [padded/2] of 4-bit table indices (even element in the high nibble).

        error_out: a contiguous float32 buffer of the padded length (same kind as rotated)
        that receives rotated - dequantize(packed, max_norms), the worker's own rotated-
        domain quantization error (fused into the quantizer on the CPU). It may be the
        buffer that was passed to rotate(add=...). Unspecified after NonFiniteError."""
        kernels = self._kernels(rotated)
        flat = kernels.as_flat(rotated, name)
        layout = self._padded_layout(kernels.length(flat), name)
        half, scale, step = self._partition_constants(max_norms, layout, name)
        err = (None if error_out is None else kernels.as_flat(
            _checked_buffer(error_out, layout.padded, "error_out"), "error_out"))
        key = rng.rounding_key(self.seed, round, tensor, worker)
        fused = err is not None and getattr(kernels, "FUSED", False)
        if fused:
            packed, nonfinite = kernels.quantize(flat, half, scale, self, layout, key,
                                                 step=step, error_out=err)
        else:
            packed, nonfinite = kernels.quantize(flat, half, scale, self, layout, key)
        if nonfinite:
            raise NonFiniteError(f"{name}: {nonfinite} of {layout.padded} values are NaN or Inf")
        if err is not None and not fused:
            own = kernels.as_flat(self.dequantize(kernels.wrap_like(rotated, packed),
                                                  max_norms), "own")
            kernels.subtract(flat, own, err)
        return kernels.wrap_like(rotated, packed)

    def lookup(self, packed):
        """uint8 table value per element (what an aggregator adds), length 2 * len(packed)."""
        kernels = self._kernels(packed)
        flat = kernels.as_flat(packed, "packed", dtype="uint8")
        return kernels.wrap_like(packed, kernels.lookup(flat, self.table_u8))

    def dequantize(self, packed, max_norms):
        """Rotated-domain float32 values of one worker's packed indices (count 1)."""
        return self._decode_rotated(self.lookup(packed), 1, max_norms, "packed")

    def _decode_rotated(self, sums, counts, max_norms, what):
        kernels = self._kernels(sums)
        flat = kernels.as_flat(sums, what, dtype=None)
        layout = self._padded_layout(kernels.length(flat), what)
        half, _, step = self._partition_constants(max_norms, layout, what)
        counts = kernels.as_counts(counts, layout.padded)
        return kernels.wrap_like(sums, kernels.decode_rotated(flat, counts, half, step, layout))

    def decode(self, sums, counts, max_norms, d: int, *, out=None):
        """Mean estimate of length d from integer sums of table values and contributor
        counts (int, or one per element; count 0 decodes to 0): m + (Y/count)(M-m)/g per
        partition, then inverse RHT and un-pad. out: a contiguous float32 buffer of length
        d to write into and return (e.g. the gradient buffer the mean replaces)."""
        layout = self.layout(d)
        kernels = self._kernels(sums)
        if self.rotation and getattr(kernels, "FUSED", False):
            flat = kernels.as_flat(sums, "sums", dtype=None)
            if kernels.length(flat) != layout.padded:
                raise ValueError(f"sums have length {kernels.length(flat)}, expected "
                                 f"padded_length({d}) = {layout.padded}")
            half, _, step = self._partition_constants(max_norms, layout, "sums")
            out_flat = (None if out is None
                        else kernels.as_flat(_checked_buffer(out, d, "out"), "out"))
            result = kernels.decode_inverse(flat, kernels.as_counts(counts, layout.padded),
                                            half, step, layout, self.sign_key, out=out_flat)
            return out if out is not None else kernels.wrap_like(sums, result)
        rotated = self._decode_rotated(sums, counts, max_norms, "sums")
        kernels = self._kernels(rotated)
        flat = kernels.as_flat(rotated, "rotated")
        if kernels.length(flat) != layout.padded:
            raise ValueError(f"sums have length {kernels.length(flat)}, expected "
                             f"padded_length({d}) = {layout.padded}")
        if not self.rotation:
            result = kernels.unpad(flat, layout)
        else:
            # the decoded buffer is ours: transform it in place
            result = kernels.inverse_rotate(flat, layout, self.sign_key, overwrite=True)
        if out is not None:
            kernels.copy_into(kernels.as_flat(_checked_buffer(out, d, "out"), "out"), result)
            return out
        return kernels.wrap_like(rotated, result)

    # ---- conveniences built on the API (simulation, demo, benchmarks) ---------------------
    def compress(self, x, max_norms, *, worker: int, round: int, tensor: int):
        return self.quantize(self.rotate(x), max_norms, worker=worker, round=round,
                             tensor=tensor)

    def simulate_allreduce(self, grads, *, round: int = 0, tensor: int = 0):
        """All n workers' steps with an integer-sum aggregator in between; returns the
        decoded mean (same kind as the inputs). Refuses n*g beyond the 8-bit lanes."""
        n = len(grads)
        self.check_workers(n)
        d = len(grads[0])
        norms = np.max([self.partition_norms(gr, name=f"worker {w} gradient")
                        for w, gr in enumerate(grads)], axis=0)
        total = None
        for w, gr in enumerate(grads):
            values = self.lookup(self.compress(gr, norms, worker=w, round=round, tensor=tensor))
            values = (values.to(dtype=torch_module().int32) if is_torch(values)
                      else values.astype(np.int32))
            total = values if total is None else total + values
        return self.decode(total, n, norms, d)


class ErrorFeedback:
    """Per-tensor error-feedback state, in one of two domains.

    Gradient domain (the paper's, the default): e = x - RHT^-1(own quantized values),
    added to the next gradient before the RHT (compensate, then update). Costs a second
    inverse RHT per call (the first decodes the mean).

    Rotated domain (rotated=True): e_rot = x_rot - own quantized values, kept after the
    RHT and added to the next RHT(gradient) (rotate, then quantize). With the same
    rotation every call this is the same feedback, since RHT(g + e) = RHT(g) + RHT(e):
    x_rot equals the gradient-domain x rotated, up to float rounding. It drops the second
    inverse RHT and both error passes (the CPU kernels fuse the add into the RHT and the
    error into the quantizer). The price: the norms for the max-norm exchange are those of
    x_rot, so they exist only after the RHT, and the exchange cannot overlap the RHT. The
    error of a padded tail partition also keeps its padding coordinates (they are
    quantized and fed back like the rest, then dropped by the decode's un-padding).
    """

    def __init__(self, rotated: bool = False):
        self.rotated = bool(rotated)
        self._errors = {}
        self._work = {}          # rotated domain: the x_rot buffer reused per tensor

    # ---- gradient domain ------------------------------------------------------------------
    def compensate(self, key, grad):
        """grad + e for this tensor (grad itself on the first round)."""
        self._require(False, "compensate")
        e = self._errors.get(key)
        if e is None:
            return grad
        if tuple(e.shape) != tuple(grad.shape):
            raise ValueError(f"error feedback for {key!r}: stored shape {tuple(e.shape)} "
                             f"!= gradient shape {tuple(grad.shape)}")
        return grad + e

    def update(self, key, x, own_decoded):
        """Store x - own_decoded (x: the compensated gradient that was compressed)."""
        self._require(False, "update")
        self._errors[key] = x - own_decoded

    # ---- rotated domain -------------------------------------------------------------------
    def rotate(self, codec, key, grad, name: str = "tensor"):
        """(x_rot, norms): x_rot = RHT(grad) + e_rot (RHT(grad) on the first round) and
        its per-partition L2 norms, for the max-norm exchange. x_rot is a buffer kept per
        tensor and overwritten by the next call for the same key."""
        self._require(True, "rotate")
        padded = codec.padded_length(_numel(grad))
        e = self._errors.get(key)
        if e is not None and _numel(e) != padded:
            raise ValueError(f"error feedback for {key!r}: stored {_numel(e)} rotated values "
                             f"!= padded length {padded} of the gradient (reset the key when "
                             f"a tensor changes size)")
        work = self._work.get(key)
        if work is None or _numel(work) != padded or not _same_kind(work, grad):
            work = _empty_like_kind(grad, padded)
            self._work[key] = work
        return codec.rotate_and_norms(grad, name, out=work, add=e)

    def quantize(self, codec, key, x_rot, max_norms, *, worker: int, round: int,
                 tensor: int):
        """codec.quantize(x_rot, ...), storing e_rot = x_rot - own quantized values for
        the next rotate (same pass on the CPU)."""
        self._require(True, "quantize")
        e = self._errors.get(key)
        if e is None or _numel(e) != _numel(x_rot) or not _same_kind(e, x_rot):
            e = _empty_like_kind(x_rot, _numel(x_rot))
        packed = codec.quantize(x_rot, max_norms, worker=worker, round=round, tensor=tensor,
                                error_out=e)
        self._errors[key] = e
        return packed

    # ---- both -----------------------------------------------------------------------------
    def error(self, key):
        return self._errors.get(key)

    def reset(self, key=None):
        if key is None:
            self._errors.clear()
            self._work.clear()
        else:
            self._errors.pop(key, None)
            self._work.pop(key, None)

    def _require(self, rotated, method):
        if self.rotated != rotated:
            mode = "rotated" if self.rotated else "gradient"
            raise TypeError(f"ErrorFeedback.{method} is for the "
                            f"{'rotated' if rotated else 'gradient'} domain; this one keeps "
                            f"its error in the {mode} domain")


def _numel(x) -> int:
    return int(x.numel()) if is_torch(x) else int(np.prod(x.shape))


def _same_kind(a, b) -> bool:
    if is_torch(a) or is_torch(b):
        return is_torch(a) and is_torch(b) and a.device == b.device
    return is_cuda(a) == is_cuda(b)


def _empty_like_kind(x, length: int):
    """An uninitialized float32 vector of `length` on x's device and of x's kind (numpy
    arrays start on a cache line)."""
    if is_torch(x):
        return torch_module().empty(length, dtype=torch_module().float32, device=x.device)
    if is_cuda(x):
        from numba import cuda      # CUDA inputs only (see THCCodec._kernels)
        return cuda.device_array(length, dtype=np.float32)
    raw = np.empty(length + 16, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip:skip + length]
