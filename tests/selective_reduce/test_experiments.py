"""Experiment driver smoke test: tiny sweep, JSON-able results and plots written."""
import json

from host.experiments.selective_reduce import study as experiments
from host.selective_reduce.simulator import SimConfig


def test_run_point_and_plot(tmp_path):
    cfg = SimConfig(n=12, duration=15.0)
    point = experiments.run_point(cfg, ["selective-reduce", "partial-reduce"], range(2))
    assert point["ratios"]["sr_scale_ge_pr_every_run"] is True
    assert point["selective-reduce"]["avg_scale"]["min"] >= cfg.p
    results = {"settings": {}, "tiny": {"field": "n", "points": [{"value": 12, **point}]}}
    json.dumps(results)
    table = experiments.markdown_table("tiny", results["tiny"]).splitlines()
    assert table[0].startswith("| tiny | SR time s |") and len(table) == 3
    assert table[2].count("|") == table[0].count("|")
    paths = experiments.plot(results, str(tmp_path))
    assert [p.endswith("sr_tiny.png") for p in paths] == [True]
    assert (tmp_path / "sr_tiny.png").stat().st_size > 1000


def test_config_for_sweeps():
    assert experiments.config_for("p_over_n", "p_frac", 0.5, 10.0).p == 100
    assert experiments.config_for("n_cnn", "n", 40, 10.0).trace == "cnn"
    assert experiments.config_for("bw_error_cold", "bw_error", 0.2, 10.0).warm is False
