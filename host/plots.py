"""Saving the experiments' figures the same way everywhere."""
from __future__ import annotations

import os


def save_figure(fig, outdir: str, name: str, written: list[str], dpi: int = 90) -> str:
    """Lay out, save as outdir/name, close, and record the path in `written`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(outdir, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    written.append(path)
    return path
