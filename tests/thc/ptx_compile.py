"""Run by test_cuda_sim.py in a subprocess: compile every CUDA kernel of thc.cuda_kernels
to PTX for sm_80 with the real NVVM (no GPU needed), catching typing errors that the
simulator cannot, and check the quantizer has no fused multiply-add (bit-identity with
the CPU kernels). Exits 3 when the CUDA compiler libraries are not installed."""
import sys
import types as pytypes

from numba import cuda, types

# Device functions ask the current device for its compute capability; there is none here.
_dispatcher = sys.modules[cuda.jit.__module__.rsplit(".", 1)[0] + ".dispatcher"]
_dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(8, 0))

from thc import cuda_kernels as C  # noqa: E402

f32, u8, i32, f64 = types.float32[::1], types.uint8[::1], types.int32[::1], types.float64[::1]
i64, u64 = types.int64, types.uint64
SIGNATURES = {
    "_chunk_sumsq": (f32, i64, i64, f64),
    "_sign_scale_pad": (f32, f32, i64, i64, i64, u64, types.float32),
    "_sign_scale_unpad": (f32, f32, i64, i64, i64, u64, types.float32),
    "_fwht_shared": (f32, i64, i64),
    "_fwht_stage": (f32, i64, i64, i64),
    "_fwht_stage4": (f32, i64, i64, i64),
    "_quantize": (f32, f32, f32, f32, u8, f32, i64, u64, u8, i32),
    "_lookup": (u8, u8, u8),
    "_decode_rotated": (i32, f32, f32, f32, i64, f32),
}

for name, sig in SIGNATURES.items():
    try:
        ptx, _ = cuda.compile_ptx(getattr(C, name).py_func, sig, cc=(8, 0))
    except Exception as exc:       # missing libnvvm / libnvrtc: not this code's fault
        text = f"{type(exc).__name__}: {exc}"
        if "nvrtc" in text.lower() or "nvvm" in text.lower() or "DynamicLib" in text:
            print(f"CUDA compiler libraries not found: {text[:200]}")
            sys.exit(3)
        raise
    if name == "_quantize" and ("fma" in ptx or "approx" in ptx):
        print("the quantizer PTX contains fma/approx instructions")
        sys.exit(1)
    print(f"{name}: {len(ptx)} chars of PTX")
print("all CUDA kernels compile")
