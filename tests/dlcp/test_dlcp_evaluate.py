"""The evaluation harness: workload, loss accounting, and a small real run in netns."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from host.experiments.dlcp import evaluate


def test_resnet50_layer_sizes_match_the_architecture():
    sizes = evaluate.resnet50_layer_sizes()
    assert len(sizes) == 54
    assert sum(sizes) == 25_557_032               # torchvision resnet50 parameter count
    assert sizes[0] == 7 * 7 * 3 * 64 + 128 and sizes[-1] == 2048 * 1000 + 1000
    assert all(s >= 1 for s in evaluate.scaled_sizes(100_000))


def test_band_losses_accounting():
    band0, band5 = 32 << 2, 37 << 2
    raw = {"workers": [{"tos_sent": {str(band0 | 2): 10, str(band0): 10, str(band5): 20}}],
           "ps": {"tos_counts": {str(band0 | 3): 10, str(band0): 6, str(band5): 10}}}
    out = evaluate.band_losses(raw)
    assert out["per_band"]["32"] == {"sent": 20, "lost": 4, "loss_rate": 0.2}
    assert out["per_band"]["37"]["lost"] == 10
    assert out["important_share_sent"] == 0.25 and out["important_share_dropped"] == 0.0


def test_tensor_ids_are_unique():
    ids = {evaluate.tensor_id(w, it, layer) for w in range(8) for it in range(50) for layer in range(54)}
    assert len(ids) == 8 * 50 * 54


def _netns_ok() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    probe = "dlcp-probe"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


@pytest.mark.netns
@pytest.mark.skipif(not _netns_ok(), reason="needs root and network namespaces")
def test_small_incast_run_meets_the_bound(tmp_path):
    """2 workers, 1 iteration through the live switch model: E2 and the accounting hold."""
    out = tmp_path / "eval.json"
    rc = evaluate.main(["--schemes", "dlcp,udp_timer", "--workers", "2", "--iterations", "1",
                        "--scale", "2048", "--period", "0.5", "--p", "0.2",
                        "--json", str(out), "--img-dir", str(tmp_path)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    dl, ut = res["dlcp"], res["udp_timer"]
    assert dl["tensors"] == ut["tensors"] == 2 * 54
    assert dl["min_delivered_fraction"] >= 0.8           # E2 with p = 0.2
    assert ut["min_delivered_fraction"] == 1.0           # p = 0 baseline delivers everything
    assert dl["switch"]["forwarded"] > 0
    assert sum(b["sent"] for b in dl["per_band"].values()) >= dl["packets_sent"] - 1
    assert (tmp_path / "dlcp_tct_cdf.png").exists()
    assert np.isfinite(dl["tct_ms"]["p99"])
