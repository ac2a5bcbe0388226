"""Experiment driver: selective vs partial vs all-reduce, the n sweep and the parameter sweeps.

    python -m host.experiments.selective_reduce.study --json results.json [--seeds 20] [--plots docs/img]
        [--quick]

Each point runs every scheme on the same seeds (same bandwidths and compute draws per seed) and
reports min / median / max over seeds of: average sync time (collective and including waiting),
average scale, total syncs, total iterations and wasted wait per worker.  Plots go to --plots.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import matplotlib.pyplot as plt     # the Agg backend: host.experiments.common selects it
import numpy as np
from tqdm import tqdm

from host.experiments.common import save_figure
from host.selective_reduce.policies import POLICIES
from host.selective_reduce.simulator import SimConfig, Simulation
from host.selective_reduce.workload import CALIBRATED_MEDIAN_S

METRICS = ("avg_sync_time", "avg_sync_time_with_wait", "avg_scale", "total_syncs",
           "total_iterations", "wasted_wait_per_worker", "idle_slot_wait_per_worker")
SWEEP_N = 200        # the paper does not give n for Figs. 8-14; its Fig. 8 text implies 160 or 200


def run_point(cfg: SimConfig, schemes, seeds) -> dict:
    """Per scheme: per-seed summaries plus min/median/max; also SR/PR ratios per seed."""
    per_scheme = {s: [] for s in schemes}
    for seed in seeds:
        for scheme in schemes:
            per_scheme[scheme].append(Simulation(replace(cfg, seed=seed), POLICIES[scheme]()).run()
                                      .summary())
    out = {}
    for scheme, rows in per_scheme.items():
        out[scheme] = {m: {"min": float(np.min([r[m] for r in rows])),
                           "median": float(np.median([r[m] for r in rows])),
                           "max": float(np.max([r[m] for r in rows]))} for m in METRICS}
        out[scheme]["runs"] = rows
    if "selective-reduce" in per_scheme and "partial-reduce" in per_scheme:
        sr, pr = per_scheme["selective-reduce"], per_scheme["partial-reduce"]
        ratios = {
            "time_speedup": [p["avg_sync_time"] / s["avg_sync_time"] for s, p in zip(sr, pr)],
            "scale_gain": [s["avg_scale"] / p["avg_scale"] for s, p in zip(sr, pr)],
            "iteration_gain": [s["total_iterations"] / p["total_iterations"] for s, p in zip(sr, pr)],
            "sr_scale_ge_pr_every_run": all(s["avg_scale"] >= p["avg_scale"] for s, p in zip(sr, pr)),
        }
        out["ratios"] = {k: (v if isinstance(v, bool) else
                             {"min": min(v), "median": float(np.median(v)), "max": max(v)})
                         for k, v in ratios.items()}
    return out


def experiment_plan(quick: bool) -> list[tuple[str, str, list]]:
    """(experiment name, swept field, values)."""
    if quick:
        return [("n_transformer", "n", [40, 80]), ("p_over_n", "p_frac", [0.1, 0.3])]
    return [
        ("n_transformer", "n", [40, 80, 120, 160, 200]),
        ("n_cnn", "n", [40, 80, 120, 160, 200]),
        ("p_over_n", "p_frac", [0.1, 0.2, 0.3, 0.4, 0.5]),
        ("eta", "eta", [0.0, 0.2, 0.4, 0.6, 0.8]),
        ("theta", "theta", [1, 2, 5, 10, 20]),
        ("lambda", "lam", [0.05, 0.1, 0.2]),
        ("alpha", "alpha", [0.0, 1e-3, 5e-3, 50e-3]),
        ("bw_error_warm", "bw_error", [0.0, 0.1, 0.2, 0.4]),
        ("bw_error_cold", "bw_error", [0.0, 0.1, 0.2, 0.4]),
        ("delta_t", "dt", [0.02, 0.05, 0.1, 0.2, 0.5]),
        # multiples of the calibrated 4 s median: 0.5 s (the old surrogate) to 8 s
        ("compute_scale", "compute_scale", [0.125, 0.5, 1, 2]),
    ]


def config_for(name: str, field: str, value, duration: float) -> SimConfig:
    base = dict(duration=duration, n=SWEEP_N)
    if name == "n_cnn":
        base["trace"] = "cnn"
    if name == "bw_error_cold":
        base["warm"] = False
    if field == "p_frac":
        base["p"] = max(1, round(value * base["n"]))
    elif field == "n":
        base["n"] = value
    else:
        base[field] = value
    return SimConfig(**base)


def schemes_for(name: str) -> list[str]:
    if name.startswith("n_") or name in ("alpha", "lambda"):
        return ["selective-reduce", "partial-reduce", "all-reduce"]
    return ["selective-reduce", "partial-reduce"]


def run_all(seeds: int, sweep_seeds: int, duration: float, quick: bool, only=None) -> dict:
    plan = [e for e in experiment_plan(quick) if not only or e[0] in only]
    total = sum(len(v) for _, _, v in plan)
    results = {"settings": {"seeds_n_sweep": seeds, "seeds_other_sweeps": sweep_seeds,
                            "duration_s": duration, "sweep_n": SWEEP_N,
                            "defaults": {"p": "0.3n", "eta": 0.3, "theta": 1, "dt": 0.1,
                                         "alpha": 1e-3, "lam": 0.05, "model_mb": 500,
                                         "c": "never", "trace": "transformer (surrogate)",
                                         "compute_median_s": CALIBRATED_MEDIAN_S}}}
    with tqdm(total=total, desc="selective-reduce experiments") as bar:
        for name, field, values in plan:
            n_seeds = seeds if name.startswith("n_") else sweep_seeds
            points = []
            for value in values:
                cfg = config_for(name, field, value, duration)
                points.append({"value": value, **run_point(cfg, schemes_for(name), range(n_seeds))})
                bar.update(1)
            results[name] = {"field": field, "points": points}
    return results


LABELS = {"avg_sync_time": "avg sync time (s)", "avg_scale": "avg sync scale",
          "total_iterations": "total iterations", "total_syncs": "total syncs",
          "avg_sync_time_with_wait": "avg sync time incl. wait (s)"}


def plot(results: dict, outdir: str) -> list[str]:
    os.makedirs(outdir, exist_ok=True)
    written = []
    for name, exp in results.items():
        if name == "settings":
            continue
        metrics = ["avg_sync_time", "avg_scale", "total_iterations", "total_syncs"]
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
        xs = [p["value"] for p in exp["points"]]
        for ax, metric in zip(axes, metrics):
            for scheme in ("selective-reduce", "partial-reduce", "all-reduce"):
                if scheme not in exp["points"][0]:
                    continue
                med = [p[scheme][metric]["median"] for p in exp["points"]]
                lo = [p[scheme][metric]["min"] for p in exp["points"]]
                hi = [p[scheme][metric]["max"] for p in exp["points"]]
                ax.plot(xs, med, marker="o", label=scheme)
                ax.fill_between(xs, lo, hi, alpha=0.15)
            ax.set_xlabel(exp["field"])
            ax.set_title(LABELS[metric], fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"selective reduce: {name} (median, min-max band)", fontsize=10)
        save_figure(fig, outdir, f"sr_{name}.png", written)
    return written


def _cell(point, scheme, metric, fmt):
    return fmt.format(point[scheme][metric]["median"]) if scheme in point else "-"


def _ratio(point, key):
    r = point["ratios"][key]
    return f"{r['median']:.2f} ({r['min']:.2f})"


def markdown_table(name: str, exp: dict) -> str:
    """One experiment as the Markdown table docs/selective_reduce.md quotes (medians over seeds;
    "x" columns: per-seed SR/PR ratios, median (min))."""
    head = ("| " + name + " | SR time s | PR time s | AR time s | time x (min) | SR scale | PR scale "
            "| scale x (min) | SR iters | PR iters | iters x (min) | SR syncs | PR syncs "
            "| SR wasted wait ms | SR idle slots s |")
    lines = [head, "|---" + "|---:" * 3 + "|---" + "|---:" * 2 + "|---" + "|---:" * 2 + "|---"
             + "|---:" * 4 + "|"]
    for p in exp["points"]:
        sr, pr, ar = "selective-reduce", "partial-reduce", "all-reduce"
        lines.append("| " + " | ".join([
            f"{p['value']:g}", _cell(p, sr, "avg_sync_time", "{:.2f}"),
            _cell(p, pr, "avg_sync_time", "{:.2f}"), _cell(p, ar, "avg_sync_time", "{:.2f}"),
            _ratio(p, "time_speedup"), _cell(p, sr, "avg_scale", "{:.1f}"),
            _cell(p, pr, "avg_scale", "{:.1f}"), _ratio(p, "scale_gain"),
            _cell(p, sr, "total_iterations", "{:.0f}"), _cell(p, pr, "total_iterations", "{:.0f}"),
            _ratio(p, "iteration_gain"), _cell(p, sr, "total_syncs", "{:.1f}"),
            _cell(p, pr, "total_syncs", "{:.1f}"),
            f"{1000 * p[sr]['wasted_wait_per_worker']['median']:.1f}",
            _cell(p, sr, "idle_slot_wait_per_worker", "{:.2f}")]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m host.experiments.selective_reduce.study",
                                 description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write all results as JSON here")
    ap.add_argument("--seeds", type=int, default=20, help="seeds for the n sweeps (paper: 20)")
    ap.add_argument("--sweep-seeds", type=int, default=20,
                    help="seeds for the parameter sweeps (docs/selective_reduce.md's tables: 20)")
    ap.add_argument("--duration", type=float, default=100.0, help="simulated seconds per run")
    ap.add_argument("--plots", default="docs/img", help="folder for the PNG plots")
    ap.add_argument("--quick", action="store_true", help="two tiny sweeps (a smoke run)")
    ap.add_argument("--only", help="comma-separated experiment names to run (default: all)")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    results = run_all(args.seeds, args.sweep_seeds, args.duration, args.quick, only)
    for name, exp in results.items():
        if name != "settings":
            print(markdown_table(name, exp))
    if args.plots:
        for path in plot(results, args.plots):
            print("wrote", path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
