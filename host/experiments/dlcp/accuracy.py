"""Training accuracy under DLCP bounded loss (the main job's digits MLP, simulated PS).

Each step, every worker computes its gradient on its own shard; the gradient of every
parameter tensor is cut into DLCP segments (350 values) and pushed to a parameter server
that loses exactly floor(p_push * segments) random segments of each worker's tensor (the
worst case DLCP allows: it delivers >= 1 - p). The PS averages, then every worker pulls
the average losing floor(p_pull * segments). Missing segments follow the policy:

* ``zero``: a lost push counts as zero in the average (sum / workers); a lost pull block
  applies no update.
* ``own`` (the paper's Appendix A model): the PS averages a block over the workers whose
  block arrived; a worker that misses an averaged block applies its own local gradient.

Workers keep identical replicas under ``zero``; under ``own`` they drift slightly, and the
test accuracy reported is worker 0's.

Usage: ``python -m host.experiments.dlcp.accuracy --json acc.json`` (plot in docs/img/dlcp_accuracy.png).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib.pyplot as plt     # the Agg backend: host.experiments.common selects it
import numpy as np
import torch
from tqdm import tqdm

from host.dlcp.transport import VALUES_PER_SEGMENT
from host.experiments.common import load_digits_split, make_model


def lost_mask(num_values: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """Per value: True where the value's segment was lost (floor(p*n) segments of n)."""
    n = -(-num_values // VALUES_PER_SEGMENT)
    lost = np.zeros(n, bool)
    lost[rng.choice(n, size=int(np.floor(p * n)), replace=False)] = True
    return np.repeat(lost, VALUES_PER_SEGMENT)[:num_values]


def aggregate(grads: list[np.ndarray], p_push: float, p_pull: float, policy: str,
              rng: np.random.Generator) -> list[np.ndarray]:
    """One parameter tensor: every worker's gradient in, the update each worker applies out."""
    n = grads[0].size
    stacked = np.stack([g.ravel() for g in grads])
    arrived = ~np.stack([lost_mask(n, p_push, rng) for _ in grads])
    if policy == "zero":
        avg = (stacked * arrived).sum(0) / len(grads)
    else:
        count = arrived.sum(0)
        avg = np.where(count > 0, (stacked * arrived).sum(0) / np.maximum(count, 1), 0.0)
    out = []
    for g in stacked:
        missing = lost_mask(n, p_pull, rng)
        fill = g if policy == "own" else np.zeros_like(g)
        out.append(np.where(missing, fill, avg).reshape(grads[0].shape))
    return out


def train(p_push: float, p_pull: float, policy: str, seed: int, args) -> float:
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = load_digits_split(seed)
    base = make_model(args.hidden)
    models = [make_model(args.hidden) for _ in range(args.workers)]
    for m in models:
        m.load_state_dict(base.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in models]
    shards = np.array_split(np.random.default_rng(seed).permutation(len(xtr)), args.workers)
    rng = np.random.default_rng(seed + 1000)
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(args.steps):
        grads = []
        for m, shard in zip(models, shards):
            idx = torch.from_numpy(rng.choice(shard, args.batch, replace=False))
            m.zero_grad()
            loss_fn(m(xtr_t[idx]), ytr_t[idx]).backward()
            grads.append([prm.grad.detach().numpy().copy() for prm in m.parameters()])
        for t in range(len(grads[0])):
            updates = aggregate([g[t] for g in grads], p_push, p_pull, policy, rng)
            for m, u in zip(models, updates):
                list(m.parameters())[t].grad = torch.from_numpy(u.astype(np.float32))
        for opt in opts:
            opt.step()
    with torch.no_grad():
        pred = models[0](torch.from_numpy(xte)).argmax(1).numpy()
    return float((pred == yte).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m host.experiments.dlcp.accuracy",
                                 description="digits MLP accuracy under DLCP loss bounds")
    ap.add_argument("--p", default="0,0.01,0.1,0.3", help="push loss bounds")
    ap.add_argument("--p-pull-ratio", type=float, default=0.1, help="p_pull = ratio * p_push")
    ap.add_argument("--policies", default="zero,own")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--json")
    ap.add_argument("--img-dir", default="docs/img")
    args = ap.parse_args(argv)
    ps = [float(v) for v in args.p.split(",")]
    if any(not 0 <= v < 1 for v in ps):
        ap.error("--p values must be in [0, 1)")
    runs = [(pol, p, s) for pol in args.policies.split(",") for p in ps for s in range(args.seeds)]
    acc: dict[str, dict[str, list[float]]] = {}
    for pol, p, s in tqdm(runs, desc="training runs"):
        a = train(p, args.p_pull_ratio * p, pol, s, args)
        acc.setdefault(pol, {}).setdefault(str(p), []).append(a)
    print(f"{'policy':6} " + " ".join(f"p={p:<6g}" for p in ps))
    for pol, row in acc.items():
        print(f"{pol:6} " + " ".join(f"{np.mean(row[str(p)]):8.4f}" for p in ps))
    summary = {pol: {p: {"mean": float(np.mean(v)), "runs": v} for p, v in row.items()}
               for pol, row in acc.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "accuracy": summary}, indent=2))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for pol, row in acc.items():
        ax.errorbar([100 * p for p in ps], [np.mean(row[str(p)]) * 100 for p in ps],
                    yerr=[np.std(row[str(p)]) * 100 for p in ps], marker="o", capsize=3, label=pol)
    ax.set_xlabel(f"push loss bound p (%)  [p_pull = {args.p_pull_ratio:g} p]")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"digits MLP, {args.workers} workers, {args.steps} steps")
    ax.legend(title="missing segments")
    fig.tight_layout()
    Path(args.img_dir).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(args.img_dir) / "dlcp_accuracy.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
