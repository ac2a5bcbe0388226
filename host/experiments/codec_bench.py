"""THC codec benchmarks.

    python -m host.experiments.codec_bench nmse  [--json F] [--plot P] [--log2d 16] [--reps 3]
    python -m host.experiments.codec_bench speed [--json F] [--log2d 24] [--reps 5]

nmse measures the codec's NMSE (single worker, identical copies, bit sweep,
baselines) next to the analytic/expected values, and saves a plot. speed measures compress
(norms + RHT + quantize) and decompress (decode + inverse RHT) throughput in GB/s of float32
input for the Numba CPU kernels and a plain torch implementation of the same algorithm, in
the same run, with a memory copy as the bandwidth bound (CUDA columns when a GPU exists);
then our RHT against fht-cpu (FFHT's SIMD FWHT; the `dev` extra) on the same floats, and
the per-call cost of error feedback in the gradient domain (two inverse RHTs) against the
rotated domain (one).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from tqdm import tqdm

from thc import baselines as B
from thc import rng
from thc.codec import ErrorFeedback, THCCodec
from thc.cpu_kernels import aligned_empty
from thc.tables import expected_nmse, optimal_table
from thc.torch_reference import TorchTHC

DIGEST_SWEEP = {(2, 3): 0.081, (2, 8): 0.063, (3, 7): 0.0149, (3, 10): 0.0122, (3, 20): 0.0105,
                (4, 15): 0.0034, (4, 20): 0.0024, (4, 30): 0.0026, (4, 51): 0.0023}
PLOT_SWEEP = {2: (3, 5, 8, 12), 3: (7, 10, 15, 20, 30), 4: (15, 20, 30, 40, 51)}


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "numba": numba.__version__, "numba_threads": numba.get_num_threads(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "numpy": np.__version__, "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_table(title, headers, rows):
    print(f"\n{title}")
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(v).ljust(w) for v, w in zip(r, widths)))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


# ---- nmse -------------------------------------------------------------------------------
def _mean_nmse(comp, grads_fn, reps, truth_fn=None):
    vals = []
    for r in range(reps):
        grads = grads_fn(r)
        truth = truth_fn(grads) if truth_fn else np.mean(grads, axis=0)
        vals.append(B.nmse(comp.aggregate(grads, round=r), truth))
        comp.reset()
    return float(np.mean(vals))


class _CodecCompressor(B.Compressor):
    """THCCodec (the 4-bit fast path, 8-bit lanes) behind the baseline interface."""

    def __init__(self, codec):
        self.codec = codec
        self.name = "THCCodec b=4 g=30 (Numba)"

    def aggregate(self, grads, round=0):
        return self.codec.simulate_allreduce(grads, round=round)

    def bits_up(self, n):
        return 4.0

    def bits_down(self, n):
        return 8.0


def run_nmse(log2d=16, reps=3, plot=None):
    d = 1 << log2d
    rs = np.random.default_rng(0)
    gauss = [rs.standard_normal(d).astype(np.float32) for _ in range(max(reps, 4) * 4)]
    logn = [rs.lognormal(size=d).astype(np.float32) for _ in range(max(reps, 4) * 4)]
    results = {"d": d, "reps": reps}
    progress = tqdm(total=4, desc="nmse", file=sys.stderr)

    # 1+2: identical copies of one Gaussian vector, against 0.01306/n + 0.00727
    table = optimal_table(4, 30, 1 / 32)
    rows = []
    for n in (1, 2, 4, 8, 10, 64):
        comp = (_CodecCompressor(THCCodec(symmetric=False, partition_size=d)) if n <= 8 else
                B.THCCompressor(4, 30, 1 / 32, partition_size=d))
        got = _mean_nmse(comp, lambda r: [gauss[r]] * n, reps)
        rows.append([n, comp.name, got, expected_nmse(table, 1 / 32, n)])
    print_table(f"THC b=4 g=30 p=1/32, n identical Gaussian copies, d=2^{log2d}",
                ["n", "implementation", "NMSE", "analytic 0.01306/n+0.00727"], rows)
    results["copies"] = [dict(zip(["n", "impl", "nmse", "analytic"], r)) for r in rows]
    indep = _mean_nmse(B.THCCompressor(4, 30, 1 / 32, partition_size=d),
                       lambda r: gauss[4 * r:4 * r + 4], reps)
    print(f"4 independent Gaussian workers, NMSE vs true mean: {indep:.4f} (expect ~0.0203)")
    results["independent_4"] = indep
    progress.update()

    # 3: bit/granularity sweep, lognormal copied to 10 workers, p = 1/1024 (App. D.4)
    rows, curves = [], {}
    for bits, gs in PLOT_SWEEP.items():
        for g in sorted(set(gs) | {gg for (bb, gg) in DIGEST_SWEEP if bb == bits}):
            comp = B.THCCompressor(bits, g, 1 / 1024, partition_size=d)
            got = _mean_nmse(comp, lambda r: [logn[r]] * 10, reps)
            curves.setdefault(bits, []).append((g, got))
            if (bits, g) in DIGEST_SWEEP:
                rows.append([bits, g, got, DIGEST_SWEEP[(bits, g)]])
    print_table("Lognormal copied to 10 workers, p=1/1024 (App. D.4 style)",
                ["b", "g", "NMSE", "digest"], rows)
    results["sweep"] = [dict(zip(["bits", "g", "nmse", "digest"], r)) for r in rows]
    progress.update()

    # 4: baselines, 4 workers with independent gradients
    rows = []
    for dist, data in (("gaussian", gauss), ("lognormal", logn)):
        for comp in B.default_compressors(partition_size=d):
            got = _mean_nmse(comp, lambda r: data[4 * r:4 * r + 4], reps)
            rows.append([dist, comp.name, got, comp.bits_up(4), comp.bits_down(4)])
    print_table("Baselines, 4 workers, independent gradients (NMSE vs true mean)",
                ["input", "compressor", "NMSE", "bits up", "bits down"], rows)
    results["baselines"] = [dict(zip(["input", "compressor", "nmse", "bits_up", "bits_down"], r))
                            for r in rows]
    progress.update()
    if plot:
        _plot_nmse(curves, rows, plot)
        print(f"\nplot saved to {plot}")
        results["plot"] = str(plot)
    progress.update()
    progress.close()
    return results


def _plot_nmse(curves, baseline_rows, path):
    # only `nmse` plots: `speed` starts without matplotlib (about a second to import)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for bits, pts in sorted(curves.items()):
        g, v = zip(*sorted(pts))
        left.plot(g, v, marker="o", label=f"b={bits}")
    left.set_yscale("log")
    left.set_xlabel("granularity g")
    left.set_ylabel("NMSE")
    left.set_title("THC, lognormal copied to 10 workers, p=1/1024")
    left.legend()
    logn = [r for r in baseline_rows if r[0] == "lognormal" and r[2] > 1e-9]   # fp32 is ~0
    right.barh([r[1] for r in logn], [r[2] for r in logn], color="tab:blue")
    right.set_xscale("log")
    right.set_xlabel("NMSE (log)")
    right.set_title("4 workers, lognormal gradients")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- speed ------------------------------------------------------------------------------
def _median_time(fn, reps, sync=None):
    fn()
    if sync:
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_speed(log2d=24, reps=5):
    d = 1 << log2d
    gbytes = 4 * d / 1e9
    rs = np.random.default_rng(0)
    x = rs.standard_normal(d).astype(np.float32)
    codec = THCCodec(backend="cpu")
    ref = TorchTHC(codec)
    xt = torch.from_numpy(x)
    norms = codec.partition_norms(x)
    rotated = codec.rotate(x)
    packed = codec.quantize(rotated, norms, worker=0, round=0, tensor=0)
    sums = codec.lookup(packed).astype(np.int32)
    norms_t, rot_t, packed_t = torch.from_numpy(norms), torch.from_numpy(rotated), \
        torch.from_numpy(packed)
    sums_t = torch.from_numpy(sums)
    dst = np.empty_like(x)

    def compress_cpu():
        n = codec.partition_norms(x)
        codec.quantize(codec.rotate(x), n, worker=0, round=0, tensor=0)

    def compress_torch():
        n = ref.partition_norms(xt)
        ref.quantize(ref.rotate(xt), n)

    stages = {
        "compress (norms+RHT+quantize)": (compress_cpu, compress_torch),
        "decompress (decode+inverse RHT)": (lambda: codec.decode(sums, 1, norms, d),
                                            lambda: ref.decode(sums_t, 1, norms_t, d)),
        "RHT": (lambda: codec.rotate(x), lambda: ref.rotate(xt)),
        "quantize+pack": (lambda: codec.quantize(rotated, norms, worker=0, round=0, tensor=0),
                          lambda: ref.quantize(rot_t, norms_t)),
        "table lookup": (lambda: codec.lookup(packed), lambda: ref.lookup(packed_t)),
    }
    copy_s = _median_time(lambda: np.copyto(dst, x), reps)
    rows, out = [], {"d": d, "machine": machine(), "copy_gbs": gbytes / copy_s, "stages": []}
    for name, (cpu_fn, torch_fn) in tqdm(stages.items(), desc="speed", file=sys.stderr):
        t_cpu = _median_time(cpu_fn, reps)
        t_torch = _median_time(torch_fn, max(2, reps // 2))
        rows.append([name, gbytes / t_cpu, gbytes / t_torch, t_torch / t_cpu,
                     t_cpu * 1e3, t_torch * 1e3])
        out["stages"].append(dict(zip(["stage", "numba_gbs", "torch_gbs", "speedup",
                                       "numba_ms", "torch_ms"], rows[-1])))
    rht = next(s for s in out["stages"] if s["stage"] == "RHT")
    out["rht_vs_copy"] = rht["numba_ms"] / 1e3 / copy_s
    print_table(f"THC codec speed, 2^{log2d} float32 ({gbytes * 1e3:.0f} MB), median of {reps}"
                f" (GB/s of float32 input)",
                ["stage", "Numba CPU GB/s", "torch CPU GB/s", "Numba/torch", "Numba ms",
                 "torch ms"], rows)
    print(f"memory copy (bandwidth bound): {gbytes / copy_s:.2f} GB/s ({copy_s * 1e3:.1f} ms)")
    print(f"RHT time / copy time = {out['rht_vs_copy']:.2f} (one read and one write of "
          f"the data each)")
    out["fht_cpu"] = _speed_vs_fht_cpu(codec, x, max(reps, 7))
    out["error_feedback"] = _speed_error_feedback(codec, x, reps)
    if torch.cuda.is_available():
        out["cuda"] = _speed_cuda(codec, x, norms, reps)
    return out


def _paired_times(fns, reps, setup=None):
    """Median time of each function, and the median over rounds of each one's time over
    the first one's, the functions run in turn every round (drift and load bursts hit
    them alike)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    first = next(iter(times.values()))
    return {name: (statistics.median(t), statistics.median(a / b for a, b in zip(t, first)))
            for name, t in times.items()}


def _speed_vs_fht_cpu(codec, x, reps):
    """Our forward RHT (signs, padding, transform, scale) against fht-cpu's FWHT (in place,
    unnormalized, float32, along rows) on the same 2^k floats cut into the same partitions,
    with the same thread count (one with --threads 1)."""
    try:
        import fht_cpu          # optional: the `dev` extra's yardstick, not a dependency
    except ImportError:
        print("\nRHT vs fht-cpu: skipped, fht-cpu is not installed (it is in the dev extra: "
              "pip install -e '.[dev]', or pip install fht-cpu)")
        return None
    d, n = len(x), min(codec.partition_size, len(x))
    threads = numba.get_num_threads()
    src = aligned_empty(d)
    src[:] = x
    buf, out, back = aligned_empty(d), aligned_empty(d), aligned_empty(d)
    rows = buf.reshape(-1, n)
    # like for like: fht-cpu computes H v unnormalized; our RHT is H (D x) / sqrt(n)
    signed = src * rng.signs_np(codec.sign_key, np.arange(d))
    want = fht_cpu.fht(signed.reshape(-1, n), num_threads=threads).reshape(-1)
    want /= np.float32(np.sqrt(n))
    ours = codec.rotate(src)
    err = float(np.max(np.abs(ours - want)) / np.max(np.abs(want)))
    fns = {"fht-cpu FWHT, in place (64-byte aligned)":
           lambda: fht_cpu.fht(rows, num_threads=threads),
           "our RHT into a buffer: rotate(x, out=buf)": lambda: codec.rotate(src, out=out),
           "our RHT, new output: rotate(x)": lambda: codec.rotate(src),
           "our inverse RHT into a buffer": lambda: codec.inverse_rotate(ours, d, out=back)}
    timed = _paired_times(fns, reps, setup=lambda: np.copyto(buf, src))
    gbytes = 4 * d / 1e9
    table = [[name, t * 1e3, gbytes / t, ratio] for name, (t, ratio) in timed.items()]
    print_table(f"RHT vs fht-cpu {getattr(fht_cpu, '__version__', '')}: 2^{d.bit_length() - 1}"
                f" float32 in partitions of 2^{n.bit_length() - 1}, {threads} thread(s), "
                f"median of {reps} rounds, run in turn",
                ["transform", "ms", "GB/s", "time / fht-cpu"], table)
    print(f"our RHT = fht-cpu(signs * x) / sqrt({n}) to {err:.1e} relative (max abs)")
    return {"threads": threads, "partition": n, "max_rel_diff": err,
            "rows": [dict(zip(["transform", "ms", "gbs", "ratio"], r)) for r in table],
            "rht_over_fht": timed["our RHT into a buffer: rotate(x, out=buf)"][1]}


def _speed_error_feedback(codec, x, reps):
    """One worker's codec work per allreduce call (no network), error feedback in each
    domain, as host/allreduce.py runs it. 'before exchange' is the work that must finish
    before the max-norm exchange can start; the gradient domain's RHT then runs during
    the exchange, the rotated domain has nothing left to overlap it with."""
    d = len(x)
    grad_ef, rot_ef = ErrorFeedback(), ErrorFeedback(rotated=True)
    state = {}

    def gradient_before():
        xx = grad_ef.compensate("g", x)
        state["g"] = (xx, codec.partition_norms(xx))

    def gradient_rest():
        xx, norms = state["g"]
        packed = codec.quantize(codec.rotate(xx), norms, worker=0, round=0, tensor=0)
        codec.decode(codec.lookup(packed), 1, norms, d)
        own = codec.inverse_rotate(codec.dequantize(packed, norms), d)
        grad_ef.update("g", xx, own)

    def rotated_before():
        state["r"] = rot_ef.rotate(codec, "r", x)

    def rotated_rest():
        x_rot, norms = state["r"]
        packed = rot_ef.quantize(codec, "r", x_rot, norms, worker=0, round=0, tensor=0)
        codec.decode(codec.lookup(packed), 1, norms, d)

    for fn in (gradient_before, gradient_rest, rotated_before, rotated_rest):
        fn()
    times = {k: [] for k in ("gb", "gr", "rb", "rr")}
    for _ in range(reps):
        for k, fn in (("gb", gradient_before), ("gr", gradient_rest), ("rb", rotated_before),
                      ("rr", rotated_rest)):
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rot_ms = _median_time(lambda: codec.rotate(x), reps) * 1e3
    rows = [["gradient domain (2 inverse RHTs)", med["gb"], rot_ms, med["gb"] + med["gr"]],
            ["rotated domain (1 inverse RHT)", med["rb"], 0.0, med["rb"] + med["rr"]]]
    print_table(f"Error feedback, codec work per call on 2^{d.bit_length() - 1} floats "
                f"(median of {reps}; exchange not included)",
                ["variant", "ms before norm exchange", "ms hidden behind it (RHT)",
                 "ms total"], rows)
    saved = rows[0][3] - rows[1][3]
    print(f"rotated domain: {saved:.1f} ms less work per call; the norm exchange now waits "
          f"for the RHT ({rows[1][1]:.1f} ms instead of {rows[0][1]:.1f} ms), so it pays off "
          f"whenever that exchange takes less than the {saved:.1f} ms saved")
    return [dict(zip(["variant", "before_exchange_ms", "overlapped_ms", "total_ms"], r))
            for r in rows]


def _speed_cuda(cpu_codec, x, norms, reps):
    """The same stages on the GPU: Numba CUDA kernels (thc/cuda_kernels.py) against the same
    algorithm in torch CUDA, and a worker's whole codec round per call with its host copies
    (the packed indices to the host for the network, the aggregated sums back), against a
    device-to-device copy of the input as the bandwidth bound. Medians of at least 20 runs,
    synchronized; the GPU's first run of each (kernel compilation) is not timed."""
    d = len(x)
    gbytes = 4 * d / 1e9
    reps = max(reps, 20)
    # the CPU codec's settings on the CUDA backend (the CPU one refuses CUDA tensors)
    codec = THCCodec(backend="cuda", partition_size=cpu_codec.partition_size,
                     seed=cpu_codec.seed)
    ref = TorchTHC(codec)
    xc = torch.from_numpy(x).cuda()
    norms_c = torch.from_numpy(norms).cuda()
    rot_c = codec.rotate(xc)
    packed_c = codec.quantize(rot_c, norms, worker=0, round=0, tensor=0)
    sums_c = codec.lookup(packed_c).to(torch.int32)
    sums_host = sums_c.to(torch.uint8).cpu().pin_memory()    # as the transport delivers them
    packed_host = torch.empty(packed_c.shape, dtype=packed_c.dtype).pin_memory()
    sync = torch.cuda.synchronize

    def worker_round():
        n = codec.partition_norms(xc)
        packed_host.copy_(codec.quantize(codec.rotate(xc), n, worker=0, round=0, tensor=0))
        codec.decode(sums_host.cuda(non_blocking=True), 1, n, d)

    cases = {
        "compress (norms+RHT+quantize)": (
            lambda: codec.quantize(codec.rotate(xc), codec.partition_norms(xc),
                                   worker=0, round=0, tensor=0),
            lambda: ref.quantize(ref.rotate(xc), ref.partition_norms(xc))),
        "decompress (decode+inverse RHT)": (lambda: codec.decode(sums_c, 1, norms, d),
                                            lambda: ref.decode(sums_c, 1, norms_c, d)),
        "RHT": (lambda: codec.rotate(xc), lambda: ref.rotate(xc)),
        "quantize+pack": (lambda: codec.quantize(rot_c, norms, worker=0, round=0, tensor=0),
                          lambda: ref.quantize(rot_c, norms_c)),
        "worker round (+host copies)": (worker_round, None),
    }
    copy_s = _median_time(lambda: xc.clone(), reps, sync)
    rows = []
    for name, (numba_fn, torch_fn) in cases.items():
        tn = _median_time(numba_fn, reps, sync)
        tt = _median_time(torch_fn, reps, sync) if torch_fn else None
        rows.append([name, gbytes / tn, gbytes / tt if tt else None,
                     tt / tn if tt else None, tn * 1e3, tt * 1e3 if tt else None])
    print_table(f"CUDA, {torch.cuda.get_device_name(0)} (GB/s of float32 input)",
                ["stage", "Numba CUDA GB/s", "torch CUDA GB/s", "Numba/torch", "Numba ms",
                 "torch ms"], rows)
    print(f"device copy: {gbytes / copy_s:.1f} GB/s of input ({copy_s * 1e3:.3f} ms; read "
          f"and write: {2 * gbytes / copy_s:.0f} GB/s)")
    return {"device": torch.cuda.get_device_name(0), "copy_gbs": gbytes / copy_s,
            "copy_ms": copy_s * 1e3, "worker_round_profile": _profile_cuda(worker_round),
            "stages": [dict(zip(["stage", "numba_gbs", "torch_gbs", "speedup", "numba_ms",
                                 "torch_ms"], r)) for r in rows]}


def _profile_cuda(fn, rounds=5):
    """Where a GPU worker round's time goes: torch's profiler (CUPTI sees the Numba kernels
    too) over a few rounds; the GPU's busy time per round against the round's wall time,
    and the kernels and copies by device time."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / rounds
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        # the kernels and copies themselves (device_type CUDA), not the CPU ops that
        # launched them, which carry the same time again
        if device_us > 0 and str(getattr(e, "device_type", "")).endswith("CUDA"):
            rows.append([e.key[:60], e.count / rounds, device_us / rounds / 1e3])
    rows.sort(key=lambda r: -r[2])
    busy_ms = sum(r[2] for r in rows)
    print(f"\nGPU worker round, profiled: {len(rows)} kernels or copies seen")
    if rows:
        print_table(f"GPU worker round, profiled ({rounds} rounds; wall {wall_ms:.3f} ms per "
                    f"round under the profiler, GPU busy {busy_ms:.3f} ms)",
                    ["kernel or copy", "per round", "device ms per round"], rows[:14])
    return {"wall_ms": wall_ms, "gpu_busy_ms": busy_ms,
            "items": [dict(zip(["name", "per_round", "device_ms"], r)) for r in rows]}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m host.experiments.codec_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p_nmse = sub.add_parser("nmse", help="accuracy against the digest's values")
    p_nmse.add_argument("--json", type=Path)
    p_nmse.add_argument("--plot", type=Path, default=Path("build/bench/thc_nmse.png"))
    p_nmse.add_argument("--log2d", type=int, default=16)
    p_nmse.add_argument("--reps", type=int, default=3)
    p_speed = sub.add_parser("speed", help="compress/decompress throughput")
    p_speed.add_argument("--json", type=Path)
    p_speed.add_argument("--log2d", type=int, default=24)
    p_speed.add_argument("--reps", type=int, default=5)
    p_speed.add_argument("--threads", type=int, default=None,
                         help="threads for Numba and torch (default: their own defaults); "
                              "1 is the fair choice on an oversubscribed machine")
    args = parser.parse_args(argv)
    if args.what == "nmse":
        result = run_nmse(args.log2d, args.reps, args.plot)
        result["machine"] = machine()
    else:
        if args.threads:
            numba.set_num_threads(args.threads)
            torch.set_num_threads(args.threads)
        result = run_speed(args.log2d, args.reps)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"JSON written to {args.json}")


if __name__ == "__main__":
    main()
