"""CUDA kernels under the Numba simulator (no GPU here), in a subprocess because
NUMBA_ENABLE_CUDASIM must be set before numba.cuda is imported. On a machine with a GPU,
test_cuda_device runs the same comparison on the real device."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _env(**extra):
    """The subprocess imports thc from this checkout (a script's sys.path starts at its own
    folder, so without this it would get whatever thc is installed)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_cuda_kernels_agree_with_cpu_under_simulator():
    env = _env(NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(HERE / "cudasim_agreement.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "agrees" in proc.stdout


def test_cuda_kernels_compile_to_ptx():
    """Needs NVVM/NVRTC (e.g. pip install --target DIR nvidia-cuda-nvcc-cu12
    nvidia-cuda-nvrtc-cu12, then THC_CUDA_LIBS=DIR); skipped when they are absent."""
    env = _env()
    libs = env.get("THC_CUDA_LIBS")
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [f"{libs}/nvidia/cuda_nvrtc/lib", f"{libs}/nvidia/cuda_nvcc/nvvm/lib64",
             env.get("LD_LIBRARY_PATH", "")])
        env["CUDA_HOME"] = f"{libs}/nvidia/cuda_nvcc"
        env["PYTHONPATH"] = os.pathsep.join([libs, env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, str(HERE / "ptx_compile.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip("CUDA compiler libraries (NVVM/NVRTC) not installed; set THC_CUDA_LIBS")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all CUDA kernels compile" in proc.stdout


def _has_gpu():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


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
