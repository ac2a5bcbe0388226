"""Run by test_cuda_sim.py in a subprocess: compile every kernel of thc.cuda_kernels (each
`cuda.jit` function that is not a device function, found by enumerating the module, so a new
kernel cannot be left out) to PTX with NVIDIA's NVVM for each compute capability asked for
(no GPU needed), catching typing errors that the simulator cannot. Writes
OUT_DIR/<kernel>.sm_<cc>.ptx and OUT_DIR/kernels.txt (the kernel names) for the test to check.
Exits 3 when the CUDA compiler libraries are not installed.

usage: python ptx_compile.py OUT_DIR CC [CC ...]      (CC as 80, 90: sm_80, sm_90)
"""
import sys
import types as pytypes
from pathlib import Path

from cuda import pathfinder
from numba import cuda, types
from numba.cuda import dispatcher
from numba.cuda.cudadrv import libs

MISSING_LIBS = 3
# Device functions ask the current device for its compute capability; there is none here,
# so they are told the one being compiled for.
_target = {"cc": (8, 0)}
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=_target["cc"])

from thc import cuda_kernels as C  # noqa: E402

f32, u8, i32, f64 = types.float32[::1], types.uint8[::1], types.int32[::1], types.float64[::1]
i64, u64 = types.int64, types.uint64
SIGNATURES = {
    "_chunk_sumsq": (f32, i64, i64, f64),
    "_sign_scale_unpad": (f32, f32, i64, i64, i64, u64, types.float32),
    "_fwht_shared": (f32, i64, i64),
    "_sign_fwht_shared": (f32, f32, i64, i64, i64, u64, types.float32),
    "_fwht_stage": (f32, i64, i64, i64),
    "_fwht_stage4": (f32, i64, i64, i64),
    "_quantize": (f32, f32, f32, f32, u8, f32, i64, u64, u8, i32),
    "_lookup": (u8, u8, u8),
    "_decode_rotated": (i32, f32, f32, f32, i64, f32),
    "_add_inplace": (f32, f32),
    "_subtract": (f32, f32, f32),
}


def kernel_names() -> list[str]:
    """Every kernel (a CUDA dispatcher that is not a device function) of thc.cuda_kernels."""
    return sorted(name for name, obj in vars(C).items()
                  if isinstance(obj, dispatcher.CUDADispatcher)
                  and not obj.targetoptions.get("device"))


def missing_compiler_libs() -> str | None:
    """Why NVIDIA's compiler cannot run here, or None: numba-cuda needs libNVVM and libNVRTC
    (found through cuda.pathfinder) and libdevice. Checked before compiling, so that any
    error while compiling is the kernels' own."""
    for lib in ("nvvm", "nvrtc"):
        try:
            pathfinder.load_nvidia_dynamic_lib(lib)
        except pathfinder.DynamicLibNotFoundError as exc:
            return f"lib{lib} not found ({str(exc).splitlines()[0]})"
    if not libs.get_libdevice():
        return "libdevice.10.bc not found"
    return None


def compile_kernel(name: str, cc: tuple[int, int]) -> str:
    if name not in SIGNATURES:
        sys.exit(f"kernel {name} has no signature: add the argument types it is launched "
                 f"with to SIGNATURES in tests/thc/ptx_compile.py")
    _target["cc"] = cc
    ptx, _ = cuda.compile_ptx(getattr(C, name).py_func, SIGNATURES[name], cc=cc)
    return ptx


def main(out_dir: Path, ccs: list[tuple[int, int]]) -> None:
    missing = missing_compiler_libs()
    if missing:
        print(f"CUDA compiler libraries not installed: {missing}")
        sys.exit(MISSING_LIBS)
    names = kernel_names()
    (out_dir / "kernels.txt").write_text("\n".join(names) + "\n")
    for cc in ccs:
        for name in names:
            ptx = compile_kernel(name, cc)
            (out_dir / f"{name}.sm_{cc[0]}{cc[1]}.ptx").write_text(ptx)
            print(f"{name} sm_{cc[0]}{cc[1]}: {len(ptx)} chars of PTX")
    print("all CUDA kernels compile")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [(int(cc[:-1]), int(cc[-1])) for cc in sys.argv[2:]])
