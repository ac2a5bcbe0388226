"""torch.compile with the THC DDP hook (README, "Using THC from your training loop").

Two gloo worker processes train the same model a few steps in eager DDP with the hook,
then compiled (torch.compile of the DDP module: DDPOptimizer cuts the graph at DDP's bucket
boundaries and DDP's C++ reducer calls the hook between the compiled pieces); the loss
curves must agree. Compiled autograd needs DDP's Python reducer, which calls hooks per
parameter inside a traced graph: thc_hook refuses it with an error that says what to do.
"""
import datetime
import traceback

import numba
import torch
import torch.distributed as dist
import torch.nn as nn

from host.ddp_hook import thc_hook, thc_hook_state

from hosttest_util import run_worker_processes

STEPS = 5


def _ddp_model():
    torch.manual_seed(0)
    # 1.1 MB of parameters with 1 MB buckets: two buckets, so two compiled pieces
    return nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 4)), bucket_cap_mb=1)


def _train(rank, compiled: bool):
    """Losses of STEPS steps and the hook's calls per bucket."""
    ddp = _ddp_model()
    state = thc_hook_state()
    ddp.register_comm_hook(state, thc_hook)
    model = torch.compile(ddp) if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    calls = dict(state.allreduce.calls)
    state.close()
    return losses, calls


def _compiled_autograd_error(rank) -> str:
    """What a user gets who turns on compiled autograd with DDP's Python reducer."""
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    ddp = _ddp_model()
    state = thc_hook_state()
    ddp.register_comm_hook(state, thc_hook)

    @torch.compile
    def forward_backward(x):
        loss = ddp(x).square().mean()
        loss.backward()
        return loss
    try:
        forward_backward(torch.randn(16, 32))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        state.close()
    return "no error"


def _worker(rank, init, queue):
    try:
        torch.set_num_threads(1)
        numba.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=300))
        eager = _train(rank, compiled=False)
        compiled = _train(rank, compiled=True)
        refusal = _compiled_autograd_error(rank)
        queue.put((rank, {"eager": eager, "compiled": compiled, "refusal": refusal}))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


def test_a_compiled_ddp_model_trains_as_in_eager_mode_and_compiled_autograd_is_refused():
    results = run_worker_processes(_worker, lambda r, init, q: (r, init, q), 2, seconds=400)
    for rank, out in results.items():
        (eager, eager_calls), (compiled, compiled_calls) = out["eager"], out["compiled"]
        # the hook ran on both buckets in both modes (DDP's first step: one bucket)
        assert eager_calls == compiled_calls == {0: STEPS, 1: STEPS - 1}
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager),
                                   rtol=1e-4, atol=1e-6)
        assert eager[-1] < eager[0]                        # it learns
        assert "thc_hook needs a DDP GradBucket" in out["refusal"]
        assert "leave optimize_ddp and compiled_autograd at their defaults" in out["refusal"]
