"""Training effect of partial aggregation: accuracy vs the fraction of workers waited for.

    python -m host.experiments.adapcc.partial_training --json out/partial_training.json

The main job's model (host.experiments.main_job: the MLP on scikit-learn digits, THC codec with RHT
partitions of 2^14) trained by n simulated workers in one process. Every step each worker
computes its gradient on its own shard; its compute time is drawn from a heavy-tailed
distribution (lognormal body, Pareto tail), which fixes the order in which the workers'
packets reach the aggregator. Every worker THC-quantizes (thc.THCCodec, error feedback) and
sends its DATA packets (host.packets.encode_data) with ``min_count = k`` to the reference
aggregator (dataplane.reference.ReferenceSwitch.handle_agg, in process: the very code the UDP
service runs). The aggregator completes each slot at the k-th contributor (THC's k-of-n rule,
docs/protocol.md §4.3), so the sums hold exactly the first k workers; the later workers'
packets get a LATE re-serve and add nothing. The mean is decoded with the contributor count
the RESULT carries. k/n in {1.0, 0.9, 0.8, 0.7, 0.5}, plus an fp32 all-worker baseline.

Choices (documented in docs/adapcc.md):
* n = 10 workers as in THC's straggler experiment; 10 x 30 > 255 overflows the 8-bit lanes,
  so the table uses granularity g = 25 (10 x 25 = 250), everything else as the main job.
* The max-norm exchange covers the first k workers only (the late ones are not ready yet);
  a late worker quantizes with those norms (THC clamps at the table's range) and sends, and
  the aggregator ignores it. Late workers keep their error-feedback memory unchanged.
* Stragglers are i.i.d. per step (any worker can be late), as in THC's emulation.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt     # the Agg backend: host.experiments.common selects it
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import thc
from dataplane.config import Job, Member, SwitchConfig
from dataplane.reference import ReferenceSwitch
from host.ddp_hook import INNETWORK_PARTITION_SIZE
from host.experiments.common import load_digits_split, make_model
from host.packets import decode_headers, encode_data
from host.packets.constants import TYPE_RESULT

FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.5)


class InProcessAggregator:
    """One job on the reference aggregator's slot state machine, fed packet by packet."""

    def __init__(self, workers: int, pool_size: int, table, job: int = 1, vpp: int = 1024):
        members = [Member(worker=w, port=w, mac=f"02:00:00:00:02:{w + 1:02x}",
                          ip=f"10.0.0.{w + 1}", udp_port=41000 + w) for w in range(workers)]
        job_desc = Job(job, pool_size, tuple(int(v) for v in table), tuple(members))
        self.switch = ReferenceSwitch(SwitchConfig(ip="10.0.0.254", jobs=(job_desc,)).validate())
        self.workers, self.pool_size, self.job, self.vpp = workers, pool_size, job, vpp
        self.expected = (1 << workers) - 1
        self.slot_rounds = np.zeros(pool_size, np.int64)

    def aggregate(self, packed: dict, order, num_values: int, tensor: int, min_count: int):
        """Feed every worker's DATA in ``order``: (lane sums, per-chunk counts, LATE replies)."""
        n_chunks = -(-num_values // self.vpp)
        chunks = np.arange(n_chunks)
        slots = chunks % self.pool_size
        rounds = self.slot_rounds[slots] + chunks // self.pool_size
        sums = np.zeros(num_values, np.uint8)
        counts = np.zeros(n_chunks, np.int64)
        done = np.zeros(n_chunks, bool)
        late = 0
        for w in order:
            bufs, lengths = encode_data(packed[w], num_values, self.vpp, job=self.job, worker=w,
                                        tensor=tensor, slots=slots,
                                        rounds=rounds.astype(np.uint32),
                                        expected=self.expected, min_count=min_count)
            for c in range(n_chunks):
                length = int(lengths[c])
                replies = self.switch.handle_agg(w, memoryview(bufs[c, :length]), length, True, 0)
                if not replies:
                    continue
                agg = np.frombuffer(replies[0].agg, np.uint8)
                h = decode_headers(agg[None, :], [len(agg)])[0]
                if (h["ver_type"] & 0x0F) != TYPE_RESULT:
                    raise RuntimeError(f"unexpected reply type {h['ver_type'] & 0x0F} "
                                       f"for chunk {c}")
                if done[c]:
                    late += 1                  # re-served to a worker behind the k-th: LATE
                    continue
                lo, nv = c * self.vpp, int(h["num_values"])
                sums[lo:lo + nv] = agg[32:32 + nv]
                counts[c] = int(h["count"])
                done[c] = True
        if not done.all():
            raise RuntimeError(f"chunks {np.flatnonzero(~done)[:8].tolist()} never completed "
                               f"(min_count {min_count}, {len(order)} senders)")
        self.slot_rounds += np.bincount(slots, minlength=self.pool_size)
        return sums, counts, late


STRAGGLER_MODES = ("iid", "persistent")


def compute_times(rng, workers: int, speed=None) -> np.ndarray:
    """Heavy-tailed per-step compute times: lognormal body, 10 % Pareto(1.5) stragglers.

    speed: per-worker slowness factors fixed for the run ("persistent" stragglers: mostly
    the same workers, hence the same data shards, are left out); None = i.i.d. workers.
    """
    t = rng.lognormal(np.log(0.1), 0.1, workers)
    slow = rng.random(workers) < 0.1
    t[slow] *= 1 + rng.pareto(1.5, slow.sum())
    return t if speed is None else t * speed


def train(fraction: float | None, seed: int, *, workers: int, steps: int, hidden: int,
          batch: int, lr: float, granularity: int, eval_every: int, stragglers: str = "iid",
          progress=None) -> dict:
    """One run; fraction None = fp32 mean over all workers (no THC, no aggregator)."""
    torch.manual_seed(seed)
    model = make_model(hidden)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    (xtr, ytr), (xte, yte) = load_digits_split(seed)
    shards = [(torch.from_numpy(xtr[w::workers]), torch.from_numpy(ytr[w::workers]))
              for w in range(workers)]
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
    xte_t, yte_t = torch.from_numpy(xte), torch.from_numpy(yte)
    d = sum(p.numel() for p in params)
    codec = thc.THCCodec(granularity=granularity, seed=seed, partition_size=INNETWORK_PARTITION_SIZE)
    padded = codec.padded_length(d)
    k = workers if fraction is None else max(1, int(round(fraction * workers)))
    agg = InProcessAggregator(workers, -(-padded // 1024), codec.table)
    feedback = [thc.ErrorFeedback() for _ in range(workers)]
    rng = np.random.default_rng(1000 + seed)
    if stragglers not in STRAGGLER_MODES:
        raise ValueError(f"stragglers {stragglers!r}: use one of {STRAGGLER_MODES}")
    # persistent: worker speeds spread lognormally (sigma 0.5), fixed for the whole run
    # own stream for the timings, so every run of a seed draws the same batches
    timing = np.random.default_rng(2000 + seed)
    speed = timing.lognormal(0.0, 0.5, workers) if stragglers == "persistent" else None
    log = {"step": [], "train_loss": [], "train_acc": [], "test_acc": []}
    late_replies = 0
    for step in range(steps):
        grads = []
        for w, (xs, ys) in enumerate(shards):
            idx = torch.from_numpy(rng.integers(0, len(xs), batch))
            model.zero_grad()
            F.cross_entropy(model(xs[idx]), ys[idx]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]).numpy().copy())
        order = np.argsort(compute_times(timing, workers, speed), kind="stable")
        if fraction is None:
            mean = np.mean(grads, axis=0)
        else:
            mean, late = _thc_step(codec, agg, feedback, grads, order, k, step, d)
            late_replies += late
        offset = 0
        for p in params:
            p.grad = torch.from_numpy(mean[offset:offset + p.numel()].reshape(p.shape).copy())
            offset += p.numel()
        opt.step()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            with torch.no_grad():
                out = model(xtr_t)
                log["step"].append(step + 1)
                log["train_loss"].append(float(F.cross_entropy(out, ytr_t)))
                log["train_acc"].append(float((out.argmax(1) == ytr_t).float().mean()))
                log["test_acc"].append(float((model(xte_t).argmax(1) == yte_t).float().mean()))
        if progress is not None:
            progress.update(1)
    return {"fraction": fraction, "k": k, "seed": seed, "stragglers":
            "none" if fraction is None else stragglers, "log": log,
            "final_test_acc": log["test_acc"][-1], "final_train_acc": log["train_acc"][-1],
            "final_train_loss": log["train_loss"][-1], "late_replies": late_replies}


def _thc_step(codec, agg, feedback, grads, order, k, step, d):
    """THC through the aggregator with min_count = k; returns (decoded mean, late replies)."""
    first = order[:k]
    xs = [feedback[w].compensate(0, g) for w, g in enumerate(grads)]
    max_norms = np.max([codec.partition_norms(xs[w]) for w in first], axis=0)
    rotated = [codec.rotate(x) for x in xs]
    packed = {w: codec.quantize(rotated[w], max_norms, worker=w, round=step, tensor=0)
              for w in range(len(grads))}
    padded = codec.padded_length(d)
    sums, counts, late = agg.aggregate(packed, order, padded, tensor=0, min_count=k)
    if np.any(counts != k):
        raise RuntimeError(f"step {step}: contributor counts "
                           f"{sorted(set(counts.tolist()))} != k={k}")
    per_value = np.repeat(counts, agg.vpp)[:padded]
    mean = np.asarray(codec.decode(sums, per_value, max_norms, d), np.float32)
    for w in first:                 # the late workers' gradients are dropped: memory unchanged
        own = codec.inverse_rotate(codec.dequantize(packed[w], max_norms), d)
        feedback[w].update(0, xs[w], np.asarray(own, np.float32))
    return mean, late


def summarize(runs: list[dict], fractions=FRACTIONS, early_step: int = 20) -> list[dict]:
    """Mean and std over seeds per (straggler mode, fraction); fp32 first."""
    rows = []
    groups = [("none", None)] + [(m, f) for m in STRAGGLER_MODES for f in fractions]
    for mode, fraction in groups:
        sel = [r for r in runs if r["fraction"] == fraction and r["stragglers"] == mode]
        if not sel:
            continue
        row = {"stragglers": mode, "fraction": fraction, "k": sel[0]["k"], "seeds": len(sel)}
        for key in ("final_test_acc", "final_train_acc", "final_train_loss"):
            vals = np.array([r[key] for r in sel])
            row[key] = float(vals.mean())
            row[key + "_std"] = float(vals.std())
        steps = sel[0]["log"]["step"]
        if early_step in steps:
            i = steps.index(early_step)
            row["early_step"] = early_step
            row["early_test_acc"] = float(np.mean([r["log"]["test_acc"][i] for r in sel]))
            row["early_train_loss"] = float(np.mean([r["log"]["train_loss"][i] for r in sel]))
        rows.append(row)
    return rows


def plot(runs: list[dict], rows: list[dict], path: Path, fractions=FRACTIONS) -> None:
    fig, (ax_frac, ax_curve) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, marker in (("iid", "o"), ("persistent", "s")):
        sel = [r for r in rows if r["stragglers"] == mode]
        if not sel:
            continue
        fr = [r["fraction"] for r in sel]
        for key, label, ls in (("final_test_acc", "test", "-"), ("final_train_acc", "train", ":")):
            ax_frac.errorbar(fr, [r[key] for r in sel], yerr=[r[key + "_std"] for r in sel],
                             marker=marker, ls=ls, capsize=3, label=f"{mode} stragglers, {label}")
    base = [r for r in rows if r["fraction"] is None]
    if base:
        ax_frac.axhline(base[0]["final_test_acc"], color="gray", ls="--", label="fp32 all, test")
    ax_frac.set(xlabel="fraction of workers waited for (k/n)", ylabel="final accuracy")
    ax_frac.invert_xaxis()
    for mode, fraction in [("none", None)] + [("persistent", f) for f in fractions]:
        sel = [r for r in runs if r["fraction"] == fraction and r["stragglers"] == mode]
        if not sel:
            continue
        loss = np.mean([r["log"]["train_loss"] for r in sel], axis=0)
        ax_curve.plot(sel[0]["log"]["step"], loss,
                      label="fp32 all" if fraction is None else f"k/n = {fraction} (persistent)")
    ax_curve.set(xlabel="step", ylabel="training loss (mean over seeds)", yscale="log")
    for ax in (ax_frac, ax_curve):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("digits MLP, THC through the reference aggregator, first k of n workers")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m host.experiments.adapcc.partial_training",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--granularity", type=int, default=25,
                    help="THC table granularity g; workers x g must be <= 255 (8-bit lanes)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256, help="MLP width (main job: 256)")
    ap.add_argument("--batch", type=int, default=32, help="batch per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--stragglers", nargs="+", choices=STRAGGLER_MODES,
                    default=list(STRAGGLER_MODES), help="which straggler patterns to run")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--plot", default="docs/img/adapcc_partial_accuracy.png")
    args = ap.parse_args(argv)
    if args.workers * args.granularity > 255:
        ap.error(f"--workers {args.workers} x --granularity {args.granularity} > 255: the "
                 "aggregator's 8-bit lanes would overflow; lower the granularity")
    if any(not 0 < f <= 1 for f in args.fractions):
        ap.error("--fractions must lie in (0, 1]")
    torch.set_num_threads(1)
    fractions = tuple(args.fractions)
    configs = [(None, "iid", s) for s in range(args.seeds)] + \
        [(f, m, s) for s in range(args.seeds) for m in args.stragglers for f in fractions]
    t0 = time.monotonic()
    runs = []
    with tqdm(total=len(configs) * args.steps, desc="partial training", mininterval=1) as bar:
        for fraction, mode, seed in configs:
            bar.set_postfix(k_over_n=fraction if fraction is not None else "fp32",
                            stragglers=mode, seed=seed)
            runs.append(train(fraction, seed, workers=args.workers, steps=args.steps,
                              hidden=args.hidden, batch=args.batch, lr=args.lr,
                              granularity=args.granularity, eval_every=args.eval_every,
                              stragglers=mode, progress=bar))
    rows = summarize(runs, fractions)
    print(f"\n{args.workers} workers, {args.steps} steps, {args.seeds} seeds, "
          f"{time.monotonic() - t0:.0f} s")
    print(f"{'stragglers':>11}{'k/n':>6}{'k':>4}{'test acc':>16}{'train acc':>16}"
          f"{'train loss':>12}{'acc@20':>8}{'loss@20':>9}")
    for r in rows:
        name = "fp32" if r["fraction"] is None else f"{r['fraction']:.1f}"
        print(f"{r['stragglers']:>11}{name:>6}{r['k']:>4}"
              f"{r['final_test_acc']:>10.4f} ±{r['final_test_acc_std']:.3f}"
              f"{r['final_train_acc']:>10.4f} ±{r['final_train_acc_std']:.3f}"
              f"{r['final_train_loss']:>12.4f}{r.get('early_test_acc', np.nan):>8.3f}"
              f"{r.get('early_train_loss', np.nan):>9.3f}")
    plot(runs, rows, Path(args.plot), fractions)
    print(f"saved {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": rows,
                                               "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
