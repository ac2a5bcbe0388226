"""THC allreduce and the DDP hook on CUDA tensors (a GPU machine only): the codec runs on
the GPU (thc/cuda_kernels.py), the indices and sums cross the host, and the means must be
those of the CPU path, bit for bit up to float32 rounding, on every worker. Two worker
processes share the one GPU, over a gloo process group and the reference aggregator on
loopback."""
import datetime
import traceback

import numpy as np
import pytest

import thc

from hosttest_util import free_port, job_config, run_worker_processes

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

WORLD = 2
D = 3 * (1 << 14) + 1_234      # several RHT partitions (2^14 in-network) and a padded tail
PARTITION = 1 << 14
CALLS = 3                      # error feedback carries across calls
KEY = 1000                     # apart from the DDP buckets' keys (0, 1, ...)


def grad(rank, call):
    rs = np.random.default_rng(100 * call + rank)
    return rs.standard_normal(D).astype(np.float32)


def _scenario(rank, aggregator, members):
    import torch.nn as nn

    from host.ddp_hook import thc_hook, thc_hook_state

    codec = thc.THCCodec(seed=5, partition_size=PARTITION)
    # the in-network path with the codec on the GPU; THC over the process group's
    # all_reduce with the same codec on the CPU: the integer sums are the same
    gpu = thc_hook_state(aggregator=aggregator, job_config=job_config(members, 16), job=1,
                         codec=codec, worker_address=tuple(members[rank]), timeout=30)
    cpu = thc_hook_state(codec=codec)
    out = {"gpu": [], "cpu": [], "device": []}
    for call in range(CALLS):
        g = torch.from_numpy(grad(rank, call))
        mean_gpu = gpu.reduce(g.cuda(), KEY)
        out["device"].append(str(mean_gpu.device))
        out["gpu"].append(mean_gpu.cpu().numpy())
        out["cpu"].append(cpu.reduce(g, KEY).numpy())
    # the DDP hook on a CUDA model: it trains and the replicas stay identical
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(gpu, thc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rs = np.random.default_rng(rank)
    w_true = torch.from_numpy(np.random.default_rng(9).standard_normal((64, 1))
                              .astype(np.float32)).cuda()
    losses = []
    for _ in range(30):
        x = torch.from_numpy(rs.standard_normal((32, 64)).astype(np.float32)).cuda()
        loss = ((ddp(x) - x @ w_true) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    out["losses"] = losses
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
    return out


def _worker(rank, init, aggregator, members, queue):
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=120))
        queue.put((rank, _scenario(rank, aggregator, members)))
    except Exception:
        queue.put((rank, {"crash": traceback.format_exc()}))


@pytest.fixture(scope="module")
def run():
    from dataplane.udp_service import serve
    members = [("127.0.0.1", free_port()) for _ in range(WORLD)]
    svc = serve(job_config(members, 16), "127.0.0.1", 0)
    try:
        return run_worker_processes(
            _worker, lambda r, init, queue: (r, init, f"{svc.address[0]}:{svc.address[1]}",
                                             members, queue), WORLD, seconds=300)
    finally:
        svc.stop()


def test_gpu_means_are_the_cpu_means_on_every_worker(run):
    for r in range(WORLD):
        assert "crash" not in run[r], run[r].get("crash")
        assert all(d.startswith("cuda") for d in run[r]["device"])
        for call in range(CALLS):
            got, want = run[r]["gpu"][call], run[r]["cpu"][call]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
            assert np.array_equal(got, run[0]["gpu"][call])      # every worker decodes alike
    mean = np.mean([grad(r, 0) for r in range(WORLD)], axis=0)
    nmse = np.sum((run[0]["gpu"][0] - mean) ** 2) / np.sum(mean ** 2)
    assert nmse < 0.05


def test_ddp_hook_on_a_cuda_model_trains_and_replicas_agree(run):
    losses = np.array(run[0]["losses"])
    assert losses[-5:].mean() < 0.3 * losses[:3].mean()
    assert np.array_equal(run[1]["params"], run[0]["params"])
