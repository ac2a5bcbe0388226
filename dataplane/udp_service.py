"""The reference aggregator serving real UDP on one machine.

    python -m dataplane.udp_service --config job.json [--host 127.0.0.1] [--port 50000]

The kernel owns Ethernet/IPv4/UDP, so the service sees only the AGG header + payload of
each datagram and runs the reference semantics on it (`ReferenceSwitch.handle_agg`, the
code the packet suite checks). Differences from a switch, all forced by the socket API:

* Membership is `(job, worker)` plus the worker's configured `(ip, udp_port)`: a
  datagram must come from exactly that address (the MAC is the kernel's). Every member
  counts as attached to switch port 0 (the `port` field of the config is ignored).
* IPv4 fragments are the kernel's: it reassembles them before the socket sees a datagram,
  so `drop_fragment` stays 0 here; a datagram whose frame would exceed the 9216 bytes
  every plane takes (above 9174 bytes) is `drop_oversize`, as on a switch.
* Results and notices go to each member's `(ip, udp_port)` with `sendto`, from the
  service's own address, with the ToS of the datagram that caused them; no DLCP stage
  (the kernel queues), no ordinary forwarding.
* The drop counters of docs/protocol.md §4.5 are kept; `drop_truncated` and
  `drop_bad_length` see the datagram length (the UDP length).

Python API for tests and the main job:

    with serve(config, "127.0.0.1", 0) as svc:       # thread; process=True for a child
        ... send to svc.address ...
        print(svc.counters())

`serve(..., core=True)` serves the same way with the switch core in C
(dataplane/dpdk/udp_service.c, built by `make build`: the DPDK switch's agg_core.c behind
the socket, no DPDK or root needed). The packet suite holds that core to the reference, and
tests/packet/test_udp_service.py runs its cases on both; it serves 7-9 times the datagrams
per second (docs/perf.md), CPU the loopback main job is short of.

One thread owns the socket and every slot (the state machine is sequential by nature);
its loop is one `recvmsg_into` into a preallocated buffer per datagram (with the datagram's
ToS, which the replies it causes carry, docs/protocol.md §5), numpy on the values.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dataplane.config import MAX_VALUES, ConfigError, SwitchConfig
from dataplane.dpdk_config import write_config
from dataplane.dpdk_runner import request_stats, terminate
from dataplane.reference import ReferenceSwitch
from dataplane.wire import AGG_PORT_BASE, L2L4_LEN, MAX_FRAME

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = AGG_PORT_BASE
RECV_BUFFER = 1 << 16
# The longest datagram whose frame (Ethernet/IPv4/UDP around it) a switch would take
# (docs/protocol.md §8); a longer one is drop_oversize.
MAX_DATAGRAM = MAX_FRAME - L2L4_LEN
SOCKET_BUFFER = 8 << 20        # kernel buffers: absorb bursts of a whole tensor
IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13)
CORE_SERVICE_BIN = Path(__file__).resolve().parent / "dpdk" / "build" / "thc_udp_service"
TOS_INT = struct.Struct("@i")  # IP_TOS as a control message: an int


def service_config(config: SwitchConfig) -> SwitchConfig:
    """The config validated as given (shared member addresses are refused there), then
    every member moved to switch port 0: the kernel owns the ports."""
    config.validate(max_values=MAX_VALUES, plane="the UDP service")
    jobs = tuple(dataclasses.replace(job, members=tuple(dataclasses.replace(m, port=0)
                                                        for m in job.members))
                 for job in config.jobs)
    return dataclasses.replace(config, jobs=jobs)


class UdpAggregator:
    """A bound socket plus a ReferenceSwitch; `serve_forever` runs the loop."""

    def __init__(self, config: SwitchConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT):
        self.switch = ReferenceSwitch(service_config(config))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            except OSError:
                pass                       # the kernel caps it; the default still works
        # the ToS of what arrives, for the replies it causes (docs/protocol.md §5)
        self.sock.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
        self.sock.bind((host, port))
        self.address = self.sock.getsockname()
        self.stats = {"rx_datagrams": 0, "tx_datagrams": 0, "tx_errors": 0}
        self._stopping = False

    def counters(self) -> dict:
        c = self.switch.counters()
        c["service"] = dict(self.stats)
        return c

    def serve_forever(self) -> None:
        buf = bytearray(RECV_BUFFER)
        view = memoryview(buf)
        recvmsg_into = self.sock.recvmsg_into
        sendto, sendmsg = self.sock.sendto, self.sock.sendmsg
        handle = self.switch.handle_agg
        oversize = self.switch.count_oversize
        stats = self.stats
        ancillary = socket.CMSG_SPACE(4)
        while True:
            n, anc, _flags, source = recvmsg_into([buf], ancillary)
            if self._stopping:
                break
            stats["rx_datagrams"] += 1
            if n > MAX_DATAGRAM:
                oversize()
                continue
            tos = anc[0][2][0] if anc and anc[0][1] == socket.IP_TOS else 0
            for reply in handle(0, view[:n], n, True, tos, source):
                m = reply.member
                try:
                    if reply.tos:          # the causing packet's DSCP and ECN (§5)
                        sendmsg([reply.agg], [(socket.IPPROTO_IP, socket.IP_TOS,
                                               TOS_INT.pack(reply.tos))], 0,
                                (m.ip, m.udp_port))
                    else:
                        sendto(reply.agg, (m.ip, m.udp_port))
                    stats["tx_datagrams"] += 1
                except OSError:            # e.g. ECONNREFUSED from an earlier ICMP error
                    stats["tx_errors"] += 1
        self.sock.close()

    def request_stop(self) -> None:
        """Make the loop exit: set the flag, then wake the blocked recv with a datagram."""
        self._stopping = True
        host, port = self.address
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as wake:
            wake.sendto(b"", ("127.0.0.1" if host in ("0.0.0.0", "") else host, port))


class ServiceHandle:
    """A running service: `.address`, `.counters()`, `.stop()`; a context manager."""

    def __init__(self, address, counters_fn, stop_fn, pid: int | None = None):
        self.address = tuple(address)
        self.pid = pid              # the serving process (None: a thread of this one)
        self._counters = counters_fn
        self._stop = stop_fn
        self._final = None

    def counters(self) -> dict:
        return self._final if self._final is not None else self._counters()

    def stop(self) -> dict:
        """Stop serving; returns the final counters."""
        if self._final is None:
            self._final = self._stop()
        return self._final

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _serve_thread(config, host, port) -> ServiceHandle:
    agg = UdpAggregator(config, host, port)
    thread = threading.Thread(target=agg.serve_forever, name="udp-aggregator", daemon=True)
    thread.start()

    def stop():
        agg.request_stop()
        thread.join(10)
        return agg.counters()

    return ServiceHandle(agg.address, agg.counters, stop)


def _child_main(config_dict, host, port, conn) -> None:
    """Child process: serve in a thread, answer 'counters'/'stop' on the pipe."""
    try:
        agg = UdpAggregator(SwitchConfig.from_dict(config_dict), host, port)
    except Exception as exc:           # set-up errors travel back to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    thread = threading.Thread(target=agg.serve_forever, daemon=True)
    thread.start()
    conn.send(("address", agg.address))
    while True:
        request = conn.recv()
        if request == "stop":
            agg.request_stop()
            thread.join(10)
            conn.send(agg.counters())
            return
        conn.send(agg.counters())


def _serve_process(config, host, port) -> ServiceHandle:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_child_main, daemon=True,
                                           args=(config.to_dict(), host, port, child))
    proc.start()
    child.close()        # the child's end lives in the child only: its exit is our EOF
    try:
        kind, value = parent.recv()
    except EOFError:
        proc.join(10)
        raise RuntimeError(
            f"the aggregator service's process ended before serving (exit code "
            f"{proc.exitcode}); its error is above on stderr. A script that starts the "
            "service with process=True must do so under `if __name__ == \"__main__\":`, "
            "because the child process imports the script again") from None
    if kind == "error":
        proc.join()
        raise ConfigError(value) if "ConfigError" in value else RuntimeError(value)
    lock = threading.Lock()

    def ask(request):
        with lock:
            parent.send(request)
            return _int_keys(parent.recv())

    def stop():
        counters = ask("stop")
        proc.join(10)
        return counters

    return ServiceHandle(value, lambda: ask("counters"), stop, pid=proc.pid)


def core_unavailable() -> str | None:
    """Why serve(..., core=True) cannot run here (None when it can)."""
    if not CORE_SERVICE_BIN.exists():
        return "dataplane/dpdk/build/thc_udp_service is not built: run make build"
    return None


class _CoreProcess:
    """thc_udp_service in a child process: its config and statistics files in a temporary
    directory, its output in a log there; statistics on SIGUSR1 (a "seq" that counts up),
    the final ones on SIGTERM."""

    def __init__(self, config: SwitchConfig, host: str, port: int, start_timeout: float):
        reason = core_unavailable()
        if reason:
            raise RuntimeError(f"the switch core's UDP service: {reason}")
        self._tmp = tempfile.TemporaryDirectory(prefix="thc_udp_core_")
        work = Path(self._tmp.name)
        self.stats_path, self.log_path = work / "stats.json", work / "service.log"
        try:
            conf = write_config(service_config(config), work / "service.conf")
        except ConfigError:
            self._tmp.cleanup()
            raise
        with open(self.log_path, "w") as log:        # never a pipe it could block on
            self.proc = subprocess.Popen(
                [str(CORE_SERVICE_BIN), "--config", str(conf), "--bind", f"{host}:{port}",
                 "--stats", str(self.stats_path), "--parent", str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT)
        self.address = self._wait_serving(start_timeout)

    def _wait_serving(self, timeout: float) -> tuple[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"serving ([0-9.]+):(\d+)", self.log_path.read_text())
            if found:
                return found.group(1), int(found.group(2))
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        said = self.log_path.read_text().strip()        # before stop() removes the log
        self.stop()
        raise RuntimeError(f"thc_udp_service did not start: {said}")

    def counters(self, timeout: float = 10.0) -> dict:
        stats = request_stats(self.proc, self.stats_path, timeout, "thc_udp_service")
        return _service_counters(stats)

    def _read(self) -> dict:
        return _service_counters(json.loads(self.stats_path.read_text()))

    def stop(self) -> dict | None:
        terminate(self.proc, 10)
        final = self._read() if self.stats_path.exists() else None
        self._tmp.cleanup()
        return final


def _service_counters(stats: dict) -> dict:
    """The C service's statistics in the Python service's form (no "seq", int job keys)."""
    stats.pop("seq", None)
    return _int_keys(stats)


def _serve_core(config, host, port) -> ServiceHandle:
    core = _CoreProcess(config, host, port, start_timeout=10.0)
    return ServiceHandle(core.address, core.counters, core.stop, pid=core.proc.pid)


def _int_keys(counters: dict) -> dict:
    counters["jobs"] = {int(k): v for k, v in counters["jobs"].items()}
    return counters


def serve(config: SwitchConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
          process: bool = False, core: bool = False) -> ServiceHandle:
    """Start the UDP aggregator in a background thread (or a child process), or with
    core=True the switch core's service in C (always its own process).

    Port 0 picks a free port (see `.address`). Bad configuration raises ConfigError here,
    before anything is served.
    """
    if core:
        return _serve_core(config, host, port)
    return _serve_process(config, host, port) if process else _serve_thread(config, host, port)


def _format_counters(c: dict) -> str:
    lines = ["service: " + " ".join(f"{k}={v}" for k, v in c["service"].items())]
    nonzero = {k: v for k, v in c["global"].items() if v}
    lines.append("global: " + (" ".join(f"{k}={v}" for k, v in nonzero.items()) or "all zero"))
    for job, jc in c["jobs"].items():
        lines.append(f"job {job}: " + " ".join(f"{k}={v}" for k, v in jc.items() if v))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dataplane.udp_service",
        description="Serve the reference aggregator (docs/protocol.md) over UDP on this "
                    "machine. Workers send AGG packets to HOST:PORT from their configured "
                    "(ip, udp_port); results go back to every member's address.")
    parser.add_argument("--config", required=True,
                        help="job description JSON as written by SwitchConfig.save")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="UDP port to bind (default %(default)s; 0 = any free port)")
    parser.add_argument("--stats-interval", type=float, default=0.0,
                        help="print the counters every this many seconds (0 = only at exit)")
    parser.add_argument("--counters-json", help="write the final counters to this file")
    args = parser.parse_args(argv)
    try:
        config = SwitchConfig.load(args.config)
        agg = UdpAggregator(config, args.host, args.port)
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as exc:
        # A one-line refusal (exit code 2), no traceback: the message says what to change.
        print(f"udp_service: cannot start: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    thread = threading.Thread(target=agg.serve_forever, daemon=True)
    thread.start()
    print(f"udp_service: serving {len(config.jobs)} job(s) on {agg.address[0]}:{agg.address[1]}",
          flush=True)
    last_print = time.monotonic()
    while not done.wait(0.2):
        if args.stats_interval and time.monotonic() - last_print >= args.stats_interval:
            print(_format_counters(agg.counters()), flush=True)
            last_print = time.monotonic()
    agg.request_stop()
    thread.join(10)
    final = agg.counters()
    print(_format_counters(final), flush=True)
    if args.counters_json:
        with open(args.counters_json, "w") as f:
            json.dump(final, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
