"""Shared set-up for the host tests (imported by name: tests/host is not a package, so
its modules cannot shadow the real `host` package)."""
import socket
import time

import numpy as np
import pytest

import thc
from dataplane.config import Job, Member, SwitchConfig
from dataplane.ports import free_port  # noqa: F401 (re-exported to the host tests)
from dataplane.udp_service import serve

TABLE = thc.optimal_table(4, 30, 1 / 32, symmetric=True)




def job_config(addresses, pool_size: int, job: int = 1) -> SwitchConfig:
    """One job whose worker w sends from addresses[w] (ip, udp_port)."""
    members = [Member(worker=w, port=w, mac=f"02:00:00:00:01:{w + 1:02x}", ip=ip, udp_port=port)
               for w, (ip, port) in enumerate(addresses)]
    return SwitchConfig(ip="127.0.0.1", jobs=(Job.from_thc(job, pool_size, members),)).validate()


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def aggregator():
    """aggregator(n_workers, pool_size) -> (service, worker addresses); stopped after the test."""
    services = []

    def start(n_workers: int, pool_size: int, addresses=None):
        addresses = addresses or [("127.0.0.1", free_port()) for _ in range(n_workers)]
        svc = serve(job_config(addresses, pool_size), "127.0.0.1", 0)
        services.append(svc)
        return svc, addresses
    yield start
    for svc in services:
        svc.stop()


def random_indices(n_workers: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 16, d).astype(np.uint8) for _ in range(n_workers)]


def pack(idx: np.ndarray) -> np.ndarray:
    """Two 4-bit indices per byte, the even one in the high nibble (test-side reference)."""
    if len(idx) % 2:
        idx = np.concatenate([idx, np.zeros(1, np.uint8)])
    return ((idx[0::2] << 4) | idx[1::2]).astype(np.uint8)


class FakeAggregatorSocket:
    """A plain socket playing the aggregator, so a test can send exact datagrams."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(5)
        self.address = self.sock.getsockname()

    def recv(self):
        data, anc, _, source = self.sock.recvmsg(4096, socket.CMSG_SPACE(4))
        tos = [c[2][0] for c in anc if c[0] == socket.IPPROTO_IP and c[1] == socket.IP_TOS]
        return data, (tos[0] if tos else None), source


def run_worker_processes(worker, args, world: int, *, expect: int | None = None,
                         seconds: float = 150, fail_on_death: bool = True) -> dict:
    """Start `world` forkserver processes worker(*args(rank, init_url, queue)); collect one
    (rank, value) per reporting worker from the queue (`expect` of them, default all),
    join them, and fail on a dead process (fail_on_death) or a reported crash."""
    import torch.multiprocessing as mp

    expect = world if expect is None else expect
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "thc", "host.ddp_hook"])
    init = f"tcp://127.0.0.1:{free_port()}"
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=args(r, init, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + seconds
        while len(results) < expect and time.monotonic() < deadline:
            try:
                rank, value = queue.get(timeout=1)
                results[rank] = value
            except Exception:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                assert not (fail_on_death and dead), \
                    f"worker processes {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
        assert len(results) == expect, f"only ranks {sorted(results)} reported in time"
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    crashed = {r: v["crash"] for r, v in results.items() if "crash" in v}
    assert not crashed, crashed
    return results
