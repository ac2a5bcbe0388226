"""CPU kernels written with explicit 16-lane float32 vectors (Numba intrinsics emitting LLVM
vector IR), for the two hot loops of the codec: the RHT and the quantizer.

Why intrinsics: LLVM's auto-vectorizer turns Numba loops into good SIMD code for the large
FWHT strides, but not for strides 1..8 (they live inside one vector and need lane shuffles;
left to LLVM they became 8x8 transposes costing about three plain stages each) and not for
the quantizer (three small-table gathers, which its cost model rejects, leaving scalar
code). Here a vector is an LLVM <16 x float>: one AVX-512 register, two AVX2 registers, or
whatever the host has after LLVM legalizes it, so the code stays portable.

Arithmetic is the reference's, operation for operation: every butterfly is the a+b / a-b of
one radix-2 stage, stages run in ascending stride order, signs and the 1/sqrt(n) scale are
applied exactly where thc.reference applies them, so outputs are bit-identical to
thc.reference (and to the CUDA kernels' operation order). A butterfly computed as
fma(v, +-1, p) rounds once to the same value as the add or subtract; it only moves the
work to the FMA ports, and is used only where the host has FMA.

RHT layout (one partition of n floats): chunks of 256 floats go through registers (signs,
scale and the 8 strides below 256), then each larger stride level (256, 4096, 65536, ...)
is a radix-16 sweep across 16 rows of one vector each. Levels run in cache order: a 4096
block is finished while it sits in L1, a 65536 group in L2, the partition in L3. The
intermediate partition lives in a per-thread scratch buffer whose rows are padded (16
floats per 4096 and per 2^20) so that the 16 rows of a sweep fall in different cache sets;
only the last level writes the output, with non-temporal stores for large tensors (no
read-for-ownership of the output, no cache pollution). Reading the input once and writing
the output once is the same memory traffic as an in-place FWHT.

Numba's on-disk cache keys a function on its own source file only, so the kernels that
use these intrinsics live in this file: editing an intrinsic invalidates them too.
"""
from __future__ import annotations

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import rng

LANES = 16                   # floats per vector
CHUNK = 256                  # floats transformed in registers (16 vectors)
QGROUP = 32                  # elements per quantizer step (16 packed bytes)
PAD = 16                     # scratch floats added per 4096 and per 2^20 floats

_F32 = ir.FloatType()
_I1, _I8, _I16, _I32, _I64 = (ir.IntType(b) for b in (1, 8, 16, 32, 64))
_VF = ir.VectorType(_F32, LANES)
_VB = ir.VectorType(_I1, LANES)
_VI32 = ir.VectorType(_I32, LANES)
_VI64 = ir.VectorType(_I64, LANES)
_VI8 = ir.VectorType(_I8, LANES)


def _host_has(feature: str) -> bool:
    """Whether the compile target has an LLVM CPU feature ("fma", "avx2", "avx512f")."""
    name = numba.config.CPU_NAME
    if name and name != "host":                       # a fixed target (e.g. portable cache)
        return f"+{feature}" in (numba.config.CPU_FEATURES or "")
    return bool(llvm_binding.get_host_cpu_features().get(feature, False))


USE_FMA = _host_has("fma")


# ---- IR helpers ---------------------------------------------------------------------------
def _element_ptr(context, builder, arrty, arr, idx):
    ary = context.make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False)


def _vector_ptr(builder, ptr, offset, vty=_VF):
    """Pointer to the vector starting `offset` elements after the element pointer `ptr`."""
    if offset:
        ptr = builder.gep(ptr, [ir.Constant(_I64, offset)])
    return builder.bitcast(ptr, vty.as_pointer())


def _splat(builder, value, vty=_VF):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(_VI32, [0] * vty.count))


def _const_vec(vty, values):
    return ir.Constant(vty, list(values))


def _mix64(builder, z):
    """rng.mix64 (the splitmix64 finalizer) on an i64 or a vector of i64."""
    def c(v):
        return _const_vec(z.type, [v] * z.type.count) if isinstance(z.type, ir.VectorType) \
            else ir.Constant(_I64, v)
    z = builder.mul(builder.xor(z, builder.lshr(z, c(30))), c(rng.MUL1))
    z = builder.mul(builder.xor(z, builder.lshr(z, c(27))), c(rng.MUL2))
    return builder.xor(z, builder.lshr(z, c(31)))


def _sign_mask(builder, key, pos):
    """<16 x i1>: lane l set when the Rademacher sign of padded position pos + l is -1
    (pos a multiple of 16: bits (pos mod 64) .. +15 of the hash of pos // 64)."""
    counter = builder.add(builder.lshr(pos, ir.Constant(_I64, 6)), ir.Constant(_I64, 1))
    word = _mix64(builder, builder.add(key, builder.mul(counter, ir.Constant(_I64, rng.GOLDEN))))
    word = builder.lshr(word, builder.and_(pos, ir.Constant(_I64, 63)))
    return builder.bitcast(builder.trunc(word, _I16), _VB)


def _signed_scaled(builder, v, mask, scale_vec):
    """sign * (v * scale): the product is exact-sign symmetric, so this equals the
    reference's (v * sign) * scale bit for bit."""
    v = builder.fmul(v, scale_vec)
    return builder.select(mask, builder.fneg(v), v)


def _fma_fn(builder):
    mod = builder.module
    name = "llvm.fma.v16f32"
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(_VF, [_VF, _VF, _VF]), name)
    return fn


def _lane_stages(builder, v):
    """Strides 1, 2, 4, 8 of the FWHT inside one vector. Lane l with stride bit s clear
    gets v[l] + v[l^s], set gets v[l^s] - v[l], exactly the radix-2 butterfly."""
    s = 1
    while s < LANES:
        partner = builder.shuffle_vector(v, v, _const_vec(_VI32, [l ^ s for l in range(LANES)]))
        high = [bool(l & s) for l in range(LANES)]
        if USE_FMA:
            signs = _const_vec(_VF, [-1.0 if h else 1.0 for h in high])
            v = builder.call(_fma_fn(builder), [v, signs, partner])
        else:
            v = builder.select(_const_vec(_VB, high), builder.fsub(partner, v),
                               builder.fadd(v, partner))
        s *= 2
    return v


def _cross_stages(builder, vs):
    """Radix-2 stages across a list of vectors (strides 1 .. len/2 in list positions)."""
    s = 1
    while s < len(vs):
        out = list(vs)
        for i in range(len(vs)):
            if not i & s:
                out[i] = builder.fadd(vs[i], vs[i + s])
                out[i + s] = builder.fsub(vs[i], vs[i + s])
        vs = out
        s *= 2
    return vs


def _branch(builder, flag, then_fn, values):
    """then_fn(values) if the runtime i1 `flag` else values, for a list of vectors: one
    branch per kernel call (skipping the work; LLVM may unswitch it out of the loop)."""
    with builder.if_else(flag) as (then, otherwise):
        with then:
            taken = then_fn(values)
            taken_block = builder.block
        with otherwise:
            other_block = builder.block
    out = []
    for t, v in zip(taken, values):
        phi = builder.phi(v.type)
        phi.add_incoming(t, taken_block)
        phi.add_incoming(v, other_block)
        out.append(phi)
    return out


def _store_all(builder, values, ptrs, nontemporal):
    """Store vectors; streaming (non-temporal, 64-byte aligned) when the runtime i1 is set."""
    with builder.if_else(nontemporal) as (streaming, normal):
        with streaming:
            for v, p in zip(values, ptrs):
                inst = builder.store(v, p, align=64)
                inst.set_metadata("nontemporal",
                                  builder.module.add_metadata([ir.Constant(_I32, 1)]))
        with normal:
            for v, p in zip(values, ptrs):
                builder.store(v, p, align=4)


def _hsum(builder, v):
    """Horizontal sum of a float vector (fixed tree order: deterministic)."""
    width = v.type.count
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(v, v, _const_vec(ir.VectorType(_I32, half), range(half)))
        hi = builder.shuffle_vector(v, v, _const_vec(ir.VectorType(_I32, half),
                                                     range(half, width)))
        v = builder.fadd(lo, hi)
        width = half
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _signed_all(builder, vs, positions, key, scale_vec):
    return [_signed_scaled(builder, v, _sign_mask(builder, key, p), scale_vec)
            for v, p in zip(vs, positions)]


def _finish(builder, vs, positions, dst_ptrs, key, scale_vec, sign, add_ptrs, has_add, nt):
    """Shared tail of the FWHT kernels: optional sign and scale (inverse RHT), optional
    added vectors (rotated-domain error feedback), store, and the sum of squares of what
    was stored (the partition norm for free)."""
    vs = _branch(builder, sign, lambda vs: _signed_all(builder, vs, positions, key, scale_vec),
                 vs)
    vs = _branch(builder, has_add, lambda vs: [
        builder.fadd(v, builder.load(ap, align=4)) for v, ap in zip(vs, add_ptrs)], vs)
    _store_all(builder, vs, dst_ptrs, nt)
    squares = _const_vec(_VF, [0.0] * LANES)
    for v in vs:
        squares = builder.fadd(squares, builder.fmul(v, v))
    return _hsum(builder, squares)


def _flag(builder, value):
    return builder.icmp_unsigned("!=", value, ir.Constant(value.type, 0))


# ---- FWHT intrinsics ----------------------------------------------------------------------
# Flags are runtime arguments (sign: 0 none, 1 first = forward RHT, 2 last = inverse RHT;
# nt: streaming stores; has_add: add a vector to the result), so that one kernel per shape
# covers every use.
SIGN_NONE, SIGN_FIRST, SIGN_LAST = 0, 1, 2
_CHUNK_KERNELS = {}
_ROW_KERNELS = {}


def chunk_kernel(nvec: int):
    """Intrinsic (src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add) -> float32:
    the FWHT of the 16 * nvec floats src[si:] (every stride below 16 * nvec) into dst[di:];
    pos is the padded position of the first float (for the signs). Returns the sum of
    squares of what it stored."""
    if nvec in _CHUNK_KERNELS:
        return _CHUNK_KERNELS[nvec]

    def typer(typingctx, src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add):
        sig = types.float32(src, types.intp, dst, types.intp, types.intp, types.uint64,
                            types.float32, types.intp, types.boolean, add, types.intp,
                            types.boolean)

        def codegen(context, builder, signature, args):
            (src_a, src_i, dst_a, dst_i, pos_v, key_v, scale_v, sign_v, nt_v, add_a, add_i,
             has_add_v) = args
            sp = _element_ptr(context, builder, signature.args[0], src_a, src_i)
            dp = _element_ptr(context, builder, signature.args[2], dst_a, dst_i)
            ap = _element_ptr(context, builder, signature.args[9], add_a, add_i)
            scale_vec = _splat(builder, scale_v)
            first = builder.icmp_signed("==", sign_v, ir.Constant(_I64, SIGN_FIRST))
            last = builder.icmp_signed("==", sign_v, ir.Constant(_I64, SIGN_LAST))
            positions = [builder.add(pos_v, ir.Constant(_I64, LANES * k)) for k in range(nvec)]
            vs = [builder.load(_vector_ptr(builder, sp, LANES * k), align=4)
                  for k in range(nvec)]
            vs = _branch(builder, first, lambda vs: _signed_all(builder, vs, positions, key_v,
                                                                scale_vec), vs)
            vs = _cross_stages(builder, [_lane_stages(builder, v) for v in vs])
            return _finish(builder, vs, positions,
                           [_vector_ptr(builder, dp, LANES * k) for k in range(nvec)],
                           key_v, scale_vec, last,
                           [_vector_ptr(builder, ap, LANES * k) for k in range(nvec)],
                           _flag(builder, has_add_v), _flag(builder, nt_v))
        return sig, codegen

    typer.__name__ = f"fwht_chunk_{nvec}"
    _CHUNK_KERNELS[nvec] = intrinsic(typer)
    return _CHUNK_KERNELS[nvec]


def row_kernel(nrows: int):
    """Intrinsic (src, si, sstride, dst, di, dstride, pos, pstride, key, scale, sign, nt,
    add, ai, has_add) -> float32: the radix-nrows butterflies (one FWHT stride level per
    factor of 2) across the nrows vectors src[si + r*sstride], into dst[di + r*dstride]
    (row r at padded position pos + r*pstride; the added vector at add[ai + r*dstride]).
    Returns the sum of squares of what it stored."""
    if nrows in _ROW_KERNELS:
        return _ROW_KERNELS[nrows]

    def typer(typingctx, src, si, sstride, dst, di, dstride, pos, pstride, key, scale, sign,
              nt, add, ai, has_add):
        sig = types.float32(src, types.intp, types.intp, dst, types.intp, types.intp,
                            types.intp, types.intp, types.uint64, types.float32, types.intp,
                            types.boolean, add, types.intp, types.boolean)

        def codegen(context, builder, signature, args):
            (src_a, src_i, src_s, dst_a, dst_i, dst_s, pos_v, pos_s, key_v, scale_v, sign_v,
             nt_v, add_a, add_i, has_add_v) = args
            sp = _element_ptr(context, builder, signature.args[0], src_a, src_i)
            dp = _element_ptr(context, builder, signature.args[3], dst_a, dst_i)
            ap = _element_ptr(context, builder, signature.args[12], add_a, add_i)

            def row(ptr, stride, r):
                off = builder.mul(stride, ir.Constant(_I64, r))
                return builder.bitcast(builder.gep(ptr, [off]), _VF.as_pointer())
            vs = [builder.load(row(sp, src_s, r), align=4) for r in range(nrows)]
            vs = _cross_stages(builder, vs)
            positions = [builder.add(pos_v, builder.mul(pos_s, ir.Constant(_I64, r)))
                         for r in range(nrows)]
            last = builder.icmp_signed("==", sign_v, ir.Constant(_I64, SIGN_LAST))
            return _finish(builder, vs, positions, [row(dp, dst_s, r) for r in range(nrows)],
                           key_v, _splat(builder, scale_v), last,
                           [row(ap, dst_s, r) for r in range(nrows)],
                           _flag(builder, has_add_v), _flag(builder, nt_v))
        return sig, codegen

    typer.__name__ = f"fwht_rows_{nrows}"
    _ROW_KERNELS[nrows] = intrinsic(typer)
    return _ROW_KERNELS[nrows]


@intrinsic
def _store_fence(typingctx):
    """A full fence: orders this thread's streaming stores before what follows."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return sig, codegen


_chunk1, _chunk2, _chunk4, _chunk8, _chunk16 = (chunk_kernel(n) for n in (1, 2, 4, 8, 16))
_rows2, _rows4, _rows8, _rows16 = (row_kernel(n) for n in (2, 4, 8, 16))


# ---- FWHT drivers -------------------------------------------------------------------------
@njit(cache=True, inline="always")
def scratch_index(p):
    """Where partition offset p lives in the padded scratch buffer."""
    return p + PAD * (p >> 12) + PAD * (p >> 20)


def scratch_size(n: int) -> int:
    return int(scratch_index(n)) + LANES


@njit(cache=True, inline="always")
def _chunk(nvec, src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add):
    if nvec == 16:
        return _chunk16(src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add)
    if nvec == 8:
        return _chunk8(src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add)
    if nvec == 4:
        return _chunk4(src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add)
    if nvec == 2:
        return _chunk2(src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add)
    return _chunk1(src, si, dst, di, pos, key, scale, sign, nt, add, ai, has_add)


@njit(cache=True, inline="always")
def _rows(nrows, src, si, sstride, dst, di, dstride, pos, pstride, key, scale, sign, nt, add,
          ai, has_add):
    if nrows == 16:
        return _rows16(src, si, sstride, dst, di, dstride, pos, pstride, key, scale, sign, nt,
                       add, ai, has_add)
    if nrows == 8:
        return _rows8(src, si, sstride, dst, di, dstride, pos, pstride, key, scale, sign, nt,
                      add, ai, has_add)
    if nrows == 4:
        return _rows4(src, si, sstride, dst, di, dstride, pos, pstride, key, scale, sign, nt,
                      add, ai, has_add)
    return _rows2(src, si, sstride, dst, di, dstride, pos, pstride, key, scale, sign, nt, add,
                  ai, has_add)


@njit(cache=True, inline="always")
def _level(scratch, dst, di, n, pos, key, scale, base, stride, t0, t1, sign, nt, add,
           has_add):
    """Stride level `stride` over the group of min(16*stride, n) floats at partition offset
    `base`, columns t0..t1 (multiples of 16): in place in the scratch, or into dst (with
    the last signs, the added vector and streaming stores) when the group is the whole
    partition. Returns the sum of squares written to dst (0 for a scratch level)."""
    group = min(16 * stride, n)
    sstride = scratch_index(stride)      # rows of an aligned group are equally spaced
    squares = np.float64(0.0)
    if group == n:
        rows = n // stride
        for t in range(t0, t1, LANES):
            squares += _rows(rows, scratch, scratch_index(base + t), sstride, dst,
                             di + base + t, stride, pos + base + t, stride, key, scale, sign,
                             nt, add, di + base + t, has_add)
    else:
        for t in range(t0, t1, LANES):
            s = scratch_index(base + t)
            _rows(16, scratch, s, sstride, scratch, s, sstride, 0, 0, key, scale, SIGN_NONE,
                  False, scratch, 0, False)
    return squares


@njit(cache=True, inline="always")
def _chunk_into_scratch(src, si, scratch, p, pos, key, scale, sign):
    _chunk(16, src, si, scratch, scratch_index(p), pos, key, scale,
           SIGN_FIRST if sign == SIGN_FIRST else SIGN_NONE, False, scratch, 0, False)


@njit(cache=True, nogil=True)
def _partition(src, si, dst, di, n, pos, key, scale, scratch, sign, nt, add, has_add):
    """One partition of n >= 16 floats, src[si:si+n] -> dst[di:di+n] (pos: padded position
    of its first float); returns the sum of squares of the output. Post-order: after each
    chunk, every stride level whose group the chunk completes, so each level runs while
    its group is still cached."""
    if n <= CHUNK:
        return np.float64(_chunk(n // LANES, src, si, dst, di, pos, key, scale, sign, nt, add,
                                 di, has_add))
    squares = np.float64(0.0)
    for c in range(n // CHUNK):
        p = c * CHUNK
        _chunk_into_scratch(src, si + p, scratch, p, pos + p, key, scale, sign)
        squares += _completed_levels(scratch, dst, di, n, pos, key, scale, p + CHUNK, sign,
                                     nt, add, has_add)
    return squares


@njit(cache=True, inline="always")
def _completed_levels(scratch, dst, di, n, pos, key, scale, done, sign, nt, add, has_add):
    """Every stride level whose group the first `done` floats of the partition complete
    (in the scratch since the chunk just transformed); their sum of squares written to dst."""
    squares = np.float64(0.0)
    stride = CHUNK
    while stride < n:
        group = min(16 * stride, n)
        if done % group:
            break
        squares += _level(scratch, dst, di, n, pos, key, scale, done - group, stride, 0,
                          stride, sign, nt, add, has_add)
        stride = group
    return squares


def _shared_partition_driver(sign, nt, has_add):
    @njit(cache=True, parallel=True, nogil=True)
    def shared_partition(src, si, dst, di, n, pos, key, scale, scratch, add):
        for b in prange(n // 4096):
            for c in range(16):
                p = b * 4096 + c * CHUNK
                _chunk_into_scratch(src, si + p, scratch, p, pos + p, key, scale, sign)
            _level(scratch, dst, di, n, pos, key, scale, b * 4096, CHUNK, 0, CHUNK, sign, nt,
                   add, has_add)
        squares = np.float64(0.0)
        stride = 4096
        while stride < n:
            group = min(16 * stride, n)
            cols = stride // 256                     # tasks of 256 columns
            tasks = (n // group) * cols
            partial = np.zeros(tasks, dtype=np.float64)
            for task in prange(tasks):
                base = (task // cols) * group
                t0 = (task % cols) * 256
                partial[task] = _level(scratch, dst, di, n, pos, key, scale, base, stride, t0,
                                       t0 + 256, sign, nt, add, has_add)
                if nt:
                    _store_fence()
            for task in range(tasks):
                squares += partial[task]
            stride = group
        return squares
    return shared_partition


def _partitions_driver(sign, nt, has_add):
    @njit(cache=True, parallel=True, nogil=True)
    def partitions(src, si, dst, di, n, count, pos, key, scale, scratch, add, squares):
        threads = scratch.shape[0]
        for t in prange(threads):
            for k in range(t, count, threads):
                squares[k] = _partition(src, si + k * n, dst, di + k * n, n, pos + k * n, key,
                                        scale, scratch[t], sign, nt, add, has_add)
            if nt:
                _store_fence()
    return partitions


# ---- decode fused into the inverse RHT --------------------------------------------------
@njit(cache=True, inline="always", error_model="numpy")
def _decode_into(sums, si, counts, per_element, m, st, tmp, length):
    """tmp[:length] = the rotated-domain values of sums[si:si+length], with the operations
    of thc.reference.decode_rotated: (Y / count) * step - M, count 0 -> 0."""
    y = sums[si:si + length]
    t = tmp[:length]
    if per_element:
        cs = counts[si:si + length]
        for i in range(length):
            c = cs[i]
            v = (np.float32(y[i]) / c) * st - m
            t[i] = v if c > 0 else np.float32(0.0)
    else:
        c = counts[0]
        if c > 0:
            for i in range(length):
                t[i] = (np.float32(y[i]) / c) * st - m
        else:
            for i in range(length):
                t[i] = np.float32(0.0)


@njit(cache=True, parallel=True, nogil=True)
def decode_rotated(sums, counts, half, step, log_p, out, task):
    """out = -M + (Y / count) * step per element (count 0 -> 0); counts: 1 entry or one
    each. Tasks of `task` values never straddle a partition, so M and step are loop
    constants and the loop vectorizes (same float32 operations as the reference)."""
    n = out.shape[0]
    task = min(task, 1 << log_p)
    per_element = counts.shape[0] > 1
    for t in prange((n + task - 1) // task):
        lo = t * task
        hi = min(n, lo + task)
        part = lo >> log_p
        _decode_into(sums, lo, counts, per_element, half[part], step[part], out[lo:hi],
                     hi - lo)


@njit(cache=True, nogil=True, error_model="numpy")    # count 0: y / 0, then dropped
def _decoded_partition(sums, si, counts, per_element, m, st, dst, di, n, key, scale, scratch,
                       tmp, nt):
    """_partition's inverse RHT of one partition (its padded position is si), its input
    decoded chunk by chunk into tmp (256 floats, in L1) just before the chunk's register
    stages: the decoded tensor never goes to memory. Streaming stores and the last signs
    as in _partition with SIGN_LAST."""
    if n <= CHUNK:
        _decode_into(sums, si, counts, per_element, m, st, tmp, n)
        _chunk(n // LANES, tmp, 0, dst, di, si, key, scale, SIGN_LAST, nt, dst, di, False)
        return
    for c in range(n // CHUNK):
        p = c * CHUNK
        _decode_into(sums, si + p, counts, per_element, m, st, tmp, CHUNK)
        _chunk_into_scratch(tmp, 0, scratch, p, si + p, key, scale, SIGN_LAST)
        _completed_levels(scratch, dst, di, n, si, key, scale, p + CHUNK, SIGN_LAST, nt, dst,
                          False)


@njit(cache=True, parallel=True, nogil=True)
def decode_inverse_partitions(sums, counts, half, step, dst, n, count, key, scale, scratch,
                              tmp, nt):
    """The first `count` partitions of n >= 16 values: dst[k*n:(k+1)*n] = the inverse RHT of
    partition k of sums decoded with half[k], step[k] and counts (one entry, or one per
    element), bit for bit as decode_rotated then fwht_partitions(SIGN_LAST). scratch and
    tmp: one row per thread (scratch_size(n) and CHUNK floats)."""
    threads = scratch.shape[0]
    per_element = counts.shape[0] > 1
    for t in prange(threads):
        for k in range(t, count, threads):
            _decoded_partition(sums, k * n, counts, per_element, half[k], step[k], dst, k * n,
                               n, key, scale, scratch[t], tmp[t], nt)
        if nt:
            _store_fence()

# One compiled driver per (signs, streaming stores, added vector): the flags are constants
# inside, so the kernels carry no branches for them; each is compiled on first use.
_DRIVERS = {}


def _driver(kind, sign, nt, has_add):
    spec = (kind, int(sign), bool(nt), bool(has_add))
    fn = _DRIVERS.get(spec)
    if fn is None:
        make = _partitions_driver if kind == "partitions" else _shared_partition_driver
        fn = _DRIVERS[spec] = make(*spec[1:])
    return fn


def fwht_partitions(src, si, dst, di, n, count, pos, key, scale, scratch, sign, nt, add,
                    has_add, squares):
    """`count` consecutive partitions of n >= 16 floats: src[si + k*n:] -> dst[di + k*n:]
    (+ add[di + k*n:] when has_add), padded position pos + k*n, signs SIGN_NONE (plain
    FWHT), SIGN_FIRST (forward RHT) or SIGN_LAST (inverse). squares[k]: the sum of squares
    of partition k's output. scratch: (threads, scratch_size(n)) float32 (unused when
    n <= 256); thread t takes partitions t, t + threads, ... with its own scratch row."""
    _driver("partitions", sign, nt, has_add)(src, si, dst, di, n, count, pos, key, scale,
                                             scratch, add, squares)


def fwht_shared_partition(src, si, dst, di, n, pos, key, scale, scratch, sign, nt, add,
                          has_add):
    """One partition of n > 4096 floats, every thread working on it, level by level: the
    first two levels per 4096 block, then one parallel sweep per stride level. Returns the
    sum of squares of the output (per-task partial sums added in task order)."""
    return _driver("shared", sign, nt, has_add)(src, si, dst, di, n, pos, key, scale, scratch,
                                                add)


# ---- norms --------------------------------------------------------------------------------
_VD = ir.VectorType(ir.DoubleType(), LANES)


@intrinsic
def _sumsq256(typingctx, x, i):
    """Sum of squares of x[i:i+256] in float64 (16 lanes, fixed order: deterministic)."""
    sig = types.float64(x, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _element_ptr(context, builder, signature.args[0], *args)
        acc = ir.Constant(_VD, [0.0] * LANES)
        for k in range(CHUNK // LANES):
            v = builder.fpext(builder.load(_vector_ptr(builder, ptr, LANES * k), align=4), _VD)
            acc = builder.fadd(acc, builder.fmul(v, v))
        return _hsum(builder, acc)
    return sig, codegen


@njit(cache=True, parallel=True, nogil=True)
def sum_squares(x, starts, lengths, chunk):
    """Sum of squares of every x[starts[k]:starts[k]+lengths[k]], in float64. Work is split
    into chunks of `chunk` floats (a multiple of 256) over the threads; the per-chunk sums
    are added in order, so the result does not depend on the thread count."""
    parts = starts.shape[0]
    per_part = np.empty(parts, dtype=np.int64)
    total = 0
    for k in range(parts):
        per_part[k] = (lengths[k] + chunk - 1) // chunk
        total += per_part[k]
    first = np.empty(parts, dtype=np.int64)
    acc = 0
    for k in range(parts):
        first[k] = acc
        acc += per_part[k]
    sums = np.zeros(total, dtype=np.float64)
    owner = np.empty(total, dtype=np.int64)
    for k in range(parts):
        for c in range(per_part[k]):
            owner[first[k] + c] = k
    for t in prange(total):
        k = owner[t]
        lo = starts[k] + (t - first[k]) * chunk
        hi = min(lo + chunk, starts[k] + lengths[k])
        s = 0.0
        i = lo
        while i + CHUNK <= hi:
            s += _sumsq256(x, i)
            i += CHUNK
        while i < hi:
            v = np.float64(x[i])
            s += v * v
            i += 1
        sums[t] = s
    out = np.zeros(parts, dtype=np.float64)
    for t in range(total):
        out[owner[t]] += sums[t]
    return out


# ---- quantizer ----------------------------------------------------------------------------
def _permute_lookup() -> str | None:
    """Which in-register lookup the target's vectors allow: "avx512" (vpermt2d, vpermps
    on 16 lanes; the host's own CPU only), "avx2" (byte tables, 128-bit pshufb; also a
    fixed target whose NUMBA_CPU_FEATURES name +avx2), or None (gathers)."""
    if _host_has("avx512f") and numba.config.CPU_NAME in (None, "host"):
        return "avx512"
    return "avx2" if _host_has("avx2") else None


# The small tables are looked up with in-register permutes instead of gathers: the grid
# has g + 1 <= 32 cells and the table 16 intervals, so each table fits in a few vector
# registers. Without them LLVM turns a gather into 16 scalar loads on CPUs whose gathers
# it rates slow (AMD before Zen 3), the quantizer's main cost there.
PERMUTE_LOOKUP = _permute_lookup()
PERMUTE_MAX_G = 31


def _gather(builder, table_ptr, idx32, vty):
    """table[idx] per lane (llvm.masked.gather; LLVM lowers it to vgather or scalar loads)."""
    base = builder.ptrtoint(table_ptr, _I64)
    offsets = builder.mul(builder.zext(idx32, _VI64), _const_vec(_VI64, [4] * LANES))
    ptrs = builder.inttoptr(builder.add(_splat(builder, base, _VI64), offsets),
                            ir.VectorType(table_ptr.type, LANES))
    name = f"llvm.masked.gather.v16{'f32' if vty == _VF else 'i32'}.v16p0"
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(vty, [ptrs.type, _I32, _VB, vty]), name)
    return builder.call(fn, [ptrs, ir.Constant(_I32, 4), _const_vec(_VB, [1] * LANES),
                             ir.Constant(vty, ir.Undefined)])


def _x86_fn(builder, name, ret, args):
    fn = builder.module.globals.get(name)
    return fn or ir.Function(builder.module, ir.FunctionType(ret, args), name)


class _Lookup:
    """The quantizer's three table lookups for 16 lanes: the interval of a grid cell (its
    index j and lower end T[j]), 1 / width of an interval, and T[z] as a float."""

    def interval(self, c):
        """(j, float(T[j])) for grid cells c: from cells[c] = (T[j] << 8) | j."""
        packed = self.cell(c)
        j = self.builder.and_(packed, _const_vec(_VI32, [255] * LANES))
        lo = self.builder.sitofp(self.builder.lshr(packed, _const_vec(_VI32, [8] * LANES)), _VF)
        return j, lo


class _GatherLookup(_Lookup):
    """Cell, interval and value tables in memory, looked up with gathers (any target,
    any g)."""

    def __init__(self, builder, cells_ptr, inv_ptr, table_ptr, shuffle_ptr):
        self.builder, self.cells, self.inv, self.table = builder, cells_ptr, inv_ptr, table_ptr

    def cell(self, idx):
        # the mask tells LLVM the index is small: 32-bit gather offsets
        idx = self.builder.and_(idx, _const_vec(_VI32, [0xFFFF] * LANES))
        return _gather(self.builder, self.cells, idx, _VI32)

    def inv_width(self, j):
        return _gather(self.builder, self.inv, j, _VF)

    def value(self, z):
        return _gather(self.builder, self.table, z, _VF)


class _PermuteLookup(_Lookup):
    """The same tables held in registers (cells: 32 ints in two vectors, inv_width: 16
    floats), looked up with AVX-512 permutes; needs g <= 31."""

    def __init__(self, builder, cells_ptr, inv_ptr, table_ptr, shuffle_ptr):
        self.builder = builder
        self.lo = builder.load(_vector_ptr(builder, cells_ptr, 0, _VI32), align=4)
        self.hi = builder.load(_vector_ptr(builder, cells_ptr, LANES, _VI32), align=4)
        self.inv = builder.load(_vector_ptr(builder, inv_ptr, 0), align=4)
        self.table = builder.load(_vector_ptr(builder, table_ptr, 0), align=4)

    def cell(self, idx):
        fn = _x86_fn(self.builder, "llvm.x86.avx512.vpermi2var.d.512", _VI32,
                     [_VI32, _VI32, _VI32])
        return self.builder.call(fn, [self.lo, idx, self.hi])

    def inv_width(self, j):
        return self._permute(self.inv, j)

    def value(self, z):
        return self._permute(self.table, z)

    def _permute(self, table, idx):
        fn = _x86_fn(self.builder, "llvm.x86.avx512.permvar.sf.512", _VF, [_VF, _VI32])
        return self.builder.call(fn, [table, idx])


SHUFFLE_TABLE_BYTES = 112      # the byte tables of _ByteShuffleLookup (shuffle_tables)


class _ByteShuffleLookup(_Lookup):
    """The same tables as bytes, looked up 16 lanes at a time with one 128-bit pshufb
    (SSSE3) per 16-entry table: cells by two, T[j] by one, a float 1/width by four (its
    bytes). AVX2's 8-lane vpermd/vpermps would need four and two permutes per half vector
    plus blends, and on AMD before Zen 2 a 256-bit vpermd is 3 uops, one per 4 cycles:
    on a Zen 1 the quantizer took 16.2 ms per 2^22 elements with them, 12.7 with these
    (one thread, no error output). Exact: the bytes are the tables' own
    (shuffle_tables). Needs g <= 31 and a table of integers below 256."""

    def __init__(self, builder, cells_ptr, inv_ptr, table_ptr, shuffle_ptr):
        self.builder = builder
        rows = [builder.load(_vector_ptr(builder, shuffle_ptr, 16 * k, _VI8), align=1)
                for k in range(SHUFFLE_TABLE_BYTES // 16)]
        self.cell_j, self.lower, self.inv_bytes = rows[0:2], rows[2], rows[3:7]

    def _pshufb(self, table, idx8):
        fn = _x86_fn(self.builder, "llvm.x86.ssse3.pshuf.b.128", _VI8, [_VI8, _VI8])
        return self.builder.call(fn, [table, idx8])

    def _bytes(self, v):
        return self.builder.trunc(v, _VI8)

    def interval(self, c):
        b = self.builder
        c8 = self._bytes(c)
        above = b.icmp_unsigned(">=", c8, _const_vec(_VI8, [16] * LANES))
        j8 = b.select(above, self._pshufb(self.cell_j[1], c8), self._pshufb(self.cell_j[0], c8))
        lo = b.uitofp(b.zext(self._pshufb(self.lower, j8), _VI32), _VF)
        return b.zext(j8, _VI32), lo

    def inv_width(self, j):
        """The float's four bytes, each from its own 16-byte table, interleaved."""
        b = self.builder
        j8 = self._bytes(j)
        parts = [self._pshufb(t, j8) for t in self.inv_bytes]
        pairs = _const_vec(ir.VectorType(_I32, 2 * LANES),
                           [v for k in range(LANES) for v in (k, LANES + k)])
        w16 = ir.VectorType(_I16, LANES)
        low = b.bitcast(b.shuffle_vector(parts[0], parts[1], pairs), w16)
        high = b.bitcast(b.shuffle_vector(parts[2], parts[3], pairs), w16)
        return b.bitcast(b.shuffle_vector(low, high, pairs), _VF)

    def value(self, z):
        return self.builder.uitofp(self.builder.zext(
            self._pshufb(self.lower, self._bytes(z)), _VI32), _VF)


def _quantize_lanes(builder, x, m, sc, g, u, lookup):
    """The reference's index for 16 elements: clamp to [-m, m], y = min((x + m) sc, g),
    j and T[j] from the cell floor(y), round up when u < (y - T[j]) * inv_width[j]."""
    x = builder.select(builder.fcmp_ordered(">", x, builder.fneg(m)), x, builder.fneg(m))
    x = builder.select(builder.fcmp_ordered("<", x, m), x, m)
    y = builder.fmul(builder.fadd(x, m), sc)
    y = builder.select(builder.fcmp_ordered("<", y, g), y, g)
    # y is in [0, g] and T[j] < 2^23: the signed conversions (one instruction on AVX2,
    # which has no unsigned ones) give the same numbers as unsigned ones would.
    j, lo = lookup.interval(builder.fptosi(y, _VI32))
    up = builder.fcmp_ordered("<", u, builder.fmul(builder.fsub(y, lo), lookup.inv_width(j)))
    return builder.add(j, builder.zext(up, _VI32))


def _uniforms(builder, word):
    """The uniforms of 32 elements in their own order from the 16 hash words: element
    2k + e takes bits 40..63 (e = 0) or 8..31 (e = 1) of word k, i.e. the high or the low
    32-bit half of the word shifted right by 8. As 32-bit lanes of the words, element l
    reads lane l ^ 1. The 24-bit values convert exactly with the signed i32 -> float
    instruction (AVX2 has no unsigned or i64 one)."""
    vi32 = ir.VectorType(_I32, 2 * LANES)
    halves = builder.bitcast(word, vi32)
    swapped = builder.shuffle_vector(halves, halves, _const_vec(
        vi32, [lane ^ 1 for lane in range(2 * LANES)]))
    fields = builder.lshr(swapped, _const_vec(vi32, [8] * (2 * LANES)))
    unit = _const_vec(_VF, [float(rng.UNIFORM_SCALE)] * LANES)
    return [builder.fmul(builder.sitofp(builder.shuffle_vector(fields, fields, _const_vec(
        _VI32, range(h * LANES, (h + 1) * LANES))), _VF), unit) for h in range(2)]


def _quantize_kernel(lookup_cls):
    def typer(typingctx, rot, ri, out, oi, m, sc, g, cells, inv_width, key, table, shuffle,
              step, err, has_err):
        """32 elements rot[ri:ri+32] -> 16 packed bytes out[oi:oi+16] (oi = ri / 2);
        returns how many were NaN/Inf (those quantize as 0). Element 2k+e uses bits
        40..63 (e = 0) or 8..31 (e = 1) of the hash of counter k, as rng specifies.
        has_err: also err[ri:ri+32] = x - (T[z] * step - m), the element minus its own
        dequantized value (rotated-domain error feedback), as dequantize computes it."""
        sig = types.int64(rot, types.intp, out, types.intp, types.float32, types.float32,
                          types.float32, cells, inv_width, types.uint64, table, shuffle,
                          types.float32, err, types.boolean)

        def codegen(context, builder, signature, args):
            (rot_a, ri_v, out_a, oi_v, m_v, sc_v, g_v, cells_a, inv_a, key_v, table_a,
             shuffle_a, step_v, err_a, has_err_v) = args
            rp = _element_ptr(context, builder, signature.args[0], rot_a, ri_v)
            op = _element_ptr(context, builder, signature.args[2], out_a, oi_v)
            ep = _element_ptr(context, builder, signature.args[13], err_a, ri_v)
            zero = ir.Constant(_I64, 0)
            lookup = lookup_cls(
                builder, _element_ptr(context, builder, signature.args[7], cells_a, zero),
                _element_ptr(context, builder, signature.args[8], inv_a, zero),
                _element_ptr(context, builder, signature.args[10], table_a, zero),
                _element_ptr(context, builder, signature.args[11], shuffle_a, zero))
            xs_in = [builder.load(_vector_ptr(builder, rp, h * LANES), align=4)
                     for h in range(2)]
            counters = builder.add(_splat(builder, oi_v, _VI64),
                                   _const_vec(_VI64, range(1, LANES + 1)))
            word = _mix64(builder, builder.add(_splat(builder, key_v, _VI64), builder.mul(
                counters, _const_vec(_VI64, [rng.GOLDEN] * LANES))))
            us = _uniforms(builder, word)
            inf = _const_vec(_VF, [float("inf")] * LANES)
            zeros = _const_vec(_VF, [0.0] * LANES)
            m, sc, g = (_splat(builder, v) for v in (m_v, sc_v, g_v))
            bad = ir.Constant(_I64, 0)
            xs, z = [], []
            for x, u in zip(xs_in, us):
                finite = builder.fcmp_ordered("<", builder.call(_fabs_fn(builder), [x]), inf)
                bad = builder.add(bad, builder.zext(builder.call(_ctpop16_fn(builder), [
                    builder.bitcast(builder.not_(finite), _I16)]), _I64))
                xs.append(builder.select(finite, x, zeros))
                z.append(_quantize_lanes(builder, xs[-1], m, sc, g, u, lookup))
            # indices are 0..15: narrowed to bytes first, the pairs are byte shuffles
            z8 = [builder.trunc(zz, _VI8) for zz in z]
            even, odd = (builder.shuffle_vector(z8[0], z8[1], _const_vec(
                _VI32, range(e, 2 * LANES, 2))) for e in (0, 1))
            byte = builder.or_(builder.shl(even, _const_vec(_VI8, [4] * LANES)), odd)
            builder.store(byte, _vector_ptr(builder, op, 0, _VI8), align=1)
            with builder.if_then(_flag(builder, has_err_v)):
                step = _splat(builder, step_v)
                for h, (x, zz) in enumerate(zip(xs, z)):
                    e = builder.fsub(x, builder.fsub(builder.fmul(lookup.value(zz), step), m))
                    builder.store(e, _vector_ptr(builder, ep, h * LANES), align=4)
            return bad
        return sig, codegen
    typer.__name__ = f"quantize32_{lookup_cls.__name__.strip('_').lower()}"
    return intrinsic(typer)


_quantize32_gather = _quantize_kernel(_GatherLookup)
_quantize32_fast = (_quantize_kernel({"avx512": _PermuteLookup, "avx2": _ByteShuffleLookup}
                                     [PERMUTE_LOOKUP]) if PERMUTE_LOOKUP else _quantize32_gather)


def _fabs_fn(builder):
    fn = builder.module.globals.get("llvm.fabs.v16f32")
    return fn or ir.Function(builder.module, ir.FunctionType(_VF, [_VF]), "llvm.fabs.v16f32")


def _ctpop16_fn(builder):
    fn = builder.module.globals.get("llvm.ctpop.i16")
    return fn or ir.Function(builder.module, ir.FunctionType(_I16, [_I16]), "llvm.ctpop.i16")


_mix64_scalar = njit(cache=True, inline="always")(rng.mix64)


@njit(cache=True, inline="always")
def _index_scalar(x, m, sc, g, cells, inv_width, u):
    x = min(max(x, -m), m)
    y = min((x + m) * sc, g)
    packed = cells[np.int64(y)]
    j = packed & 255
    frac = (y - np.float32(packed >> 8)) * inv_width[j]
    return j + np.int32(u < frac)


@njit(cache=True, inline="always")
def _quantize_bytes_scalar(rot, out, k0, k1, m, sc, g, cells, inv_width, key, table, step,
                           err, has_err):
    bad = 0
    for k in range(k0, k1):
        word = _mix64_scalar(key + (np.uint64(k) + rng.U_ONE) * rng.U_GOLDEN)
        u0 = np.float32(word >> rng.U40) * rng.UNIFORM_SCALE
        u1 = np.float32((word >> rng.U8) & rng.U24MASK) * rng.UNIFORM_SCALE
        x0 = rot[2 * k]
        x1 = rot[2 * k + 1]
        if not np.isfinite(x0):
            bad += 1
            x0 = np.float32(0.0)
        if not np.isfinite(x1):
            bad += 1
            x1 = np.float32(0.0)
        z0 = _index_scalar(x0, m, sc, g, cells, inv_width, u0)
        z1 = _index_scalar(x1, m, sc, g, cells, inv_width, u1)
        out[k] = np.uint8((z0 << 4) | z1)
        if has_err:
            err[2 * k] = x0 - (table[z0] * step - m)
            err[2 * k + 1] = x1 - (table[z1] * step - m)
    return bad


QUANT_TASK = 1 << 15         # bytes per parallel task


@njit(cache=True, parallel=True, nogil=True)
def quantize(rot, half, scale, step, g, cells, inv_width, table, shuffle, log_p, key, out,
             err, has_err):
    """Packed 4-bit indices of rot (partition k = element >> log_p uses half[k], scale[k]);
    returns the number of NaN/Inf inputs (quantized as 0). cells[c] = (T[j] << 8) | j for
    the interval j holding grid cell c; bit-identical to thc.reference.quantize.
    has_err: err = rot - its own dequantized value (T[z] * step[k] - half[k])."""
    nbytes = out.shape[0]
    tasks = (nbytes + QUANT_TASK - 1) // QUANT_TASK
    fast = cells.shape[0] == 2 * LANES and inv_width.shape[0] == LANES
    bad = 0
    for task in prange(tasks):
        k0 = task * QUANT_TASK
        k1 = min(nbytes, k0 + QUANT_TASK)
        if log_p >= 5:                       # a 16-byte group never straddles partitions
            k = k0
            while k + 16 <= k1:
                part = (2 * k) >> log_p
                if fast:
                    bad += _quantize32_fast(rot, 2 * k, out, k, half[part], scale[part], g,
                                            cells, inv_width, key, table, shuffle, step[part],
                                            err, has_err)
                else:
                    bad += _quantize32_gather(rot, 2 * k, out, k, half[part], scale[part], g,
                                              cells, inv_width, key, table, shuffle, step[part],
                                              err, has_err)
                k += 16
            if k < k1:
                part = (2 * k) >> log_p
                bad += _quantize_bytes_scalar(rot, out, k, k1, half[part], scale[part], g,
                                              cells, inv_width, key, table, step[part], err,
                                              has_err)
        else:
            for k in range(k0, k1):
                part = (2 * k) >> log_p
                bad += _quantize_bytes_scalar(rot, out, k, k + 1, half[part], scale[part], g,
                                              cells, inv_width, key, table, step[part], err,
                                              has_err)
    return bad


def quantizer_tables(table: np.ndarray, lower: np.ndarray, inv_width: np.ndarray):
    """(cells, inv_width, values, shuffle) for quantize: cells[c] = (T[j] << 8) | j for the
    interval j holding grid cell c = 0..g; values = T as float32. Padded to 32 cells and
    16 widths (the register-table layout) when the host can use it and g <= 31; shuffle
    holds the same tables as bytes for the pshufb lookup (shuffle_tables)."""
    j = lower.astype(np.int32)
    cells = ((np.asarray(table, np.int32)[j] << 8) | j).astype(np.int32)
    inv = np.asarray(inv_width, np.float32)
    values = np.asarray(table, np.float32)
    shuffle = np.zeros(SHUFFLE_TABLE_BYTES, np.uint8)
    fits = len(cells) <= 2 * LANES and len(inv) <= LANES
    if PERMUTE_LOOKUP == "avx2":      # the byte lookup: T must be bytes too, else gathers
        fits = fits and len(values) <= LANES and bool(np.all(
            (values == np.round(values)) & (values >= 0) & (values <= 255)))
    if PERMUTE_LOOKUP and fits:
        cells = np.concatenate([cells, np.full(2 * LANES - len(cells), cells[-1], np.int32)])
        inv = np.concatenate([inv, np.ones(LANES - len(inv), np.float32)])
        if PERMUTE_LOOKUP == "avx2":
            shuffle = shuffle_tables(cells, inv, values)
    return cells, inv, values, shuffle


def shuffle_tables(cells: np.ndarray, inv: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The byte tables of _ByteShuffleLookup, 16-byte rows: the interval j of cells 0..15
    and 16..31, T[j] for j = 0..15, then byte k (k = 0..3, little-endian) of inv_width[j]
    (cells padded to 32, inv_width to 16, T integers in 0..255)."""
    t = np.zeros(LANES, np.uint8)
    t[:len(values)] = values
    inv_bytes = inv.astype("<f4").view(np.uint8).reshape(LANES, 4).T
    return np.concatenate([(cells & 255).astype(np.uint8), t, inv_bytes.ravel()])
