"""DLCP on the in-network THC path: do the importance marks mean something?

    python -m host.experiments.dlcp.innetwork                      # all three studies, a table each
    python -m host.experiments.dlcp.innetwork --json out/dlcp_innetwork.json --plot docs/img/x.png

On real gradients of the main job's model (host.experiments.main_job: the digits MLP, 4 workers each
on its own shard), with THC as the in-network path codes them:

* marks: what fraction of the RHT partitions (and of the gradient's energy) the
  per-partition rule marks important, next to the per-packet rule applied to the rotated
  values (which marks at random: after the RHT every packet of a partition has about the
  same magnitude);
* drops: the decoded gradient's error when a fraction of the packets is lost, chosen among
  the Not-ECT packets (what a DLCP switch drops first) or at random, a lost packet decoding
  as zero in the rotated domain (bounded loss, docs/dlcp.md);
* train: the main job trained with those losses every step (selective, random, none);
* cost: codec time per call and error without loss at each partition size (the marks
  need several partitions per bucket).

The codec work runs in this process (a simulation of the aggregator's integer sums,
bit-identical to the real path by THC's homomorphism); the packet path itself is tested in
tests/dlcp/test_innetwork_bounded_loss.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import matplotlib.pyplot as plt     # the Agg backend: host.experiments.common selects it
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import thc
from host.dlcp.marking import (ECN_NOT_ECT, importance_ecn, partition_importance,
                               partition_packet_ecn)
from host.experiments.common import load_digits_split, make_model
from host.experiments.dlcp import innetwork_incast

WORKERS = 4
VALUES_PER_PACKET = 1024
PARTITION_SIZE = 1 << 12


# --------------------------------------------------------------------------- gradients

def _model_and_data(hidden: int, seed: int):
    torch.manual_seed(seed)
    model = make_model(hidden)
    (xtr, ytr), (xte, yte) = load_digits_split(seed)
    return model, (torch.from_numpy(xtr), torch.from_numpy(ytr)), \
        (torch.from_numpy(xte), torch.from_numpy(yte))


def _worker_gradients(model, xs, ys, idx_per_worker):
    """One flat float32 gradient per worker (its own mini-batch)."""
    grads = []
    for idx in idx_per_worker:
        model.zero_grad()
        F.cross_entropy(model(xs[idx]), ys[idx]).backward()
        grads.append(np.concatenate([p.grad.detach().reshape(-1).numpy()
                                     for p in model.parameters()]).astype(np.float32))
    return grads


def main_job_gradient(hidden: int = 256, seed: int = 0, batch: int = 32,
                      workers: int = WORKERS, warm_steps: int = 20) -> list[np.ndarray]:
    """The workers' gradients of the main job's model after `warm_steps` plain SGD steps
    (a trained model's gradients are more uneven than the initial ones)."""
    model, (xs, ys), _ = _model_and_data(hidden, seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(warm_steps + 1):
        idx = [torch.from_numpy(rng.choice(np.arange(w, len(xs), workers), batch,
                                           replace=False)) for w in range(workers)]
        grads = _worker_gradients(model, xs, ys, idx)
        _set_gradients(model, np.mean(grads, axis=0))
        opt.step()
    return grads


def _set_gradients(model, flat: np.ndarray) -> None:
    """Each parameter's .grad from its slice of one flat gradient vector."""
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(torch.from_numpy(flat[offset:offset + n]).view_as(p))
        offset += n


# --------------------------------------------------------------------------- the codec path

def _agreed_norms(codec, grads):
    return np.max([codec.partition_norms(g) for g in grads], axis=0)


def marks(grads, codec, values_per_packet: int = VALUES_PER_PACKET) -> dict:
    """The partition rule's marks (from the max-reduced norms every worker agrees on) and
    the per-packet rule's on worker 0's rotated values; energy shares of each."""
    d = len(grads[0])
    layout = codec.layout(d)
    norms = _agreed_norms(codec, grads)
    important = partition_importance(norms, layout.data_lengths())
    n_packets = -(-layout.padded // values_per_packet)
    ecn = partition_packet_ecn(important, layout.sizes(), values_per_packet, n_packets)
    rotated = np.asarray(codec.rotate(np.mean(grads, axis=0)))
    old = importance_ecn(np.asarray(codec.rotate(grads[0])), values_per_packet, n_packets,
                         np.random.default_rng(0))
    energy = np.add.reduceat(rotated.astype(np.float64) ** 2,
                             np.arange(n_packets) * values_per_packet)
    total = energy.sum()

    def share(ect):
        return float(energy[ect != ECN_NOT_ECT].sum() / total)
    return {"d": d, "partition_size": codec.partition_size, "partitions": len(norms),
            "packets": n_packets, "partition_important": important,
            "packets_ect": float(np.mean(ecn != ECN_NOT_ECT)),
            "energy_important": share(ecn),
            "packets_ect_rotated_rule": float(np.mean(old != ECN_NOT_ECT)),
            "energy_rotated_rule": share(old), "ecn": ecn, "ecn_rotated_rule": old}


def lossy_mean(codec, grads, lost_packets, values_per_packet: int, *, round_: int = 0):
    """The THC mean with the given packets lost: their values decode as zero in the
    rotated domain (count 0), exactly as the bounded-loss path decodes them."""
    d = len(grads[0])
    norms = _agreed_norms(codec, grads)
    sums = None
    for w, g in enumerate(grads):
        lanes = np.asarray(codec.lookup(codec.compress(g, norms, worker=w, round=round_,
                                                       tensor=0))).astype(np.int32)
        sums = lanes if sums is None else sums + lanes
    counts = np.full(len(sums), len(grads), np.int64)
    lost = np.zeros(-(-len(sums) // values_per_packet), bool)
    lost[np.asarray(lost_packets, np.int64)] = True
    counts[np.repeat(lost, values_per_packet)[:len(sums)]] = 0
    return np.asarray(codec.decode(sums, counts, norms, d))


def _choose_drops(ecn, count: int, selective: bool, rng) -> np.ndarray:
    pool = np.flatnonzero(ecn == ECN_NOT_ECT) if selective else np.arange(len(ecn))
    if len(pool) < count:          # fewer Not-ECT packets than drops: the rest are ECT
        rest = np.setdiff1d(np.arange(len(ecn)), pool)
        return np.concatenate([pool, rng.choice(rest, count - len(pool), replace=False)])
    return rng.choice(pool, count, replace=False)


def drop_experiment(grads, codec, values_per_packet: int = VALUES_PER_PACKET,
                    drop_fraction: float = 0.1, trials: int = 5, seed: int = 0) -> dict:
    """NMSE of the decoded mean vs the true mean: no loss, Not-ECT drops (partition rule),
    Not-ECT drops of the per-packet rule on rotated values, random drops (same count)."""
    mean = np.mean(grads, axis=0).astype(np.float64)
    m = marks(grads, codec, values_per_packet)
    count = int(round(drop_fraction * m["packets"]))
    rng = np.random.default_rng(seed)

    def nmse(lost, rnd):
        est = lossy_mean(codec, grads, lost, values_per_packet, round_=rnd)
        return float(np.sum((est - mean) ** 2) / np.sum(mean ** 2))
    out = {"drop_fraction": drop_fraction, "dropped_packets": count, "packets": m["packets"]}
    out["lossless_nmse"] = float(np.mean([nmse([], t) for t in range(trials)]))
    for name, ecn, selective in (("selective", m["ecn"], True),
                                 ("rotated_rule", m["ecn_rotated_rule"], True),
                                 ("random", m["ecn"], False)):
        out[f"{name}_nmse"] = float(np.mean([nmse(_choose_drops(ecn, count, selective, rng), t)
                                             for t in range(trials)]))
    return out


# --------------------------------------------------------------------------- training

def train(mode: str, *, drop_fraction: float, steps: int, hidden: int = 256, seed: int = 0,
          batch: int = 32, lr: float = 0.02, partition_size: int = PARTITION_SIZE,
          values_per_packet: int = VALUES_PER_PACKET, workers: int = WORKERS) -> dict:
    """The main job's training, THC-averaged with drop_fraction of the packets lost every
    step: mode "selective" (Not-ECT first), "random", or "none" (no loss)."""
    model, (xs, ys), (xte, yte) = _model_and_data(hidden, seed)
    codec = thc.THCCodec(seed=seed, partition_size=partition_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    rng = np.random.default_rng(seed)
    drops = np.random.default_rng(seed + 1)
    acc, lost_total = [], 0
    for step in range(steps):
        idx = [torch.from_numpy(rng.choice(np.arange(w, len(xs), workers), batch,
                                           replace=False)) for w in range(workers)]
        grads = _worker_gradients(model, xs, ys, idx)
        lost = []
        if mode != "none":
            m = marks(grads, codec, values_per_packet)
            count = int(round(drop_fraction * m["packets"]))
            lost = _choose_drops(m["ecn"], count, mode == "selective", drops)
            lost_total += len(lost)
        _set_gradients(model, lossy_mean(codec, grads, lost, values_per_packet, round_=step))
        opt.step()
        if (step + 1) % 10 == 0 or step + 1 == steps:
            with torch.no_grad():
                acc.append((step + 1, float((model(xte).argmax(1) == yte).float().mean())))
    return {"mode": mode, "drop_fraction": drop_fraction, "steps": steps,
            "final_test_acc": acc[-1][1], "test_acc": acc, "lost_packets": lost_total}


# --------------------------------------------------------------------------- codec cost

def partition_cost(grads, sizes=(1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 20),
                   large: int = 1 << 22, repeats: int = 5) -> list[dict]:
    """Per partition size: NMSE without loss on the main job's gradient, and the codec's
    time per call (rotate + quantize + decode, best of `repeats`) on it and on a large
    tensor of `large` floats (one worker's share of the work)."""
    mean = np.mean(grads, axis=0).astype(np.float64)
    big = np.random.default_rng(0).standard_normal(large).astype(np.float32)
    rows = []
    for ps in sizes:
        codec = thc.THCCodec(seed=0, partition_size=ps)
        est = lossy_mean(codec, grads, [], VALUES_PER_PACKET)
        row = {"partition_size": ps, "partitions": codec.num_partitions(len(mean)),
               "nmse": float(np.sum((est - mean) ** 2) / np.sum(mean ** 2))}
        for name, x in (("model", grads[0]), ("large", big)):
            codec.decode(codec.lookup(codec.compress(x, codec.partition_norms(x), worker=0,
                                                     round=0, tensor=0)), 1,
                         codec.partition_norms(x), len(x))          # compile, warm caches
            best = np.inf
            for r in range(repeats):
                t0 = time.perf_counter()
                norms = codec.partition_norms(x)
                packed = codec.quantize(codec.rotate(x), norms, worker=0, round=r, tensor=0)
                codec.decode(codec.lookup(packed), 1, norms, len(x))
                best = min(best, time.perf_counter() - t0)
            row[f"ms_{name}"] = 1e3 * best
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- CLI

def _table(rows, cols) -> str:
    head = " ".join(f"{c:>14}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{r[c]:>14.4g}" if isinstance(r[c], float) else f"{r[c]:>14}"
                              for c in cols))
    return "\n".join(lines)


def run(args) -> dict:
    grads = main_job_gradient(hidden=args.hidden, seed=args.seed)
    codec = thc.THCCodec(seed=args.seed, partition_size=args.partition_size)
    m = marks(grads, codec)
    summary = {k: v for k, v in m.items() if not isinstance(v, np.ndarray)}
    drops = [drop_experiment(grads, codec, drop_fraction=f, trials=args.trials)
             for f in tqdm(args.drop_fractions, desc="drops")]
    runs = []
    for f in args.train_drop_fractions:
        for mode in ("selective", "random"):
            runs.append(train(mode, drop_fraction=f, steps=args.steps, hidden=args.hidden,
                              seed=args.seed, partition_size=args.partition_size))
    runs.append(train("none", drop_fraction=0.0, steps=args.steps, hidden=args.hidden,
                      seed=args.seed, partition_size=args.partition_size))
    cost = partition_cost(grads)
    return {"marks": summary, "drops": drops, "train": runs, "partition_cost": cost,
            "load_average": os.getloadavg()}


def plot(result, path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    fr = [d["drop_fraction"] for d in result["drops"]]
    for key, label in (("selective_nmse", "Not-ECT first (partition rule)"),
                       ("rotated_rule_nmse", "Not-ECT first (per-packet rule, rotated)"),
                       ("random_nmse", "random")):
        a.plot(fr, [d[key] for d in result["drops"]], "o-", label=label)
    a.axhline(result["drops"][0]["lossless_nmse"], color="gray", ls=":", label="no loss")
    a.set_xlabel("fraction of packets lost")
    a.set_ylabel("NMSE of the decoded mean")
    a.set_yscale("log")
    a.legend(fontsize=7)
    for r in result["train"]:
        steps, acc = zip(*r["test_acc"])
        b.plot(steps, acc, label=f"{r['mode']} {r['drop_fraction']:.0%}")
    b.set_xlabel("step")
    b.set_ylabel("test accuracy")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m host.experiments.dlcp.innetwork",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="study")
    codec_ap = sub.add_parser("codec", help="marks, drops, training, partition cost (default)")
    codec_ap.add_argument("--hidden", type=int, default=256)
    codec_ap.add_argument("--seed", type=int, default=0)
    codec_ap.add_argument("--partition-size", type=int, default=PARTITION_SIZE)
    codec_ap.add_argument("--drop-fractions", type=float, nargs="+",
                          default=[0.05, 0.1, 0.2, 0.3])
    codec_ap.add_argument("--train-drop-fractions", type=float, nargs="+", default=[0.3])
    codec_ap.add_argument("--steps", type=int, default=60)
    codec_ap.add_argument("--trials", type=int, default=20)
    incast_ap = sub.add_parser("incast", help="THC incast through the DPDK switch (root)")
    innetwork_incast.add_arguments(incast_ap)
    for a in (codec_ap, incast_ap):
        a.add_argument("--json", help="write the results here")
        a.add_argument("--plot", help="save a plot here (PNG)")
    argv = list(argv) if argv is not None else sys.argv[1:]
    if not argv or argv[0] not in ("codec", "incast", "-h", "--help"):
        argv = ["codec"] + argv
    args = ap.parse_args(argv)
    if args.study == "incast":
        result = innetwork_incast.run(args)
        print(_table(result["runs"], ["mode", "calls", "call_ms_median", "call_ms_p99",
                                      "call_ms_max", "selective_drops", "buffer_drops",
                                      "ce_marked", "window_cuts", "chunks_lost", "retransmissions",
                                      "test_acc", "test_loss"]))
    else:
        result = run(args)
        _print_codec(result)
    print("load average:", " ".join(f"{x:.2f}" for x in result["load_average"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        (plot if args.study != "incast" else innetwork_incast.plot)(result, args.plot)


def _print_codec(result) -> None:
    mk = result["marks"]
    print(f"marks (partition {mk['partition_size']}, {mk['partitions']} partitions, "
          f"{mk['packets']} packets): partition rule {mk['packets_ect']:.0%} of packets ECT "
          f"holding {mk['energy_important']:.0%} of the energy; per-packet rule on rotated "
          f"values {mk['packets_ect_rotated_rule']:.0%} ECT holding "
          f"{mk['energy_rotated_rule']:.0%}")
    print(_table(result["drops"], ["drop_fraction", "lossless_nmse", "selective_nmse",
                                   "rotated_rule_nmse", "random_nmse"]))
    print(_table(result["train"], ["mode", "drop_fraction", "lost_packets", "final_test_acc"]))
    print(_table(result["partition_cost"], ["partition_size", "partitions", "nmse",
                                            "ms_model", "ms_large"]))


if __name__ == "__main__":
    main()
