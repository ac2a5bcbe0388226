"""Benchmark: the aggregator as a UDP service (the Python reference, and the switch core in
C where `make build` built it), next to a plain UDP sink.

    python -m host.experiments.bench_udp [--workers 4] [--packets 20000] [--values-per-packet 256]
                                  [--repeats 3] [--json results.json] [--plot bench.png]

Several sender processes (one per worker, each from its configured address) blast DATA
packets at the service on loopback, every packet to its own slot (round 0), so each
arriving packet is aggregated. In the same run, the same senders send the same packets
to a sink that only receives (recv_into and count): the bound for one Python receiver
on this machine. The receiver's rate is measured at the receiver (datagrams processed
per second of its busy time); datagrams the kernel drops while the receiver is busy do
not count. Medians over the repeats; the ratio service/sink names how far the
aggregation work is from the socket limit.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time

import numpy as np
from tqdm import tqdm

from dataplane.config import Job, Member, SwitchConfig
from dataplane.udp_service import RECV_BUFFER, SOCKET_BUFFER, core_unavailable, serve
from host.packets import encode_data

TABLE = (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 24, 27, 30)
POLL_S = 0.02
QUIET_S = 0.5                      # receiver idle this long after the senders finish: done
# The services measured: "service" is the Python reference, "core" the switch core in C.
SERVICES = ("service",) + (("core",) if core_unavailable() is None else ())
LABELS = {"service": "reference aggregator", "core": "switch core (C)"}


def _sender(sock: socket.socket, worker: int, n_workers: int, n_packets: int, vpp: int,
            address, go, ready) -> None:
    """Build every datagram first, then send them back to back when told to."""
    rng = np.random.default_rng(worker)
    idx = rng.integers(0, 16, n_packets * vpp)
    packed = ((idx[0::2] << 4) | idx[1::2]).astype(np.uint8)
    bufs, lengths = encode_data(packed, n_packets * vpp, vpp, job=1, worker=worker, tensor=0,
                                slots=np.arange(n_packets), rounds=0,
                                expected=(1 << n_workers) - 1)
    datagrams = [row[:length].tobytes() for row, length in zip(bufs, lengths)]
    sendto = sock.sendto
    ready.set()
    go.wait()
    for d in datagrams:
        try:
            sendto(d, address)
        except OSError:            # ENOBUFS under overload: the datagram is lost, go on
            pass


def _sink_child(host: str, conn) -> None:
    """A receiver that does no work: recv_into and count."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    sock.bind((host, 0))
    count = [0]

    def loop():
        buf = bytearray(RECV_BUFFER)
        recv_into = sock.recv_into
        while True:
            recv_into(buf)
            count[0] += 1

    threading.Thread(target=loop, daemon=True).start()
    conn.send(sock.getsockname())
    while conn.recv() != "stop":
        conn.send(count[0])


class _Sink:
    def __init__(self, host: str):
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=_sink_child, args=(host, child),
                                                     daemon=True)
        self._proc.start()
        child.close()        # the child's exit is then an EOFError here, not a hang
        self.address = tuple(self._conn.recv())

    def received(self) -> int:
        self._conn.send("count")
        return self._conn.recv()

    def stop(self) -> None:
        self._conn.send("stop")
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()


def _measure(received, start_senders, senders) -> tuple[int, float]:
    """Datagrams processed and the receiver's rate while busy, by polling its counter."""
    start_senders()
    samples = [(time.perf_counter(), received())]
    last_change = samples[0]
    while True:
        time.sleep(POLL_S)
        now, count = time.perf_counter(), received()
        if count != last_change[1]:
            last_change = (now, count)
        samples.append((now, count))
        if not any(p.is_alive() for p in senders) and now - last_change[0] > QUIET_S:
            break
    first = next(((t, c) for t, c in samples if c > 0), samples[-1])
    if last_change[1] == 0:
        raise SystemExit("the receiver got no datagram: check that loopback UDP works here")
    if first[1] == last_change[1]:      # nothing arrived after the first poll: no rate to time
        raise SystemExit(f"all {last_change[1]} datagrams arrived within one {POLL_S * 1e3:.0f} ms "
                         "poll, too few to time: raise --packets (default 20000)")
    # The first nonzero sample is within one poll of the first datagram: count from it.
    busy = max(last_change[0] - first[0], POLL_S)
    return last_change[1], (last_change[1] - first[1]) / busy


def _run_phase(receiver_address, received, sockets, n_packets, vpp) -> dict:
    ctx = mp.get_context("fork")   # the children inherit their bound sockets
    go, readies = ctx.Event(), [ctx.Event() for _ in sockets]
    senders = [ctx.Process(target=_sender, daemon=True,
                           args=(s, w, len(sockets), n_packets, vpp, receiver_address, go, r))
               for w, (s, r) in enumerate(zip(sockets, readies))]
    for p in senders:
        p.start()
    for r in readies:
        r.wait()
    count, rate = _measure(received, go.set, senders)
    for p in senders:
        p.join()
    return {"datagrams": count, "seconds": count / rate, "datagrams_per_s": rate}


def _worker_sockets(n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    return socks


def run(workers: int = 4, packets: int = 20000, vpp: int = 256, repeats: int = 3,
        host: str = "127.0.0.1") -> dict:
    if not 1 <= vpp <= 1024 or vpp % 2:
        raise SystemExit("--values-per-packet must be even and in 2..1024")
    socks = _worker_sockets(workers)
    members = tuple(Member(w, 0, f"02:00:00:00:00:{w + 1:02x}", "127.0.0.1",
                           s.getsockname()[1]) for w, s in enumerate(socks))
    config = SwitchConfig(jobs=(Job(1, packets, TABLE, members),))
    rows = []
    for _ in tqdm(range(repeats), desc="repeats", unit="run"):
        sink = _Sink(host)
        try:
            bound = _run_phase(sink.address, sink.received, socks, packets, vpp)
        finally:
            sink.stop()
        row = {"sink": bound}
        for name in SERVICES:
            row[name] = _service_phase(config, host, socks, packets, vpp, core=name == "core")
        rows.append(row)
    for s in socks:
        s.close()
    sink_rate = statistics.median(r["sink"]["datagrams_per_s"] for r in rows)
    median = {"sink_datagrams_per_s": sink_rate}
    for name in SERVICES:
        rate = statistics.median(r[name]["datagrams_per_s"] for r in rows)
        median.update({f"{name}_datagrams_per_s": rate, f"{name}_values_per_s": rate * vpp,
                       f"{name}_over_sink": rate / sink_rate})
    return {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
                   f"python {platform.python_version()}",
        "workers": workers, "packets_per_worker": packets, "values_per_packet": vpp,
        "services": list(SERVICES), "repeats": rows, "median": median,
    }


def _service_phase(config, host, socks, packets, vpp, core: bool) -> dict:
    """One service's phase: its rate, and what it aggregated and sent."""
    svc = serve(config, host, 0, process=True, core=core)
    try:
        agg = _run_phase(svc.address, lambda: svc.counters()["service"]["rx_datagrams"],
                         socks, packets, vpp)
        jc = svc.counters()["jobs"][1]
    finally:
        svc.stop()
    agg["aggregated"] = jc["aggregated"]
    agg["results_multicast"] = jc["results_multicast"]
    return agg


def _table(result: dict) -> str:
    m = result["median"]
    vpp = result["values_per_packet"]
    lines = [f"UDP aggregator on loopback: {result['workers']} sender processes x "
             f"{result['packets_per_worker']} packets, {vpp} values/packet "
             f"(median of {len(result['repeats'])})",
             f"{'receiver':<28}{'datagrams/s':>14}{'values/s':>14}{'vs sink':>9}",
             f"{'plain UDP sink (bound)':<28}{m['sink_datagrams_per_s']:>14,.0f}"
             f"{m['sink_datagrams_per_s'] * vpp:>14,.0f}{1:>9.2f}"]
    for name in result["services"]:
        lines.append(f"{LABELS[name]:<28}{m[f'{name}_datagrams_per_s']:>14,.0f}"
                     f"{m[f'{name}_values_per_s']:>14,.0f}{m[f'{name}_over_sink']:>9.2f}")
    for i, r in enumerate(result["repeats"]):
        lines.append(f"  run {i}: sink {r['sink']['datagrams']} in {r['sink']['seconds']:.2f}s"
                     + "".join(f", {name} {r[name]['datagrams']} in {r[name]['seconds']:.2f}s "
                               f"(aggregated {r[name]['aggregated']}, results "
                               f"{r[name]['results_multicast']})"
                               for name in result["services"]))
    return "\n".join(lines)


def _plot(result: dict, path: str) -> None:
    import matplotlib       # only --plot needs it (about a second to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = result["median"]
    fig, ax = plt.subplots(figsize=(5, 3))
    names = ["plain UDP sink\n(bound)"] + [LABELS[n].replace(" ", "\n", 1)
                                            for n in result["services"]]
    rates = [m["sink_datagrams_per_s"]] + [m[f"{n}_datagrams_per_s"] for n in result["services"]]
    ax.bar(names, rates, color=["#999999", "#1f77b4", "#ff7f0e"][:len(names)])
    ax.set_ylabel("datagrams/s (median)")
    ax.set_title(f"{result['workers']} senders, {result['values_per_packet']} values/packet")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m host.experiments.bench_udp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="sender processes (default 4)")
    parser.add_argument("--packets", type=int, default=20000,
                        help="DATA packets per sender (default 20000)")
    parser.add_argument("--values-per-packet", type=int, default=256, dest="vpp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", help="save a bar chart of the medians to this PNG file")
    args = parser.parse_args(argv)
    result = run(args.workers, args.packets, args.vpp, args.repeats)
    print(_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        _plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
