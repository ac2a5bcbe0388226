"""CUDA kernels under the Numba simulator (no GPU here), in a subprocess because
NUMBA_ENABLE_CUDASIM must be set before numba.cuda is imported; and every kernel compiled to
PTX by NVIDIA's compiler (pyproject's cuda-compile extra, no GPU needed) and assembled by
ptxas, to check what the simulator cannot: typing, local memory, register spills. On a machine
with a GPU, test_cuda_kernels_agree_with_cpu_on_device runs the same comparison on the real
device, with full-size tensors too, and test_cuda_device_torch_agrees_with_cpu the codec's
torch CUDA path."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
PTX_CCS = ("80", "90")        # compute capabilities the kernels are compiled for: sm_80, sm_90
MISSING_LIBS = 3              # ptx_compile.py's exit status when the compiler is not installed
HOT_KERNELS = (
    "_sign_fwht_shared", "_sign_scale_unpad",          # RHT: random signs and scaling
    "_fwht_shared", "_fwht_stage", "_fwht_stage4",     # RHT: the Hadamard butterflies
    "_quantize",                                       # quantize and pack 2 indices a byte
    "_lookup",                                         # indices to table values
    "_decode_rotated",                                 # aggregated sums to values
)


def _env(**extra):
    """The subprocess imports thc from this checkout (a script's sys.path starts at its own
    folder, so without this it would get whatever thc is installed)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_cuda_kernels_agree_with_cpu_under_simulator():
    env = _env(NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(HERE / "cuda_agreement.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "agrees" in proc.stdout


def _with_cuda_libs(env):
    """THC_CUDA_LIBS=DIR (a `pip install --target DIR` of pyproject's cuda-compile extra) is
    where the compiler is looked for when the venv lacks it (the venv's wheels come first)."""
    libs = env.get("THC_CUDA_LIBS")
    if libs:
        nvidia = Path(libs, "nvidia")   # CUDA 13 wheels: nvidia/cu13/, CUDA 12: nvidia/cuda_*/
        lib_dirs = [*nvidia.glob("*/lib"), *nvidia.glob("*/nvvm/lib64")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [*map(str, lib_dirs), env.get("LD_LIBRARY_PATH", "")])
        for libdevice in nvidia.glob("*/nvvm/libdevice"):
            env["CUDA_HOME"] = str(libdevice.parent.parent)
    return env


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory):
    """Every kernel compiled to PTX by NVIDIA's NVVM for each of PTX_CCS (ptx_compile.py)."""
    out = tmp_path_factory.mktemp("ptx")
    proc = subprocess.run([sys.executable, str(HERE / "ptx_compile.py"), str(out), *PTX_CCS],
                          env=_with_cuda_libs(_env()), capture_output=True, text=True,
                          timeout=600)
    if proc.returncode == MISSING_LIBS:
        pytest.skip(f"{proc.stdout.strip()}: `make setup` installs them (pyproject's "
                    f"cuda-compile extra) where the platform has the wheels; or set THC_CUDA_LIBS")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all CUDA kernels compile" in proc.stdout
    return out


def _ptx(ptx_dir, name, cc):
    return (ptx_dir / f"{name}.sm_{cc}.ptx").read_text()


def test_cuda_kernels_compile_to_ptx(ptx_dir):
    """Every kernel of thc/cuda_kernels.py (ptx_compile.py enumerates them) has its entry in
    the PTX for every target, and the quantizer has no fused multiply-add or approximate
    division (bit-identical indices with the CPU kernels)."""
    kernels = (ptx_dir / "kernels.txt").read_text().split()
    assert set(HOT_KERNELS) <= set(kernels), "a hot kernel was renamed: update HOT_KERNELS"
    for name in kernels:
        for cc in PTX_CCS:
            ptx = _ptx(ptx_dir, name, cc)
            assert f".target sm_{cc}" in ptx
            # Itanium mangling: the module path, then the name's length and the name.
            assert re.search(rf"\.entry\s+\S*cuda_kernels{len(name)}{name}", ptx), \
                f"no entry for {name} in its sm_{cc} PTX"
    for cc in PTX_CCS:
        fused = re.findall(r"\b(?:fma|mad)\.\S*f(?:32|64)\b|\.approx\.",
                           _ptx(ptx_dir, "_quantize", cc))
        assert not fused, f"the quantizer's sm_{cc} PTX has {fused}"


def test_hot_cuda_kernels_use_no_local_memory(ptx_dir):
    """Local memory (arrays that do not fit registers) is off-chip: the hot kernels keep
    every value in registers or shared memory."""
    for name in HOT_KERNELS:
        for cc in PTX_CCS:
            local = re.findall(r"^.*\.local\b.*$", _ptx(ptx_dir, name, cc), re.MULTILINE)
            assert not local, f"{name} uses local memory on sm_{cc}: {local[:3]}"


def _ptxas():
    """NVIDIA's PTX assembler, looked for where the compiler libraries are: the venv's wheels
    (the release of the NVVM that wrote the PTX), THC_CUDA_LIBS, then PATH."""
    roots = [sysconfig.get_path("purelib"), os.environ.get("THC_CUDA_LIBS")]
    for root in filter(None, roots):
        found = sorted(Path(root, "nvidia").glob("*/bin/ptxas"))
        if found:
            return str(found[0])
    return shutil.which("ptxas")


def test_hot_cuda_kernels_do_not_spill_registers(ptx_dir, tmp_path):
    """ptxas -v assembles each hot kernel for each target and reports its spills: none."""
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas (pyproject's cuda-compile extra installs one)")
    for name in HOT_KERNELS:
        for cc in PTX_CCS:
            ptx_file = ptx_dir / f"{name}.sm_{cc}.ptx"
            proc = subprocess.run([ptxas, "-v", f"-arch=sm_{cc}", str(ptx_file),
                                   "-o", str(tmp_path / "kernel.cubin")],
                                  capture_output=True, text=True, timeout=120)
            report = proc.stdout + proc.stderr
            if "Unsupported .version" in report:
                pytest.skip(f"{ptxas} is older than the NVVM that wrote the PTX: {report.strip()}")
            assert proc.returncode == 0, report
            spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
            assert spills, f"no spill report from {ptxas} -v: {report}"
            assert all(s == ("0", "0") for s in spills), f"{name} spills on sm_{cc}: {report}"


def _has_gpu():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(not _has_gpu(), reason="no CUDA GPU on this machine")
def test_cuda_kernels_agree_with_cpu_on_device():
    """The simulator's comparison on the real GPU, plus full-size tensors (several 2^20
    partitions, a padded tail) that the simulator cannot run."""
    proc = subprocess.run([sys.executable, str(HERE / "cuda_agreement.py"), "--device"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CUDA device" in proc.stdout and "agrees" in proc.stdout


@pytest.mark.skipif(not _has_gpu(), reason="no CUDA GPU on this machine")
def test_cuda_device_torch_agrees_with_cpu():
    import torch

    import thc
    codec = thc.THCCodec(partition_size=1 << 12)
    x = torch.randn(10_000, dtype=torch.float32)
    xc = x.cuda()
    norms = codec.partition_norms(x)
    np.testing.assert_allclose(codec.partition_norms(xc), norms, rtol=1e-5)
    rot = codec.rotate(x)
    rot_c = codec.rotate(xc)
    assert rot_c.is_cuda
    torch.testing.assert_close(rot_c.cpu(), rot, atol=1e-5, rtol=0)
    packed = codec.quantize(rot, norms, worker=1, round=2, tensor=3)
    packed_c = codec.quantize(rot.cuda(), norms, worker=1, round=2, tensor=3)
    assert torch.equal(packed_c.cpu(), packed)
    sums = codec.lookup(packed).to(torch.int32) * 2
    out = codec.decode(sums.cuda(), 2, norms, x.numel())
    assert out.is_cuda
    torch.testing.assert_close(out.cpu(), codec.decode(sums, 2, norms, x.numel()),
                               atol=1e-5, rtol=0)
