"""DLCP evaluation: a PS incast of ResNet-50 gradient tensors through a DLCP bottleneck.

Topology (root; host.netlab.topology.Topology, "routed" layout, built and torn down here)::

    workers (10.77.1.2) --veth-- [root ns: reference switch model] --veth-- PS (10.77.9.2)

The root namespace runs ``host.dlcp.switchbox`` on the veths' root ends: the reference
switch's forwarding and DLCP egress stage (docs/protocol.md §6) on AF_PACKET sockets,
with the PS-facing port rate-limited (the incast bottleneck). This kernel has no prio/RED qdiscs, so the model
is the switch. Every scheme crosses the same switch:

* ``dlcp``: the bounded-loss transport, DlcpPolicy marks (band DSCP + ECT/Not-ECT), one
  ANNOUNCE per iteration and a STATUS per band as soon as that band has passed (its
  END_MARK), the rate controller carried across tensors and iterations (with its ECN
  echo), deficit-only resends.
* ``udp_timer``: the same UDP data path with p = 0, no marks (DSCP 0), no rate control,
  and timeout-driven recovery (wait ``rto`` for STATUS(done), then ask for the missing).
* ``tcp``: kernel TCP (one connection per worker, DSCP 0), route ``rto_min`` = ``rto``;
  one tensor after the other, each acknowledged by the PS.

Background: a constant-rate UDP flow (DSCP 0 -> queue 0) from the worker namespace to the
PS. DLCP uses 6 data bands by default (queues 6..1) so that best-effort traffic has queue 0
to itself; with all 7 bands the back layers would share queue 0 with the background.
Each iteration every worker sends all 54 ResNet-50 layer tensors (sizes scaled down by
``--scale``) back to front; iterations start on a shared clock, so the workers' tensors
meet at the bottleneck (incast). A tensor's completion time runs from its first byte
sent to the receiver having it (TCP: to the PS's ack; DLCP: to the receiver reaching the
tensor's bound); push time is the wall time of a worker's whole iteration.

Usage: ``python -m host.experiments.dlcp.evaluate --json results.json`` (plots go to docs/img/).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dataplane.wire import L2L4_LEN
from host.dlcp.marking import DlcpPolicy
from host.dlcp.transport import (VALUES_PER_SEGMENT, DlcpReceiver, DlcpSender, LossBounds,
                                 TensorToSend, segment_count)
from host.netlab.topology import Topology

WORKER_IP, PS_IP = "10.77.1.2", "10.77.9.2"   # the routed layout's sender and receiver
DATA_PORT, CTRL_PORT, BG_PORT = 41000, 41001, 41002
FRAME_BYTES = 1400 + 16 + L2L4_LEN
SCHEMES = ("dlcp", "udp_timer", "tcp")


# --------------------------------------------------------------------------- workload
def resnet50_layer_sizes() -> list[int]:
    """Parameters per ResNet-50 layer (conv weight + its BN scale/shift; fc weight + bias).

    Derived from the architecture: a 7x7/64 stem, then bottleneck stages of
    (blocks, width) = (3, 64), (4, 128), (6, 256), (3, 512), each block 1x1 -> 3x3 -> 1x1
    (expansion 4), the first block of each stage with a 1x1 projection, then fc 2048->1000.
    54 layers, 25,557,032 parameters in all.
    """
    sizes = [7 * 7 * 3 * 64 + 2 * 64]
    in_ch = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        for b in range(blocks):
            out_ch = 4 * width
            sizes += [in_ch * width + 2 * width, 9 * width * width + 2 * width,
                      width * out_ch + 2 * out_ch]
            if b == 0:
                sizes.append(in_ch * out_ch + 2 * out_ch)
            in_ch = out_ch
    sizes.append(2048 * 1000 + 1000)
    return sizes


def scaled_sizes(scale: int) -> list[int]:
    return [max(1, s // scale) for s in resnet50_layer_sizes()]


def layer_gradient(worker: int, iteration: int, layer: int, size: int) -> np.ndarray:
    """A synthetic gradient: heavy-tailed, with per-segment scale so importance varies."""
    rng = np.random.default_rng([worker, iteration, layer])
    scale = np.repeat(rng.lognormal(0.0, 1.0, -(-size // 350)), 350)[:size]
    return (rng.standard_normal(size) * scale * 1e-3).astype(np.float32)


def tensor_id(worker: int, iteration: int, layer: int) -> int:
    return (worker << 24) | (iteration << 8) | layer


# --------------------------------------------------------------------------- topology
def topology(rto_ms: float) -> Topology:
    """The workers' namespace and the PS's, routed through the switch model in the root
    namespace. Plain frames with full checksums (the model sees single frames), and TCP's
    rto_min on the hosts' route set to the schemes' rto."""
    tb = Topology(2, layout="routed", offloads=False, rto_min_ms=rto_ms)
    if (tb.senders[0].ip, tb.receiver.ip) != (WORKER_IP, PS_IP):
        raise RuntimeError(f"the routed layout's addresses {tb.senders[0].ip}, "
                           f"{tb.receiver.ip} are not WORKER_IP, PS_IP: update them")
    return tb


def in_ns(tb: Topology, host: int, *args: str, **kw) -> subprocess.Popen:
    """python -m args in host `host`'s namespace."""
    return tb.popen(host, [sys.executable, "-m", *args], **kw)


# --------------------------------------------------------------------------- roles
def run_ps(args) -> None:
    """The parameter server: receives every worker's tensors, writes what arrived."""
    sizes = scaled_sizes(args.scale)
    bg = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bg.bind((PS_IP, BG_PORT))
    bg.settimeout(0.2)
    bg_count = [0]
    threading.Thread(target=_count_background, args=(bg, bg_count), daemon=True).start()
    out = {"tensors": []}
    if args.scheme == "tcp":
        out["tensors"] = _tcp_sink(args, sizes)
    else:
        with DlcpReceiver(PS_IP, DATA_PORT, CTRL_PORT, max_values=max(sizes),
                          report_period_s=args.report_ms / 1000,
                          stop_drain_s=args.drain_ms / 1000) as rx:
            Path(args.ready).touch()
            for it in range(args.iterations):
                for w in range(args.workers):
                    for layer in range(len(sizes)):
                        res = rx.wait(tensor_id(w, it, layer), timeout=120)
                        out["tensors"].append([w, it, layer, res.delivered_fraction,
                                               res.received_at_fin / res.received.size,
                                               res.retx_requests, res.duplicates, res.fin_time])
            time.sleep(0.5)                # late datagrams still count in tos_counts
            out["tos_counts"] = {str(k): v for k, v in rx.tos_counts.items()}
            out["early_drops"] = rx.early_drops
            out["receiver"] = {"data_packets": rx.data_packets, "late_packets": rx.late_packets,
                               "malformed": rx.malformed, "end_marks": rx.end_marks}
    out["background_received"] = bg_count[0]
    Path(args.out).write_text(json.dumps(out))


def _count_background(sock, counter) -> None:
    while True:
        try:
            sock.recv(65536)
            counter[0] += 1
        except socket.timeout:
            continue
        except OSError:
            return


def _tcp_sink(args, sizes) -> list:
    srv = socket.create_server((PS_IP, CTRL_PORT), backlog=64)
    Path(args.ready).touch()
    got = []

    def serve(conn):
        with conn:
            while True:
                hdr = _recv_exact(conn, 8)
                if hdr is None:
                    return
                tid, nbytes = struct.unpack("!II", hdr)
                if _recv_exact(conn, nbytes) is None:
                    return
                conn.sendall(b"\x01")
                got.append([tid >> 24, (tid >> 8) & 0xFFFF, tid & 0xFF, 1.0, 1.0])
    threads = []
    for _ in range(args.workers):
        conn, _ = srv.accept()
        t = threading.Thread(target=serve, args=(conn,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return got


def _recv_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def run_worker(args) -> None:
    """One worker: every iteration, all layers back to front (backprop order).

    TCP sends one tensor after the other, each answered by a 1-byte ack. The UDP schemes
    hand the whole iteration to the transport (one ANNOUNCE, the data of every layer back
    to back, a STATUS per band that lost more than its bound); a tensor's completion is
    then measured from its first datagram to the receiver's time of reaching the bound
    (one monotonic clock: the namespaces share the host's).
    """
    sizes = scaled_sizes(args.scale)
    link_bps = args.rate * FRAME_BYTES * 8           # host links as fast as the bottleneck
    records, iterations, tos_sent = [], [], {}
    if args.scheme == "tcp":
        conn = socket.create_connection((PS_IP, CTRL_PORT), timeout=30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        dlcp = args.scheme == "dlcp"
        sender = DlcpSender((PS_IP, DATA_PORT), (PS_IP, CTRL_PORT), link_bps=link_bps,
                            bounds=LossBounds(args.p, min(args.p, args.p_pull)) if dlcp else LossBounds(0, 0),
                            policy=DlcpPolicy(num_bands=args.bands, seed=args.worker) if dlcp else None,
                            seed=args.worker, rate_control=dlcp,
                            recovery="dlcp" if dlcp else "timer", rto_s=args.rto / 1000,
                            timeout_s=120, reset_on_retx=args.reset_rate_on_retx,
                            rate_delta=args.delta, rate_ai=args.ai,
                            ce_threshold=args.ce_threshold if args.ce_threshold >= 0 else None,
                            retx_extra=args.retx_extra if args.retx_extra >= 0 else None,
                            pace_burst_s=args.pace_burst_ms / 1000)
    for it in range(args.iterations):
        _sleep_until(args.t0 + it * args.period)
        order = list(reversed(range(len(sizes))))     # backprop order: last layer first
        grads = {layer: layer_gradient(args.worker, it, layer, sizes[layer]) for layer in order}
        start = time.monotonic()
        if args.scheme == "tcp":
            for layer in order:
                g, t = grads[layer], time.monotonic()
                conn.sendall(struct.pack("!II", tensor_id(args.worker, it, layer), g.nbytes) + g.tobytes())
                _recv_exact(conn, 1)
                records.append([args.worker, it, layer, time.monotonic() - t, 0, 0])
            iterations.append([args.worker, it, time.monotonic() - start])
            continue
        stats = sender.send_iteration(
            [TensorToSend(tensor_id(args.worker, it, layer), grads[layer], layer) for layer in order],
            num_layers=len(sizes), iteration=it)
        iterations.append([args.worker, it, stats[0].completion_s])
        for layer, st in zip(order, stats):
            records.append([args.worker, it, layer, st.first_sent, st.packets_sent, st.retransmitted])
            for tos, sends in zip(st.tos.tolist(), st.sends.tolist()):
                tos_sent[tos] = tos_sent.get(tos, 0) + sends
    rate_log = [] if args.scheme == "tcp" else sender.rate_log
    Path(args.out).write_text(json.dumps({"records": records, "iterations": iterations,
                                          "rate_log": rate_log,
                                          "tos_sent": {str(k): v for k, v in tos_sent.items()}}))


def run_background(args) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    payload = bytes(1400)
    gap = 1.0 / args.bg_rate
    next_t = time.monotonic()
    sent = 0
    end = time.monotonic() + args.duration
    while time.monotonic() < end:
        sock.sendto(payload, (PS_IP, BG_PORT))
        sent += 1
        next_t += gap
        time.sleep(max(0.0, next_t - time.monotonic()))
    Path(args.out).write_text(json.dumps({"sent": sent}))


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


# --------------------------------------------------------------------------- driver
def run_scheme(scheme: str, args, tmp: Path, tb: Topology) -> dict:
    """One scheme through the switch: returns its workers', PS and switch outputs."""
    common = ["--scheme", scheme, "--scale", str(args.scale), "--workers", str(args.workers),
              "--iterations", str(args.iterations), "--rate", str(args.rate),
              "--p", str(args.p), "--rto", str(args.rto), "--bands", str(args.bands),
              "--report-ms", str(args.report_ms), "--drain-ms", str(args.drain_ms),
              "--delta", str(args.delta), "--ai", str(args.ai), "--retx-extra", str(args.retx_extra),
              "--ce-threshold", str(args.ce_threshold), "--pace-burst-ms", str(args.pace_burst_ms)] + (["--reset-rate-on-retx"] if args.reset_rate_on_retx else [])
    sw_out = tmp / f"{scheme}-switch.json"
    workers_host, ps_host = tb.senders[0], tb.receiver
    switch = tb.popen_switch([sys.executable, "-m", "host.dlcp.switchbox",
                              "--if0", workers_host.switch_if, "--if1", ps_host.switch_if,
                              "--mac", tb.switch_mac,
                              "--route0", f"{workers_host.prefix},{workers_host.mac}",
                              "--route1", f"{ps_host.prefix},{ps_host.mac}",
                              "--rate1", str(args.rate), "--counters", str(sw_out),
                              "--capacity", str(args.capacity),
                              "--threshold", str(args.threshold), "--d", str(args.d)])
    ready = tmp / f"{scheme}-ready"
    ps = in_ns(tb, ps_host.index, "host.experiments.dlcp.evaluate", "--role", "ps", *common,
               "--out", str(tmp / f"{scheme}-ps.json"), "--ready", str(ready))
    _wait_file(ready, 30)
    t0 = time.time() + 1.0
    duration = args.iterations * args.period + 1
    bg = in_ns(tb, workers_host.index, "host.experiments.dlcp.evaluate", "--role", "background", *common,
               "--bg-rate", str(args.bg_fraction * args.rate), "--duration", str(duration),
               "--out", str(tmp / f"{scheme}-bg.json"))
    workers = [in_ns(tb, workers_host.index, "host.experiments.dlcp.evaluate", "--role", "worker", *common,
                     "--worker", str(w), "--t0", str(t0), "--period", str(args.period),
                     "--out", str(tmp / f"{scheme}-w{w}.json")) for w in range(args.workers)]
    try:
        for proc in workers + [ps, bg]:
            if proc.wait(timeout=duration + 180):
                raise RuntimeError(f"{scheme}: {' '.join(proc.args[5:9])} failed (rc {proc.returncode})")
    finally:
        for proc in workers + [ps, bg]:       # a failed run leaves nothing behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        switch.send_signal(signal.SIGTERM)
        switch.wait(timeout=10)
    return {"workers": [json.loads((tmp / f"{scheme}-w{w}.json").read_text())
                        for w in range(args.workers)],
            "ps": json.loads((tmp / f"{scheme}-ps.json").read_text()),
            "background": json.loads((tmp / f"{scheme}-bg.json").read_text()),
            "switch": json.loads(sw_out.read_text())}


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def summarize(scheme: str, raw: dict, args) -> dict:
    recs = np.array([r for w in raw["workers"] for r in w["records"]], dtype=float)
    ps = np.array(raw["ps"]["tensors"], dtype=float)
    if scheme != "tcp":
        # completion = the receiver reaching the bound - the tensor's first datagram
        fin = {(int(w), int(it), int(layer)): t for w, it, layer, *_, t in ps}
        recs[:, 3] = [fin[(int(w), int(it), int(layer))] - first
                      for w, it, layer, first in recs[:, :4]]
    tct = recs[:, 3] * 1e3
    push = np.array([r[2] for w in raw["workers"] for r in w["iterations"]]) * 1e3
    out = {"scheme": scheme, "tensors": len(tct),
           "tct_ms": {"mean": float(tct.mean()), "p50": float(np.percentile(tct, 50)),
                      "p99": float(np.percentile(tct, 99)), "max": float(tct.max())},
           "min_delivered_fraction": float(ps[:, 3].min()),
           "min_fraction_at_fin": float(ps[:, 4].min()),
           "background_sent": raw["background"]["sent"],
           "background_received": raw["ps"]["background_received"],
           "switch": raw["switch"], "tct_all_ms": tct.tolist(),
           "tct_by_band_ms": tct_by_band(recs, args.bands),
           "push_time_ms": {"mean": float(push.mean()), "max": float(push.max())},
           "ideal_iteration_ms": ideal_iteration_ms(args)}
    if scheme != "tcp":
        sent_pkts = recs[:, 4].sum()
        out["packets_sent"] = int(sent_pkts)
        out["early_drops"] = raw["ps"].get("early_drops", 0)
        out["retransmitted"] = int(recs[:, 5].sum())
        out.update(band_losses(raw))
    return out


def ideal_iteration_ms(args) -> float:
    """Every worker's whole iteration through the bottleneck at its full rate (E1's bound)."""
    per_worker = sum(segment_count(s, VALUES_PER_SEGMENT) for s in scaled_sizes(args.scale))
    return 1e3 * args.workers * per_worker / args.rate


def tct_by_band(recs: np.ndarray, bands: int) -> dict:
    """p50/p99 completion per DLCP band of the layer (the same grouping for every scheme)."""
    num_layers = len(resnet50_layer_sizes())
    band = (recs[:, 2].astype(int) * bands) // num_layers
    out = {}
    for b in range(bands):
        t = recs[band == b, 3] * 1e3
        out[str(b)] = {"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99))}
    return out


def band_losses(raw: dict) -> dict:
    """Per-band loss and the important share among sent vs dropped packets (E3)."""
    sent = {}
    for w in raw["workers"]:
        for tos, n in w["tos_sent"].items():
            sent[int(tos)] = sent.get(int(tos), 0) + n
    arrived = {int(t): n for t, n in raw["ps"]["tos_counts"].items()}

    def key(tos):   # (DSCP, important); CE marks came from ECT packets
        return tos >> 2, (tos & 3) != 0
    s, a = {}, {}
    for tos, n in sent.items():
        s[key(tos)] = s.get(key(tos), 0) + n
    for tos, n in arrived.items():
        a[key(tos)] = a.get(key(tos), 0) + n
    bands = {}
    for dscp in sorted({k[0] for k in s}):
        tot = sum(s.get((dscp, imp), 0) for imp in (False, True))
        lost = sum(max(0, s.get((dscp, imp), 0) - a.get((dscp, imp), 0)) for imp in (False, True))
        bands[str(dscp)] = {"sent": tot, "lost": lost, "loss_rate": lost / tot if tot else 0.0}
    sent_imp = sum(n for (d, imp), n in s.items() if imp)
    drop = {imp: sum(max(0, s.get((d, imp), 0) - a.get((d, imp), 0)) for d in {k[0] for k in s})
            for imp in (False, True)}
    total_sent, total_drop = sum(s.values()), drop[False] + drop[True]
    return {"per_band": bands,
            "important_share_sent": sent_imp / total_sent if total_sent else 0.0,
            "important_share_dropped": drop[True] / total_drop if total_drop else 0.0,
            "dropped": total_drop}


def plot(results: dict, args, img_dir: Path) -> list[str]:
    import matplotlib       # only the coordinator plots: the role processes start without it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    img_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for scheme, res in results.items():
        t = np.sort(res["tct_all_ms"])
        ax.plot(t, np.arange(1, len(t) + 1) / len(t), label=scheme)
    ax.axvline(args.rto, color="gray", ls="--", label=f"RTO {args.rto:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("tensor completion time (ms)")
    ax.set_ylabel("CDF")
    ax.set_title(f"ResNet-50 incast, {args.workers} workers (E1)")
    ax.legend()
    fig.tight_layout()
    paths.append(str(img_dir / f"dlcp_tct_cdf{args.img_suffix}.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / max(1, len(results))
    for i, (scheme, res) in enumerate(results.items()):
        bands = sorted(res["tct_by_band_ms"], key=int)
        ax.bar([int(b) + i * width for b in bands], [res["tct_by_band_ms"][b]["p99"] for b in bands],
               width, label=scheme)
    ax.axhline(args.rto, color="gray", ls="--", label=f"RTO {args.rto:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("layer band (0 = front layers, sent last in backprop)")
    ax.set_ylabel("p99 completion (ms)")
    ax.set_title("tail completion by layer band")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(str(img_dir / f"dlcp_tct_by_band{args.img_suffix}.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    dl = results.get("dlcp")
    if dl and dl.get("per_band"):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        bands = sorted(dl["per_band"], key=int)
        a1.bar([int(b) - 32 for b in bands], [dl["per_band"][b]["loss_rate"] * 100 for b in bands])
        a1.set_xlabel("data band (0 = front layers)")
        a1.set_ylabel("packets lost (%)")
        a1.set_title("DLCP per-band loss")
        a2.bar(["sent", "dropped"], [dl["important_share_sent"] * 100, dl["important_share_dropped"] * 100])
        a2.set_ylabel("important (ECT) share (%)")
        a2.set_title("importance of dropped packets (E3)")
        fig.tight_layout()
        paths.append(str(img_dir / f"dlcp_bands{args.img_suffix}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m host.experiments.dlcp.evaluate",
                                 description="DLCP incast evaluation (needs root: netns)")
    ap.add_argument("--role", choices=("driver", "ps", "worker", "background"), default="driver")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--scheme", default="dlcp")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--period", type=float, default=1.5, help="seconds between iteration starts")
    ap.add_argument("--scale", type=int, default=512, help="ResNet-50 layer sizes divided by this")
    ap.add_argument("--rate", type=float, default=2000.0, help="bottleneck, packets/s")
    ap.add_argument("--capacity", type=int, default=64, help="switch packets per (port, queue)")
    ap.add_argument("--threshold", type=float, default=8.0, help="switch T of K = T(1 + d*b)")
    ap.add_argument("--d", type=float, default=0.5, help="switch d of K = T(1 + d*b)")
    ap.add_argument("--bg-fraction", type=float, default=0.2, help="background load / bottleneck")
    ap.add_argument("--p", type=float, default=0.1, help="DLCP push loss bound")
    ap.add_argument("--p-pull", type=float, default=0.01)
    ap.add_argument("--rto", type=float, default=10.0, help="RTO (ms) of the baselines")
    ap.add_argument("--bands", type=int, default=6,
                    help="DLCP data bands; 6 keeps queue 0 for best-effort (background) traffic")
    ap.add_argument("--report-ms", type=float, default=10.0,
                    help="receiver rate-report period; the paper's 200 us is under half a "
                         "packet time at this bottleneck, so it is scaled up to 20 packets of "
                         "the bottleneck (shorter windows make the measured rate noisy)")
    ap.add_argument("--drain-ms", type=float, default=20.0,
                    help="receiver's fallback wait for queued data after STOP (marker lost)")
    ap.add_argument("--delta", type=float, default=2.0,
                    help="DLCP rate control: congested when send > delta * receive rate")
    ap.add_argument("--reset-rate-on-retx", action="store_true",
                    help="DLCP: back to line rate for a retransmission round (the paper; off: a "
                         "line-rate burst of resends into the incast is what loses them again)")
    ap.add_argument("--ai", type=float, default=0.05,
                    help="DLCP rate control: additive increase per report, a fraction of the link")
    ap.add_argument("--ce-threshold", type=float, default=0.1,
                    help="DLCP rate control's ECN echo: a report with more CE-marked arrivals "
                         "than this share counts as congested (negative: off, the paper)")
    ap.add_argument("--retx-extra", type=float, default=0.25,
                    help="DLCP: resend only a tensor's deficit times (1 + this) of the missing "
                         "segments a STATUS lists (negative: all of them, as the paper)")
    ap.add_argument("--pace-burst-ms", type=float, default=2.0,
                    help="DLCP pacer: how much sending time a sender that fell behind may catch up")
    ap.add_argument("--e1-margin", type=float, default=0.1,
                    help="E1's small margin over the ideal iteration time (a fraction)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--img-dir", default="docs/img")
    ap.add_argument("--img-suffix", default="",
                    help="appended to the figure names (e.g. _small_buffer, so a second "
                         "configuration does not overwrite the default's figures)")
    ap.add_argument("--raw-dir", help="keep the per-process outputs here")
    # role-internal
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--t0", type=float, default=0.0)
    ap.add_argument("--out")
    ap.add_argument("--ready")
    ap.add_argument("--bg-rate", type=float, default=0.0)
    ap.add_argument("--duration", type=float, default=0.0)
    args = ap.parse_args(argv)
    if args.role == "driver":
        bad = set(args.schemes.split(",")) - set(SCHEMES)
        if bad:
            ap.error(f"unknown scheme(s) {sorted(bad)}; choose from {SCHEMES}")
        if not 0 <= args.p < 1:
            ap.error("--p must be in [0, 1)")
        if args.threshold * (1 + args.d * (args.bands - 1)) >= args.capacity:
            ap.error(f"the largest threshold T(1+d*(bands-1)) = "
                     f"{args.threshold * (1 + args.d * (args.bands - 1)):g} must be below "
                     f"--capacity {args.capacity}, or selective drop never happens on the last band")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    role = {"ps": run_ps, "worker": run_worker, "background": run_background}.get(args.role)
    if role:
        role(args)
        return 0
    if os.geteuid() != 0:
        print("the evaluation builds network namespaces: run it as root", file=sys.stderr)
        return 2
    results = {}
    with topology(args.rto) as tb, tempfile.TemporaryDirectory() as tmp:
        raw_dir = Path(args.raw_dir or tmp)
        raw_dir.mkdir(parents=True, exist_ok=True)
        for scheme in tqdm(args.schemes.split(","), desc="schemes"):
            results[scheme] = summarize(scheme, run_scheme(scheme, args, raw_dir, tb), args)
    paths = plot(results, args, Path(args.img_dir))
    print(f"{'scheme':10} {'tensors':>7} {'mean ms':>8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} "
          f"{'min deliv':>9} {'retx':>6} {'push/it ms':>10}")
    for r in results.values():
        t = r["tct_ms"]
        print(f"{r['scheme']:10} {r['tensors']:7d} {t['mean']:8.2f} {t['p50']:7.2f} {t['p99']:7.2f} "
              f"{t['max']:7.2f} {r['min_delivered_fraction']:9.3f} {r.get('retransmitted', '-'):>6} "
              f"{r['push_time_ms']['mean']:10.1f}")
    bands = sorted(next(iter(results.values()))["tct_by_band_ms"], key=int)
    print("p99 ms by band: " + " | ".join(
        f"{r['scheme']}: " + " ".join(f"{r['tct_by_band_ms'][b]['p99']:.0f}" for b in bands)
        for r in results.values()))
    if "dlcp" in results:
        d = results["dlcp"]
        e2 = d["min_delivered_fraction"] >= 1 - args.p - 1e-9
        print(f"E2 (every tensor delivered >= 1-p = {1 - args.p:.2f}): {'holds' if e2 else 'VIOLATED'}")
        ideal = d["ideal_iteration_ms"]
        worst = max(b["p99"] for b in d["tct_by_band_ms"].values())
        print(f"E1 (every band's p99 <= the ideal iteration {ideal:.0f} ms + {args.e1_margin:.0%}): "
              f"{'holds' if worst <= ideal * (1 + args.e1_margin) else 'VIOLATED'} (worst band p99 {worst:.0f} ms)")
        print(f"E3: important share sent {d['important_share_sent']:.3f}, "
              f"dropped {d['important_share_dropped']:.3f}")
    print("plots:", ", ".join(paths))
    if args.json:
        summary = {"config": {k: v for k, v in vars(args).items() if k in (
            "workers", "iterations", "period", "scale", "rate", "bg_fraction", "p", "p_pull", "rto",
            "bands", "report_ms", "drain_ms", "capacity", "threshold", "d", "delta", "ai", "ce_threshold", "retx_extra", "pace_burst_ms",
            "reset_rate_on_retx")},
            "results": {k: {kk: vv for kk, vv in v.items() if kk != "tct_all_ms"}
                        for k, v in results.items()}}
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
