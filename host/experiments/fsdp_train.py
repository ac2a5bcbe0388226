"""FSDP2 with THC as its reduce-scatter (README, "FSDP2"): the main job's MLP on the main
job's data (host/experiments/common.py), every Linear and the model under fully_shard.
From the repository root:

    torchrun --nproc-per-node 2 host/experiments/fsdp_train.py              # THC over gloo
    torchrun --nproc-per-node 2 host/experiments/fsdp_train.py --comm fp32  # FSDP's own
    torchrun --nproc-per-node 2 host/experiments/fsdp_train.py \\
        --aggregator 127.0.0.1:50000 --job-config job.json      # through an aggregator

(the aggregator as in the README's quick start). Each rank prints the run's test accuracy
and training loss, the same on every rank: the shards make up one model.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from host.experiments.common import load_digits_split, make_model
from host.fsdp import thc_fully_shard_comm

COMMS = ("thc", "fp32")


def sharded_model(hidden: int, seed: int) -> nn.Module:
    """The main job's MLP, the same initial weights on every rank, each Linear its own
    FSDP module (its own reduce-scatter) under the root's."""
    torch.manual_seed(seed)
    model = make_model(hidden)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def train(comm: str = "thc", *, hidden: int = 256, steps: int = 150, batch: int = 32,
          lr: float = 0.05, seed: int = 0, thc_options: dict | None = None) -> dict:
    """One run on this process group (every rank calls it): SGD with momentum, as the
    main job, each rank on its own slice of the training set. comm: "thc" (THC's
    reduce-scatter, thc_options: thc_hook_state's keyword arguments) or "fp32" (FSDP's
    own). Returns the test accuracy, the training loss and THC's bytes sent per step."""
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_model(hidden, seed)
    state = thc_fully_shard_comm(model, thc_options or {}) if comm == "thc" else None
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    (xtr, ytr), (xte, yte) = load_digits_split(seed)
    xs, ys = torch.from_numpy(xtr[rank::world]), torch.from_numpy(ytr[rank::world])
    rng = np.random.default_rng(seed + rank)
    order, pos = rng.permutation(len(xs)), 0
    for _ in range(steps):
        if pos + batch > len(order):
            order, pos = rng.permutation(len(xs)), 0
        idx = torch.from_numpy(order[pos:pos + batch])
        pos += batch
        opt.zero_grad()
        F.cross_entropy(model(xs[idx]), ys[idx]).backward()   # the reduce-scatters run here
        opt.step()
    with torch.no_grad():                  # every rank: the forward all-gathers the shards
        train_loss = float(F.cross_entropy(model(torch.from_numpy(xtr)), torch.from_numpy(ytr)))
        test_acc = float((model(torch.from_numpy(xte)).argmax(1) == torch.from_numpy(yte))
                         .float().mean())
    result = {"comm": comm, "test_acc": test_acc, "train_loss": train_loss}
    if state is not None:
        result["bytes_per_step"] = state.bytes_sent / steps
        state.close()
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comm", choices=COMMS, default="thc")
    ap.add_argument("--aggregator", help="HOST:PORT of the aggregator (default: THC over gloo)")
    ap.add_argument("--job-config", help="the job description the aggregator serves")
    ap.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32, help="batch per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.aggregator and not args.job_config:
        ap.error("--aggregator needs --job-config (the job description the aggregator serves)")
    torch.set_num_threads(1)               # the ranks share this machine's cores
    dist.init_process_group("gloo")
    options = {"aggregator": args.aggregator, "job_config": args.job_config} \
        if args.aggregator else {}
    result = train(args.comm, hidden=args.hidden, steps=args.steps, batch=args.batch,
                   lr=args.lr, seed=args.seed, thc_options=options)
    sent = f", {result['bytes_per_step'] / 1e3:.1f} KB sent per step" \
        if "bytes_per_step" in result else ""
    print(f"rank {dist.get_rank()}: {args.comm} test accuracy {result['test_acc']:.3f}, "
          f"train loss {result['train_loss']:.4f}{sent}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
