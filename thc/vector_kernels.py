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


def _host_has_fma() -> bool:
    name = numba.config.CPU_NAME
    if name and name != "host":                       # a fixed target (e.g. portable cache)
        return "+fma" in (numba.config.CPU_FEATURES or "")
    return bool(llvm_binding.get_host_cpu_features().get("fma", False))


USE_FMA = _host_has_fma()


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


def _store(builder, value, ptr, nontemporal):
    if not nontemporal:
        builder.store(value, ptr, align=4)
        return
    inst = builder.store(value, ptr, align=64)
    inst.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))


# ---- FWHT intrinsics ----------------------------------------------------------------------
_CHUNK_KERNELS = {}
_ROW_KERNELS = {}


def chunk_kernel(nvec: int, sign_in: bool, sign_out: bool):
    """Intrinsic (src, src_idx, dst, dst_idx, pos, key, scale): the FWHT of the 16 * nvec
    floats at src[src_idx:], all strides below 16 * nvec, written to dst[dst_idx:].
    sign_in: sign and scale first (forward RHT); sign_out: after (inverse). pos is the
    padded position of the first float (for the signs)."""
    spec = (nvec, sign_in, sign_out)
    if spec in _CHUNK_KERNELS:
        return _CHUNK_KERNELS[spec]

    def typer(typingctx, src, src_idx, dst, dst_idx, pos, key, scale):
        sig = types.void(src, types.intp, dst, types.intp, types.intp, types.uint64,
                         types.float32)

        def codegen(context, builder, signature, args):
            src_a, src_i, dst_a, dst_i, pos_v, key_v, scale_v = args
            sp = _element_ptr(context, builder, signature.args[0], src_a, src_i)
            dp = _element_ptr(context, builder, signature.args[2], dst_a, dst_i)
            scale_vec = _splat(builder, scale_v)
            vs = []
            for k in range(nvec):
                v = builder.load(_vector_ptr(builder, sp, LANES * k), align=4)
                if sign_in:
                    p = builder.add(pos_v, ir.Constant(_I64, LANES * k))
                    v = _signed_scaled(builder, v, _sign_mask(builder, key_v, p), scale_vec)
                vs.append(_lane_stages(builder, v))
            vs = _cross_stages(builder, vs)
            for k, v in enumerate(vs):
                if sign_out:
                    p = builder.add(pos_v, ir.Constant(_I64, LANES * k))
                    v = _signed_scaled(builder, v, _sign_mask(builder, key_v, p), scale_vec)
                builder.store(v, _vector_ptr(builder, dp, LANES * k), align=4)
            return context.get_dummy_value()
        return sig, codegen

    typer.__name__ = f"fwht_chunk_{nvec}_{int(sign_in)}{int(sign_out)}"
    _CHUNK_KERNELS[spec] = intrinsic(typer)
    return _CHUNK_KERNELS[spec]


def row_kernel(nrows: int, sign_out: bool, nontemporal: bool, strides=None):
    """Intrinsic (src, src_idx, src_stride, dst, dst_idx, dst_stride, pos, pos_stride, key,
    scale): the radix-nrows butterflies across nrows vectors src[src_idx + r*src_stride]
    (one FWHT stride level per factor of 2), written to dst[dst_idx + r*dst_stride].
    sign_out: then sign and scale (inverse RHT's last level), row r at padded position
    pos + r*pos_stride. nontemporal: streaming stores (dst must be 64-byte aligned)."""
    spec = (nrows, sign_out, nontemporal, strides)
    if spec in _ROW_KERNELS:
        return _ROW_KERNELS[spec]

    def typer(typingctx, src, src_idx, src_stride, dst, dst_idx, dst_stride, pos, pos_stride,
              key, scale):
        sig = types.void(src, types.intp, types.intp, dst, types.intp, types.intp, types.intp,
                         types.intp, types.uint64, types.float32)

        def codegen(context, builder, signature, args):
            (src_a, src_i, src_s, dst_a, dst_i, dst_s, pos_v, pos_s, key_v, scale_v) = args
            if strides is not None:          # compile-time strides: immediate offsets
                src_s, dst_s, pos_s = (ir.Constant(_I64, v) for v in strides)
            sp = _element_ptr(context, builder, signature.args[0], src_a, src_i)
            dp = _element_ptr(context, builder, signature.args[3], dst_a, dst_i)
            vs = []
            for r in range(nrows):
                off = builder.mul(src_s, ir.Constant(_I64, r))
                vs.append(builder.load(builder.bitcast(builder.gep(sp, [off]),
                                                       _VF.as_pointer()), align=4))
            vs = _cross_stages(builder, vs)
            scale_vec = _splat(builder, scale_v) if sign_out else None
            for r, v in enumerate(vs):
                if sign_out:
                    p = builder.add(pos_v, builder.mul(pos_s, ir.Constant(_I64, r)))
                    v = _signed_scaled(builder, v, _sign_mask(builder, key_v, p), scale_vec)
                off = builder.mul(dst_s, ir.Constant(_I64, r))
                _store(builder, v, builder.bitcast(builder.gep(dp, [off]), _VF.as_pointer()),
                       nontemporal)
            return context.get_dummy_value()
        return sig, codegen

    typer.__name__ = f"fwht_rows_{nrows}_{int(sign_out)}{int(nontemporal)}"
    _ROW_KERNELS[spec] = intrinsic(typer)
    return _ROW_KERNELS[spec]


@intrinsic
def _store_fence(typingctx):
    """sfence: orders the non-temporal stores before anything that follows."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return sig, codegen


PLAIN, FORWARD, INVERSE = 0, 1, 2     # FWHT only; RHT (signs first); inverse RHT (signs last)

# chunk kernels for 1..16 vectors: plain, forward (signs in), inverse (signs out)
_PLAIN = {n: chunk_kernel(n, False, False) for n in (1, 2, 4, 8, 16)}
_FWD = {n: chunk_kernel(n, True, False) for n in (1, 2, 4, 8, 16)}
_INV = {n: chunk_kernel(n, False, True) for n in (1, 2, 4, 8, 16)}
_ROWS16 = row_kernel(16, False, False)
_LAST = {(r, s, nt): row_kernel(r, s, nt) for r in (2, 4, 8, 16) for s in (False, True)
         for nt in (False, True)}
_plain1, _plain2, _plain4, _plain8, _plain16 = (_PLAIN[n] for n in (1, 2, 4, 8, 16))
_fwd1, _fwd2, _fwd4, _fwd8, _fwd16 = (_FWD[n] for n in (1, 2, 4, 8, 16))
_inv1, _inv2, _inv4, _inv8, _inv16 = (_INV[n] for n in (1, 2, 4, 8, 16))
_last2f, _last4f, _last8f, _last16f = (_LAST[(r, False, False)] for r in (2, 4, 8, 16))
_last2fn, _last4fn, _last8fn, _last16fn = (_LAST[(r, False, True)] for r in (2, 4, 8, 16))
_last2s, _last4s, _last8s, _last16s = (_LAST[(r, True, False)] for r in (2, 4, 8, 16))
_last2sn, _last4sn, _last8sn, _last16sn = (_LAST[(r, True, True)] for r in (2, 4, 8, 16))


# ---- FWHT drivers -------------------------------------------------------------------------
@njit(cache=True, inline="always")
def scratch_index(p):
    """Where partition offset p lives in the padded scratch buffer."""
    return p + PAD * (p >> 12) + PAD * (p >> 20)


def scratch_size(n: int) -> int:
    return int(scratch_index(n)) + LANES


@njit(cache=True, inline="always")
def _small_chunk(src, si, dst, di, n, pos, key, scale, mode):
    """A whole partition of 16..256 floats in registers."""
    nvec = n // LANES
    if mode == INVERSE:
        if nvec == 1:
            _inv1(src, si, dst, di, pos, key, scale)
        elif nvec == 2:
            _inv2(src, si, dst, di, pos, key, scale)
        elif nvec == 4:
            _inv4(src, si, dst, di, pos, key, scale)
        elif nvec == 8:
            _inv8(src, si, dst, di, pos, key, scale)
        else:
            _inv16(src, si, dst, di, pos, key, scale)
    elif mode == FORWARD:
        if nvec == 1:
            _fwd1(src, si, dst, di, pos, key, scale)
        elif nvec == 2:
            _fwd2(src, si, dst, di, pos, key, scale)
        elif nvec == 4:
            _fwd4(src, si, dst, di, pos, key, scale)
        elif nvec == 8:
            _fwd8(src, si, dst, di, pos, key, scale)
        else:
            _fwd16(src, si, dst, di, pos, key, scale)
    else:
        if nvec == 1:
            _plain1(src, si, dst, di, pos, key, scale)
        elif nvec == 2:
            _plain2(src, si, dst, di, pos, key, scale)
        elif nvec == 4:
            _plain4(src, si, dst, di, pos, key, scale)
        elif nvec == 8:
            _plain8(src, si, dst, di, pos, key, scale)
        else:
            _plain16(src, si, dst, di, pos, key, scale)


@njit(cache=True, inline="always")
def _last_level(rows, scratch, si, sstride, dst, di, stride, pos, key, scale, mode, nt):
    """The top stride level: across `rows` rows of the scratch, into dst (signs last for
    the inverse; streaming stores when nt)."""
    if mode == INVERSE:
        if nt:
            if rows == 16:
                _last16sn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 8:
                _last8sn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 4:
                _last4sn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            else:
                _last2sn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
        else:
            if rows == 16:
                _last16s(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 8:
                _last8s(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 4:
                _last4s(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            else:
                _last2s(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
    else:
        if nt:
            if rows == 16:
                _last16fn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 8:
                _last8fn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 4:
                _last4fn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            else:
                _last2fn(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
        else:
            if rows == 16:
                _last16f(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 8:
                _last8f(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            elif rows == 4:
                _last4f(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)
            else:
                _last2f(scratch, si, sstride, dst, di, stride, pos, stride, key, scale)


@njit(cache=True, inline="always")
def _level(scratch, dst, di, n, pos, key, scale, base, stride, t0, t1, mode, nt):
    """Stride level `stride` over the group of min(16*stride, n) floats at partition offset
    `base`, columns t0..t1 (multiples of 16): in place in the scratch, or into dst when
    the group is the whole partition."""
    group = min(16 * stride, n)
    rows = group // stride
    sstride = scratch_index(stride)      # rows of an aligned group are equally spaced
    if group == n:
        for t in range(t0, t1, LANES):
            _last_level(rows, scratch, scratch_index(base + t), sstride, dst, di + base + t,
                        stride, pos + base + t, key, scale, mode, nt)
    else:
        for t in range(t0, t1, LANES):
            s = scratch_index(base + t)
            _ROWS16(scratch, s, sstride, scratch, s, sstride, 0, 0, key, scale)


@njit(cache=True, inline="always")
def _chunk_into_scratch(src, si, scratch, p, pos, key, scale, mode):
    if mode == FORWARD:
        _fwd16(src, si, scratch, scratch_index(p), pos, key, scale)
    else:
        _plain16(src, si, scratch, scratch_index(p), pos, key, scale)


@njit(cache=True)
def _partition(src, si, dst, di, n, pos, key, scale, scratch, mode, nt):
    """One partition of n >= 16 floats, src[si:si+n] -> dst[di:di+n] (pos: padded position
    of its first float). Post-order: after each chunk, every stride level whose group the
    chunk completes, so each level runs while its group is still cached."""
    if n <= CHUNK:
        _small_chunk(src, si, dst, di, n, pos, key, scale, mode)
        return
    for c in range(n // CHUNK):
        p = c * CHUNK
        _chunk_into_scratch(src, si + p, scratch, p, pos + p, key, scale, mode)
        done = p + CHUNK
        stride = CHUNK
        while stride < n:
            group = min(16 * stride, n)
            if done % group:
                break
            _level(scratch, dst, di, n, pos, key, scale, done - group, stride, 0, stride,
                   mode, nt)
            stride = group


@njit(cache=True, parallel=True)
def fwht_shared_partition(src, si, dst, di, n, pos, key, scale, scratch, mode, nt):
    """One partition of n > 4096 floats, every thread working on it, level by level: the
    first two levels per 4096 block, then one parallel sweep per stride level."""
    for b in prange(n // 4096):
        for c in range(16):
            p = b * 4096 + c * CHUNK
            _chunk_into_scratch(src, si + p, scratch, p, pos + p, key, scale, mode)
        _level(scratch, dst, di, n, pos, key, scale, b * 4096, CHUNK, 0, CHUNK, mode, nt)
    stride = 4096
    while stride < n:
        group = min(16 * stride, n)
        cols = stride // 256                     # tasks of 256 columns
        for task in prange((n // group) * cols):
            base = (task // cols) * group
            t0 = (task % cols) * 256
            _level(scratch, dst, di, n, pos, key, scale, base, stride, t0, t0 + 256,
                   mode, nt)
            if nt:
                _store_fence()
        stride = group


@njit(cache=True, parallel=True)
def fwht_partitions(src, si, dst, di, n, count, pos, key, scale, scratch, mode, nt):
    """`count` consecutive partitions of n >= 16 floats: src[si + k*n:] -> dst[di + k*n:],
    padded position pos + k*n; mode PLAIN, FORWARD or INVERSE. scratch: (threads,
    scratch_size(n)) float32 (unused when n <= 256); thread t takes partitions t,
    t + threads, ... with its own scratch row."""
    threads = scratch.shape[0]
    for t in prange(threads):
        for k in range(t, count, threads):
            _partition(src, si + k * n, dst, di + k * n, n, pos + k * n, key, scale,
                       scratch[t], mode, nt)
        if nt:
            _store_fence()


# ---- quantizer ----------------------------------------------------------------------------
def _host_has_avx512() -> bool:
    name = numba.config.CPU_NAME
    if name and name != "host":
        return "+avx512f" in (numba.config.CPU_FEATURES or "")
    return bool(llvm_binding.get_host_cpu_features().get("avx512f", False))


# AVX-512 looks the small tables up with in-register permutes (vpermt2d, vpermps) instead
# of gathers: the grid has g + 1 <= 32 cells and the table 16 intervals, so each table
# fits in one or two vector registers.
PERMUTE_LOOKUP = _host_has_avx512() and numba.config.CPU_NAME in (None, "host")
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


class _GatherLookup:
    """Cell and interval tables in memory, looked up with gathers (any target, any g)."""

    def __init__(self, builder, cells_ptr, inv_ptr):
        self.builder, self.cells, self.inv = builder, cells_ptr, inv_ptr

    def cell(self, idx):
        # the mask tells LLVM the index is small: 32-bit gather offsets
        idx = self.builder.and_(idx, _const_vec(_VI32, [0xFFFF] * LANES))
        return _gather(self.builder, self.cells, idx, _VI32)

    def inv_width(self, j):
        return _gather(self.builder, self.inv, j, _VF)


class _PermuteLookup:
    """The same tables held in registers (cells: 32 ints in two vectors, inv_width: 16
    floats), looked up with AVX-512 permutes; needs g <= 31."""

    def __init__(self, builder, cells_ptr, inv_ptr):
        self.builder = builder
        self.lo = builder.load(_vector_ptr(builder, cells_ptr, 0, _VI32), align=4)
        self.hi = builder.load(_vector_ptr(builder, cells_ptr, LANES, _VI32), align=4)
        self.inv = builder.load(_vector_ptr(builder, inv_ptr, 0), align=4)

    def cell(self, idx):
        fn = _x86_fn(self.builder, "llvm.x86.avx512.vpermi2var.d.512", _VI32,
                     [_VI32, _VI32, _VI32])
        return self.builder.call(fn, [self.lo, idx, self.hi])

    def inv_width(self, j):
        fn = _x86_fn(self.builder, "llvm.x86.avx512.permvar.sf.512", _VF, [_VF, _VI32])
        return self.builder.call(fn, [self.inv, j])


def _quantize_lanes(builder, x, m, sc, g, u, lookup):
    """The reference's index for 16 elements: clamp to [-m, m], y = min((x + m) sc, g),
    j and T[j] from the cell floor(y), round up when u < (y - T[j]) * inv_width[j]."""
    x = builder.select(builder.fcmp_ordered(">", x, builder.fneg(m)), x, builder.fneg(m))
    x = builder.select(builder.fcmp_ordered("<", x, m), x, m)
    y = builder.fmul(builder.fadd(x, m), sc)
    y = builder.select(builder.fcmp_ordered("<", y, g), y, g)
    packed = lookup.cell(builder.fptoui(y, _VI32))          # (T[j] << 8) | j
    j = builder.and_(packed, _const_vec(_VI32, [255] * LANES))
    lo = builder.uitofp(builder.lshr(packed, _const_vec(_VI32, [8] * LANES)), _VF)
    up = builder.fcmp_ordered("<", u, builder.fmul(builder.fsub(y, lo), lookup.inv_width(j)))
    return builder.add(j, builder.zext(up, _VI32))


def _quantize_kernel(lookup_cls):
    def typer(typingctx, rot, ri, out, oi, m, sc, g, cells, inv_width, key):
        """32 elements rot[ri:ri+32] -> 16 packed bytes out[oi:oi+16] (oi = ri / 2);
        returns how many were NaN/Inf (those quantize as 0). Element 2k+e uses bits
        40..63 (e = 0) or 8..31 (e = 1) of the hash of counter k, as rng specifies."""
        sig = types.int64(rot, types.intp, out, types.intp, types.float32, types.float32,
                          types.float32, cells, inv_width, types.uint64)

        def codegen(context, builder, signature, args):
            rot_a, ri_v, out_a, oi_v, m_v, sc_v, g_v, cells_a, inv_a, key_v = args
            rp = _element_ptr(context, builder, signature.args[0], rot_a, ri_v)
            op = _element_ptr(context, builder, signature.args[2], out_a, oi_v)
            zero = ir.Constant(_I64, 0)
            lookup = lookup_cls(builder,
                                _element_ptr(context, builder, signature.args[7], cells_a, zero),
                                _element_ptr(context, builder, signature.args[8], inv_a, zero))
            a = builder.load(_vector_ptr(builder, rp, 0), align=4)
            b = builder.load(_vector_ptr(builder, rp, LANES), align=4)
            even = builder.shuffle_vector(a, b, _const_vec(_VI32, range(0, 2 * LANES, 2)))
            odd = builder.shuffle_vector(a, b, _const_vec(_VI32, range(1, 2 * LANES, 2)))
            counters = builder.add(_splat(builder, oi_v, _VI64),
                                   _const_vec(_VI64, range(1, LANES + 1)))
            word = _mix64(builder, builder.add(_splat(builder, key_v, _VI64), builder.mul(
                counters, _const_vec(_VI64, [rng.GOLDEN] * LANES))))
            unit = _const_vec(_VF, [float(rng.UNIFORM_SCALE)] * LANES)
            u_even = builder.fmul(builder.uitofp(
                builder.lshr(word, _const_vec(_VI64, [40] * LANES)), _VF), unit)
            u_odd = builder.fmul(builder.uitofp(builder.and_(
                builder.lshr(word, _const_vec(_VI64, [8] * LANES)),
                _const_vec(_VI64, [0xFFFFFF] * LANES)), _VF), unit)
            inf = _const_vec(_VF, [float("inf")] * LANES)
            zeros = _const_vec(_VF, [0.0] * LANES)
            m, sc, g = (_splat(builder, v) for v in (m_v, sc_v, g_v))
            bad = ir.Constant(_I64, 0)
            z = []
            for x, u in ((even, u_even), (odd, u_odd)):
                finite = builder.fcmp_ordered("<", builder.call(_fabs_fn(builder), [x]), inf)
                bad = builder.add(bad, builder.zext(builder.call(_ctpop16_fn(builder), [
                    builder.bitcast(builder.not_(finite), _I16)]), _I64))
                x = builder.select(finite, x, zeros)
                z.append(_quantize_lanes(builder, x, m, sc, g, u, lookup))
            byte = builder.or_(builder.shl(z[0], _const_vec(_VI32, [4] * LANES)), z[1])
            builder.store(builder.trunc(byte, _VI8), _vector_ptr(builder, op, 0, _VI8), align=1)
            return bad
        return sig, codegen
    typer.__name__ = f"quantize32_{lookup_cls.__name__.strip('_').lower()}"
    return intrinsic(typer)


_quantize32_gather = _quantize_kernel(_GatherLookup)
_quantize32_fast = _quantize_kernel(_PermuteLookup) if PERMUTE_LOOKUP else _quantize32_gather


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
def _quantize_bytes_scalar(rot, out, k0, k1, m, sc, g, cells, inv_width, key):
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
    return bad


QUANT_TASK = 1 << 15         # bytes per parallel task


@njit(cache=True, parallel=True)
def quantize(rot, half, scale, g, cells, inv_width, log_p, key, out):
    """Packed 4-bit indices of rot (partition k = element >> log_p uses half[k], scale[k]);
    returns the number of NaN/Inf inputs (quantized as 0). cells[c] = (T[j] << 8) | j for
    the interval j holding grid cell c; bit-identical to thc.reference.quantize."""
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
                                            cells, inv_width, key)
                else:
                    bad += _quantize32_gather(rot, 2 * k, out, k, half[part], scale[part], g,
                                              cells, inv_width, key)
                k += 16
            if k < k1:
                part = (2 * k) >> log_p
                bad += _quantize_bytes_scalar(rot, out, k, k1, half[part], scale[part], g,
                                              cells, inv_width, key)
        else:
            for k in range(k0, k1):
                part = (2 * k) >> log_p
                bad += _quantize_bytes_scalar(rot, out, k, k + 1, half[part], scale[part], g,
                                              cells, inv_width, key)
    return bad


def quantizer_tables(table: np.ndarray, lower: np.ndarray, inv_width: np.ndarray):
    """(cells, inv_width) for quantize: cells[c] = (T[j] << 8) | j for the interval j
    holding grid cell c = 0..g. Padded to 32 cells and 16 widths (the register-table
    layout) when the host can use it and g <= 31."""
    j = lower.astype(np.int32)
    cells = ((np.asarray(table, np.int32)[j] << 8) | j).astype(np.int32)
    inv = np.asarray(inv_width, np.float32)
    if PERMUTE_LOOKUP and len(cells) <= 2 * LANES and len(inv) <= LANES:
        cells = np.concatenate([cells, np.full(2 * LANES - len(cells), cells[-1], np.int32)])
        inv = np.concatenate([inv, np.ones(LANES - len(inv), np.float32)])
    return cells, inv
