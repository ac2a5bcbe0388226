"""Checkpoint and resume with THC (README, "Using THC from your training loop").

    torchrun --nproc-per-node 2 host/experiments/resume_train.py --steps 20 --save ckpt
    torchrun --nproc-per-node 2 host/experiments/resume_train.py --steps 20 --resume ckpt

Every rank saves its own checkpoint (`ckpt/rank{r}.pt`: model, optimizer, THC hook state,
step): THC's error feedback is per worker. Resumed, the run goes on bit for bit as one of
40 uninterrupted steps would (tests/host/test_resume.py checks it). Options: --aggregator
HOST:PORT --job-config job.json (through an aggregator, e.g. the UDP service of the quick
start), --params FILE (rank 0 writes the final parameters there).
"""
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from host.ddp_hook import thc_hook, thc_hook_state

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=20, help="steps to train in this run")
parser.add_argument("--save", type=Path, help="write each rank's checkpoint in this folder")
parser.add_argument("--resume", type=Path, help="continue from the checkpoints in this folder")
parser.add_argument("--aggregator", help="HOST:PORT of an aggregator (default: no switch)")
parser.add_argument("--job-config", help="the job description the aggregator serves")
parser.add_argument("--params", type=Path, help="rank 0 saves the final parameters here")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)                                 # the same initial model on every rank
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
            bucket_cap_mb=0.01)                      # small buckets: several per step
state = thc_hook_state(aggregator=args.aggregator, job_config=args.job_config)
model.register_comm_hook(state, thc_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
start = 0
if args.resume:
    ckpt = torch.load(args.resume / f"rank{rank}.pt")
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    state.load_state_dict(ckpt["thc"])               # before the first step
    start = ckpt["step"]

w_true = torch.linspace(-1, 1, 32 * 4).reshape(32, 4)
for step in range(start, start + args.steps):
    data = torch.Generator().manual_seed(1000 * step + rank)   # batch of (step, rank)
    x = torch.randn(16, 32, generator=data)
    loss = (model(x) - x @ w_true).square().mean()
    opt.zero_grad()
    loss.backward()                                  # THC mean of the gradients
    opt.step()
print(f"rank {rank}: step {start + args.steps}, loss {loss.item():.5f}", flush=True)

if args.save:
    args.save.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "thc": state.state_dict(), "step": start + args.steps},
               args.save / f"rank{rank}.pt")
if args.params and rank == 0:
    torch.save([p.detach().clone() for p in model.parameters()], args.params)
state.close()
dist.destroy_process_group()
