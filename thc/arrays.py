"""What kind of array a value is (numpy, torch, Numba CUDA), for the codec and its kernels.

The codec (thc.codec) and every kernel backend (thc.numpy_kernels, thc.cpu_kernels,
thc.cuda_kernels) share these helpers; they live here, below all of them, so that the
codec imports its kernels and no kernel imports the codec.
"""
from __future__ import annotations

import numpy as np


def is_torch(x) -> bool:
    """True for a torch tensor, told by its type's module so that torch need not be loaded."""
    return type(x).__module__.startswith("torch")


def is_cuda(x) -> bool:
    """True for a torch CUDA tensor, a Numba device array (real or simulated) or any object
    with __cuda_array_interface__."""
    if is_torch(x):
        return x.is_cuda
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ == "FakeCUDAArray"


def torch_module():
    """The torch module. torch is optional for the codec (numpy in, numpy out needs none of
    it), so it is imported only once a torch tensor has come."""
    import torch
    return torch


def host_numpy(x, dtype=None) -> np.ndarray:
    """A small array (norms, counts) as host numpy, whatever it came as."""
    if is_torch(x):
        x = x.detach().cpu().numpy()
    elif is_cuda(x):
        x = x.copy_to_host()
    a = np.asarray(x)
    return a.astype(dtype, copy=False) if dtype is not None else a
