"""The README's quick start ("Quick start: your own script"): a DDP training script whose
gradients are averaged by THC through an aggregator. From the repository root:

    python -m dataplane.config local --workers 2 --port-base 41000 -o job.json
    python -m dataplane.udp_service --config job.json &
    torchrun --nproc-per-node 2 host/experiments/quickstart_train.py

Through the DPDK switch, aggregator= is the job's switch IP on port 50000 (README). Each
rank prints its first and last loss and a checksum of its
parameters (the same on every rank: the replicas agree).
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from host.ddp_hook import thc_hook, thc_hook_state

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
state = thc_hook_state(aggregator="127.0.0.1:50000", job_config="job.json")
model.register_comm_hook(state, thc_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.02)
data = torch.Generator().manual_seed(rank)           # each rank its own batches
w_true = torch.linspace(-1, 1, 32).reshape(32, 1)
losses = []
for step in range(60):
    x = torch.randn(64, 32, generator=data)
    loss = (model(x) - x @ w_true).square().mean()
    opt.zero_grad()
    loss.backward()                                  # THC mean of the gradients
    opt.step()
    losses.append(loss.item())
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, parameter checksum {checksum!r}",
      flush=True)
state.close()
dist.destroy_process_group()
