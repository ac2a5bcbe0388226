"""What the experiments share: the main job's dataset and model, and saving figures.

The dataset is scikit-learn's digits (it ships with the package: no download); the model
is the main job's MLP. Every study that trains "the main job's model" takes both from here.
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")               # experiments write files; no screen needed
import matplotlib.pyplot as plt     # noqa: E402
import numpy as np                  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn               # noqa: E402
from sklearn.datasets import load_digits   # noqa: E402


def load_digits_split(seed: int = 0):
    """Standardized digits (1797 x 64, 10 classes): 80 % train, 20 % test."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


# Imported once by the forkserver so each worker starts fast. Not torch: a worker forked
# from a process that imported torch (and so initialised its OpenMP runtime) spins in
# OpenMP waits; four such workers on two cores took 60-80 ms per step of the main job's
# MLP instead of 9 ms (OMP_WAIT_POLICY=passive removes the difference, so it is the
# spinning; docs/perf.md "Allreduce and the main job").
WORKER_PRELOAD = ["sklearn.datasets", "thc"]


def worker_context():
    """The multiprocessing context the training drivers start their workers in."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    return ctx


def make_model(hidden: int) -> nn.Sequential:
    """The main job's MLP: 64 -> hidden -> hidden -> 10."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def save_figure(fig, outdir: str, name: str, written: list[str], dpi: int = 90) -> str:
    """Lay out, save as outdir/name, close, and record the path in `written`."""
    fig.tight_layout()
    path = os.path.join(outdir, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    written.append(path)
    return path
