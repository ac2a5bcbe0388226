"""THC in a custom training loop, without DDP (README, "Using THC from your training loop"):

    torchrun --nproc-per-node 2 host/experiments/custom_loop_train.py

After backward, allreduce_gradients averages every .grad over the workers with THC (one
exchange of all the gradients, flattened). Each rank prints its first and last loss and a
checksum of its parameters (the same on every rank: the replicas agree).
"""
import torch
import torch.distributed as dist

from host.ddp_hook import allreduce_gradients, thc_hook_state

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)                                 # the same initial model on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
state = thc_hook_state()                             # THC over all_reduce: no switch
opt = torch.optim.SGD(model.parameters(), lr=0.02)
data = torch.Generator().manual_seed(rank)           # each rank its own batches
w_true = torch.linspace(-1, 1, 32).reshape(32, 1)
losses = []
for step in range(60):
    x = torch.randn(64, 32, generator=data)
    loss = (model(x) - x @ w_true).square().mean()
    opt.zero_grad()
    loss.backward()
    allreduce_gradients(model.parameters(), state)   # THC mean of every .grad, in place
    opt.step()
    losses.append(loss.item())
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, parameter checksum {checksum!r}",
      flush=True)
state.close()
dist.destroy_process_group()
