"""Starting `simple_switch_grpc` for the v1model program, and noticing when it dies.

The packet suite's BMv2 target and the Mininet testbed both start the switch through
`Bmv2Switch`: one command line (the target options such as `--priority-queues` go after
`--`, where simple_switch_grpc reads them), a log file, and a start-up wait that fails
with the switch's own last log lines when the process exits instead of serving gRPC.
"""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from dataplane.bmv2.control import (BMV2_QUEUE_DEPTH, BUILD_DIR, DEFAULT_BMV2_JSON, DEFAULT_P4INFO,
                            P4_SOURCE)
from dataplane.ports import free_port

PRIORITY_QUEUES = 8            # DLCP: 7 data bands + control (docs/protocol.md §6)
LOG_TAIL_LINES = 20


class Bmv2StartError(RuntimeError):
    """simple_switch_grpc exited (or never served gRPC) during start-up."""


def program_stale() -> bool:
    """True when the BMv2 JSON or P4Info is missing or older than a P4 source file."""
    if not DEFAULT_BMV2_JSON.is_file() or not DEFAULT_P4INFO.is_file():
        return True
    built = min(DEFAULT_BMV2_JSON.stat().st_mtime, DEFAULT_P4INFO.stat().st_mtime)
    return any(p.stat().st_mtime > built for p in P4_SOURCE.parent.glob("*.p4"))


def compile_program() -> None:
    """p4c the v1model program into build/p4 when it is stale; p4c's errors on failure."""
    if not program_stale():
        return
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["p4c", "--target", "bmv2", "--arch", "v1model",
                           "--p4runtime-files", str(DEFAULT_P4INFO), "-o", str(BUILD_DIR),
                           str(P4_SOURCE)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"p4c failed on {P4_SOURCE} (exit {proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}")


def switch_command(interfaces: dict[int, str], grpc_port: int, thrift_port: int,
                   device_id: int = 0) -> list[str]:
    """simple_switch_grpc with no pipeline (P4Runtime loads it) on `port -> interface`."""
    cmd = ["simple_switch_grpc", "--device-id", str(device_id), "--thrift-port",
           str(thrift_port), "--no-p4"]
    for port, intf in sorted(interfaces.items()):
        cmd += ["-i", f"{port}@{intf}"]
    # Target options: simple_switch_grpc parses these only after "--".
    cmd += ["--", "--priority-queues", str(PRIORITY_QUEUES),
            "--grpc-server-addr", f"127.0.0.1:{grpc_port}"]
    return cmd


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class Bmv2Switch:
    """One simple_switch_grpc process; `start()` returns once its gRPC port accepts."""

    def __init__(self, interfaces: dict[int, str], log_path: Path,
                 grpc_port: int | None = None, thrift_port: int | None = None,
                 popen=subprocess.Popen):
        self.interfaces = dict(interfaces)
        self.log_path = Path(log_path)
        self.grpc_port = grpc_port or free_port()
        self.thrift_port = thrift_port or free_port()
        self.grpc_addr = f"127.0.0.1:{self.grpc_port}"
        self._popen = popen
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def command(self) -> list[str]:
        return switch_command(self.interfaces, self.grpc_port, self.thrift_port)

    def start(self, timeout: float = 20.0) -> "Bmv2Switch":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.process = self._popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive("during start-up")
            try:
                with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.2):
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise Bmv2StartError(
                    f"simple_switch_grpc did not open its gRPC port {self.grpc_port} in "
                    f"{timeout:.0f} s; last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.05)

    def cli(self, commands: list[str]) -> str:
        """Run simple_switch_CLI commands (queue depths and rates: not in P4Runtime)."""
        self.check_alive("before simple_switch_CLI")
        proc = subprocess.run(["simple_switch_CLI", "--thrift-port", str(self.thrift_port)],
                              input="\n".join(commands) + "\n", capture_output=True, text=True)
        if proc.returncode != 0 or "Error" in proc.stdout:
            raise RuntimeError(f"simple_switch_CLI {commands} failed: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def set_queue_depth(self, depth: int = BMV2_QUEUE_DEPTH) -> None:
        """Every queue's depth; the DLCP stage needs it below its history (p4control)."""
        self.cli([f"set_queue_depth {depth}"])

    def check_alive(self, when: str = "") -> None:
        """Raise with the log's tail if the switch process has exited."""
        if self.process is None:
            raise Bmv2StartError("simple_switch_grpc was not started")
        code = self.process.poll()
        if code is not None:
            self._close_log()
            raise Bmv2StartError(
                f"simple_switch_grpc exited with status {code} {when}".rstrip() +
                f"; command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n"
                f"{log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
