"""The demo and the benchmarks run end to end on small sizes and write what they promise."""
import json
import re
import sys

import numba
import pytest
import torch

from host.experiments import codec_bench as bench, codec_demo as demo
from thc import LaneOverflowError


def test_demo_trains_with_compressed_gradients(capsys):
    demo.main(["--workers", "2", "--rounds", "3", "--partition-log2", "12"])
    out = capsys.readouterr().out
    median = float(re.search(r"median ([0-9.]+)", out).group(1))
    assert median < 0.1                       # the decoded mean is close to the exact mean
    assert "test accuracy" in out and "bits per coordinate: up 4." in out


def test_demo_refuses_lane_overflow():
    with pytest.raises(LaneOverflowError, match="granularity <= 28"):
        demo.main(["--workers", "9", "--rounds", "1"])


def test_bench_nmse_and_speed_write_json(tmp_path, capsys):
    bench.main(["nmse", "--log2d", "10", "--reps", "1", "--json", str(tmp_path / "n.json"),
                "--plot", str(tmp_path / "n.png")])
    result = json.loads((tmp_path / "n.json").read_text())
    assert (tmp_path / "n.png").stat().st_size > 1000
    one = next(r for r in result["copies"] if r["n"] == 1)
    assert one["nmse"] == pytest.approx(one["analytic"], rel=0.3)
    threads = numba.get_num_threads(), torch.get_num_threads()
    try:
        bench.main(["speed", "--log2d", "12", "--reps", "1", "--threads", "1",
                    "--json", str(tmp_path / "s.json")])
    finally:
        numba.set_num_threads(threads[0])
        torch.set_num_threads(threads[1])
    speed = json.loads((tmp_path / "s.json").read_text())
    stages = {s["stage"] for s in speed["stages"]}
    assert {"RHT", "quantize+pack", "table lookup"} <= stages
    assert all(s["numba_gbs"] > 0 and s["torch_gbs"] > 0 for s in speed["stages"])
    out = capsys.readouterr().out
    assert "Numba/torch" in out and "rotated domain (1 inverse RHT)" in out
    assert [r["variant"] for r in speed["error_feedback"]] == [
        "gradient domain (2 inverse RHTs)", "rotated domain (1 inverse RHT)"]
    try:
        import fht_cpu  # noqa: F401  (optional: the dev extra)
    except ImportError:
        assert speed["fht_cpu"] is None and "fht-cpu is not installed" in out
    else:
        assert speed["fht_cpu"]["max_rel_diff"] < 1e-5 and speed["fht_cpu"]["rht_over_fht"] > 0


def test_bench_speed_runs_without_fht_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fht_cpu", None)      # import fails as if absent
    assert bench._speed_vs_fht_cpu(bench.THCCodec(), bench.np.ones(1 << 12, "float32"),
                                   1) is None
    assert "fht-cpu is not installed" in capsys.readouterr().out
