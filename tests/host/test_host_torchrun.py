"""The DDP hook under torchrun: ranks from the environment, the job description from
THC_JOB_CONFIG (each rank binds its member's port)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from hosttest_util import free_port, job_config

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, sys, torch, torch.distributed as dist, torch.nn as nn
from host.ddp_hook import thc_hook, thc_hook_state
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(nn.Linear(32, 4))
state = thc_hook_state(aggregator=os.environ["AGG"], pool_size=8)
model.register_comm_hook(state, thc_hook)
for _ in range(3):
    model(torch.randn(8, 32)).square().mean().backward()
w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
local = state.allreduce.exchange.transport.local_address
json.dump({"rank": rank, "port": local[1], "params": w},
          open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
dist.destroy_process_group()
"""


def test_hook_under_torchrun(tmp_path):
    from dataplane.udp_service import serve
    base = free_port()
    while base + 1 >= 65536:
        base = free_port()
    members = [("127.0.0.1", base), ("127.0.0.1", base + 1)]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = job_config(members, 8)
    config.save(tmp_path / "job.json")
    with serve(config, "127.0.0.1", 0) as svc:
        env = dict(os.environ, AGG=f"127.0.0.1:{svc.address[1]}",
                   THC_JOB_CONFIG=str(tmp_path / "job.json"), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        for stale in ("THC_WORKER_IP", "THC_WORKER_PORT_BASE"):
            env.pop(stale, None)
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "--master-port", str(free_port()), str(script),
                              str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=180)
        counters = svc.counters()["jobs"][1]
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [o["port"] for o in out] == [base, base + 1]   # the members' ports, by rank
    assert out[0]["params"] == out[1]["params"]           # replicas agree
    assert counters["results_multicast"] >= 3 and counters["drop_not_member"] == 0
