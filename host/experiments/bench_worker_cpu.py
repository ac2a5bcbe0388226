"""Benchmark: one worker's CPU time per THC allreduce call, native data path on and off.

    python -m host.experiments.bench_worker_cpu [--mb 16] [--calls 10]
                                    [--values-per-packet 8192] [--pool 64]
                                    [--moderation-us 0,250] [--device cpu|cuda] [--json F]

One worker (a gloo process group of one) calls `THCAllreduce` with an `AggregatorExchange`
on a float32 tensor of --mb MB, through the reference aggregator as a UDP service in a
child process on loopback (so the aggregator's CPU is not the worker's). For each data
path (host.native once per --moderation-us value, the C loop's RESULT moderation; then the
Python path) it reports, per call, with the receive syscalls per call beside it:

* total: the worker process's CPU time (every thread: caller, exchange thread, the
  stream's I/O thread, Numba's) over --calls calls, divided by the calls;
* datagram path: the CPU time (per thread) spent in the stream's operations of
  host/transport.py: submissions (packet encoding, first sends), waits, and the I/O
  thread that sends, retransmits and takes in results;
* codec: norms + RHT (fused, as the call runs them), quantize + pack, decode + inverse
  RHT, each measured alone on the same tensor (same pipeline chunks) in the same run;
  together they are the codec floor, the CPU a call cannot go below;
* the rest: total - codec - datagram path (the allreduce's glue: control and norm
  exchanges, buffers, Python), with the CPU of threads Python did not start (the
  OpenMP pools of Numba and torch, gloo's) shown apart: on a loaded machine their
  spin-waiting is a large part of it, and it varies from run to run.

--device cuda puts the tensor on the GPU, so the codec runs there (thc/cuda_kernels.py) and
the worker's CPU is what is left: launching the kernels, the host copies of the indices and
sums, the datagram path and the glue. The codec floor is then the CPU time of the same GPU
work (launches, and the waits for the norms and the non-finite count).

--json writes every number; the table is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from contextlib import contextmanager

import numba
import numpy as np
import torch
import torch.distributed as dist

import thc
from dataplane.config import Job, Member, SwitchConfig
from dataplane.ports import free_port
from dataplane.udp_service import serve
from host import native
from host.allreduce import AggregatorExchange, THCAllreduce, codec_threads
from host.ddp_hook import INNETWORK_PARTITION_SIZE
from host.transport import RESULT_MODERATION_S, AggregatorTransport, TensorStream

WARMUP_CALLS = 2


class DatagramCpu:
    """Thread CPU time spent inside the stream operations of host.transport.TensorStream
    (outermost call per thread only: submit's own pump is not counted twice)."""

    OPERATIONS = ("submit", "_drive", "_serve")

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._depth = threading.local()

    def _wrap(self, fn):
        meter = self

        def timed(*args, **kwargs):
            depth = getattr(meter._depth, "n", 0)
            meter._depth.n = depth + 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                meter._depth.n = depth
                if depth == 0:
                    with meter._lock:
                        meter.seconds += time.thread_time() - t0
        return timed

    @contextmanager
    def installed(self):
        originals = {name: getattr(TensorStream, name) for name in self.OPERATIONS}
        for name, fn in originals.items():
            setattr(TensorStream, name, self._wrap(fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(TensorStream, name, fn)


def _foreign_thread_cpu() -> float:
    """CPU seconds of this process's live threads that Python did not start (Linux)."""
    ours = {t.native_id for t in threading.enumerate()}
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        if int(tid) in ours:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:                  # the thread ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def codec_floor(codec, x: torch.Tensor, ranges, repeats: int) -> dict:
    """Process CPU ms of the codec's work on x (per pipeline chunk as the call does it):
    norms + RHT, quantize + pack, decode + inverse RHT; each part alone, `repeats` times."""
    parts = {"norms_rht": 0.0, "quantize_pack": 0.0, "decode_inverse_rht": 0.0}
    out = torch.empty_like(x)
    # The error buffers live across calls, as a worker's error feedback does: a fresh
    # zeroed buffer per pass would add its page faults (about a third more) to the floor.
    errors = [torch.zeros(codec.padded_length(hi - lo), dtype=torch.float32, device=x.device)
              for lo, hi in ranges]
    for rep in range(repeats + 1):          # the first pass warms the buffers, untimed
        if rep == 1:
            parts = dict.fromkeys(parts, 0.0)
        for k, (lo, hi) in enumerate(ranges):
            error = errors[k]
            t0 = time.process_time()
            rotated, norms = codec.rotate_and_norms(x[lo:hi], add=error)
            t1 = time.process_time()
            packed = codec.quantize(rotated, norms, worker=0, round=0, tensor=k,
                                    error_out=error)
            t2 = time.process_time()
            sums = codec.lookup(packed)
            t3 = time.process_time()
            codec.decode(sums, 1, norms, hi - lo, out=out[lo:hi])
            if x.is_cuda:
                torch.cuda.synchronize()        # the GPU's work is done before the clock
            t4 = time.process_time()
            parts["norms_rht"] += t1 - t0
            parts["quantize_pack"] += t2 - t1
            parts["decode_inverse_rht"] += t4 - t3
    ms = {name: 1e3 * s / repeats for name, s in parts.items()}
    ms["floor"] = sum(ms.values())
    return ms


def _service(address, pool: int, vpp: int):
    member = Member(worker=0, port=0, mac="02:00:00:00:01:01", ip=address[0],
                    udp_port=address[1])
    config = SwitchConfig(ip="127.0.0.1", jobs=(Job.from_thc(1, pool, [member],
                                                             values_per_packet=vpp),))
    return serve(config.validate(max_values=vpp), "127.0.0.1", 0, process=True)


def measure_path(use_native: bool, codec, x, *, calls: int, pool: int, vpp: int,
                 moderation: float = 0.0) -> dict:
    """CPU and wall ms per call of `calls` allreduces of x on one data path."""
    local = ("127.0.0.1", free_port())
    svc = _service(local, pool, vpp)
    transport = AggregatorTransport(svc.address, job=1, worker=0, expected=1, pool_size=pool,
                                    values_per_packet=vpp, local=local, native=use_native,
                                    moderation=moderation)
    try:
        allreduce = THCAllreduce(codec, AggregatorExchange(transport, codec))
        for _ in range(WARMUP_CALLS):
            allreduce(x)
        meter = DatagramCpu()
        retx, recvs = transport.stats.retransmissions, transport.stats.recv_calls
        with meter.installed():
            cpu0, wall0, foreign0 = time.process_time(), time.perf_counter(), _foreign_thread_cpu()
            for _ in range(calls):
                allreduce(x)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            foreign = _foreign_thread_cpu() - foreign0
        return {"native": use_native, "cpu_ms": 1e3 * cpu / calls, "wall_ms": 1e3 * wall / calls,
                "datagram_ms": 1e3 * meter.seconds / calls,
                "foreign_threads_ms": 1e3 * foreign / calls,
                "retransmissions": transport.stats.retransmissions - retx,
                "moderation_us": 1e6 * moderation if use_native else None,
                "recv_calls": (transport.stats.recv_calls - recvs) / calls,
                "pipeline_chunks": allreduce.chunk_ranges(x.numel())}
    finally:
        transport.close()
        svc.stop()


def run(mb: float = 16, calls: int = 10, vpp: int = 8192, pool: int = 64,
        moderations_us=(0.0,), device: str = "cpu") -> dict:
    d = int(mb * (1 << 20)) // 4
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(d).astype(np.float32))
    x = x.to(device)
    # The codec the in-network hook gives a worker (thc_hook_state with an aggregator).
    codec = thc.THCCodec(bits=4, granularity=30, p=1 / 32, seed=0,
                         partition_size=INNETWORK_PARTITION_SIZE)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    paths = [(True, us) for us in moderations_us] if native.available() else []
    results = {"floor": None, "paths": []}
    try:
        for use_native, us in paths + [(False, 0.0)]:
            results["paths"].append(measure_path(use_native, codec, x, calls=calls, pool=pool,
                                                 vpp=vpp, moderation=us * 1e-6))
    finally:
        if own_group:
            dist.destroy_process_group()
    # The codec's work on the call's own pipeline chunks, with as many Numba threads as
    # the exchange thread gives it.
    threads = numba.get_num_threads()
    floor_threads = codec_threads(threads)
    numba.set_num_threads(floor_threads)
    try:
        floor = codec_floor(codec, x, results["paths"][0]["pipeline_chunks"],
                            repeats=max(3, calls // 2))
    finally:
        numba.set_num_threads(threads)
    for path in results["paths"]:
        path["codec_ms"] = dict(floor)
        path["rest_ms"] = path["cpu_ms"] - floor["floor"] - path["datagram_ms"]
        path["over_floor"] = path["cpu_ms"] / floor["floor"]
    results["floor"] = floor
    results["config"] = {"mb": mb, "values": d, "calls": calls, "values_per_packet": vpp,
                         "pool": pool, "native_available": native.available(),
                         "native_reason": native.reason(), "cpus": os.cpu_count(),
                         "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
                         "codec_threads": floor_threads,
                         "device": (torch.cuda.get_device_name(x.device) if x.is_cuda
                                    else "cpu")}
    return results


def _path_name(p: dict) -> str:
    if not p["native"]:
        return "python"
    return f"native/{p['moderation_us']:.0f}" if p["moderation_us"] else "native"


def table(results: dict) -> str:
    floor = results["floor"]
    lines = [f"{'data path':<10}{'cpu ms':>9}{'norms+RHT':>11}{'quant+pack':>12}"
             f"{'datagrams':>11}{'decode+iRHT':>13}{'rest':>8}{'x floor':>9}{'wall ms':>9}"
             f"{'recvs':>7}"]
    for p in results["paths"]:
        lines.append(f"{_path_name(p):<10}{p['cpu_ms']:>9.1f}"
                     f"{floor['norms_rht']:>11.1f}{floor['quantize_pack']:>12.1f}"
                     f"{p['datagram_ms']:>11.1f}{floor['decode_inverse_rht']:>13.1f}"
                     f"{p['rest_ms']:>8.1f}{p['over_floor']:>9.2f}{p['wall_ms']:>9.1f}"
                     f"{p['recv_calls']:>7.0f}")
    lines.append(f"codec floor (compress + decompress, {results['config']['codec_threads']} "
                 f"Numba threads as the call): {floor['floor']:.1f} ms; of the rest, "
                 "threads Python did not start (OpenMP pools, gloo): " +
                 ", ".join(f"{_path_name(p)} {p['foreign_threads_ms']:.1f} ms"
                           for p in results["paths"]))
    lines.append("recvs: receive syscalls per call (the native loop wakes once per recvmmsg); "
                 "native/N: RESULTs gather N us while half the window is in flight")
    if not results["config"]["native_available"]:
        lines.append(f"native data path unavailable: {results['config']['native_reason']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=16, help="tensor size in MB of float32")
    ap.add_argument("--calls", type=int, default=10, help="measured calls per data path")
    ap.add_argument("--values-per-packet", type=int, default=8192)
    ap.add_argument("--pool", type=int, default=64, help="the job's slot pool")
    ap.add_argument("--moderation-us", default=f"0,{RESULT_MODERATION_S * 1e6:g}",
                    help="the native loop's RESULT moderation to measure, comma-separated "
                         "microseconds (one native run each)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the tensor lives and the codec runs")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU on this machine")
    moderations = sorted({float(v) for v in args.moderation_us.split(",") if v.strip()})
    if args.mb <= 0 or args.calls < 1:
        ap.error("--mb must be positive and --calls at least 1")
    results = run(args.mb, args.calls, args.values_per_packet, args.pool, moderations,
                  args.device)
    print(f"one worker, {args.mb:g} MB per call on {results['config']['device']}, "
          f"{args.calls} calls, reference aggregator (UDP service, child process) on "
          "loopback; CPU ms per call")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
