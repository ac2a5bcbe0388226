"""The native worker data path: host/native/datapath.c, loaded with ctypes.

`make build` (and so `make run` and `make test`) compiles datapath.c into
host/native/_datapath.so (the Makefile's `native` target; rebuilt when the .c changes).
host.transport uses it by default (`AggregatorTransport(native=None)`): one `dp_run`
call per stream operation (a submission's first sends, a wait for a range, the finish)
runs the window, the sends, the receives, the timers and the scatter of the results in
C, without the GIL (ctypes releases it for the call).

What stays in Python (host.transport), by a status the call returns:
* a STRAGGLER notice: the call stops at it and Python applies it and the datagrams after
  it (`AggregatorTransport._apply`): the same StragglerNotice, or the chunk given up;
* a stream waiting for values never submitted, and no progress within the timeout: the
  same TransportError / AggregatorTimeout (with the probe of the missing workers) as the
  Python path;
* a kernel error: ECONNREFUSED as the same AggregatorUnreachable, any other as OSError;
* completion rules of the caller's (`TensorStream.wait_until`, e.g. DLCP's bounded loss):
  the loop stays in Python, each of its rounds is native;
* a background I/O thread (`TensorStream(background=True)`) enters the call once per
  batch of submitted values, with the stream's wake-up pipe: a submission, a new waiter
  or close() ends the call (status WOKEN) and the thread enters again with the new
  target, so the waiter of a range is told as soon as that range is in;
* UDP GSO or the one-datagram-per-syscall fallback (`batched=False`): the Python path.

If the shared object is missing or does not load, `available()` is False, `reason()`
says why, and the Python path runs.
"""
from __future__ import annotations

import ctypes
import os
import warnings

import numpy as np

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_datapath.so")

# dp_run's statuses (datapath.c)
DONE, NOTICE, WAITING_INPUT, TIMEOUT, ERRNO, WOKEN, DEADLINE = range(7)
GRACE_STARTED = -2             # dp_stream.grace_at once start_grace ran

_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double


class DpStream(ctypes.Structure):
    """struct dp_stream of datapath.c, field by field (all 8 bytes wide)."""
    _fields_ = (
        [(name, _I) for name in ("fd", "pool", "n_chunks", "num_values", "vpp", "job",
                                 "tensor", "row_width")]
        + [(name, _P) for name in ("rows", "lengths", "tos", "rounds", "sent", "done",
                                   "retransmitted", "sent_at", "deadline", "backoff", "sums",
                                   "counts", "contributors", "probed", "rx")]
        + [("rx_rows", _I), ("rx_width", _I), ("rx_len", _P), ("rtt_out", _P),
           ("rtt_cap", _I)]
        + [(name, _I) for name in ("available", "next_unsent", "n_done", "done_prefix")]
        + [("ex_last_progress", _D), ("stream_last_progress", _D), ("have_srtt", _I)]
        + [(name, _D) for name in ("srtt", "rttvar", "rto_init", "rto_min", "rto_max",
                                   "timeout")]
        + [(name, _I) for name in ("sock_tos", "ect_retx", "heard", "wake_fd")]
        + [("moderation", _D), ("until", _D)]
        + [("rx_tos", _P), ("cwnd", _D), ("cwnd_hold_until", _D), ("cwnd_increase", _D),
           ("ce_window", _I), ("grace_at", _I), ("grace_rtos", _D), ("stall_all", _I)]
        + [(name, _I) for name in ("packets_sent", "bytes_sent", "retransmissions",
                                   "packets_received", "bytes_received", "results_accepted",
                                   "duplicates", "ignored", "send_calls", "send_messages",
                                   "recv_calls", "rx_truncated", "rtt_count", "ce_results",
                                   "window_cuts")]
        + [(name, _I) for name in ("rx_next", "rx_count", "err")])


COUNTERS = ("packets_sent", "bytes_sent", "retransmissions", "packets_received",
            "bytes_received", "results_accepted", "duplicates", "ignored", "send_calls",
            "send_messages", "recv_calls", "ce_results", "window_cuts")

_lib = None
_reason: str | None = "not loaded yet"
_warned = False


def open_library(path: str = LIBRARY):
    """(the loaded shared object, None) or (None, why it cannot be used)."""
    if not os.path.exists(path):
        return None, f"{path} is not built (run `make build`)"
    try:
        lib = ctypes.CDLL(path)
        lib.dp_run.argtypes = [ctypes.POINTER(DpStream), ctypes.c_int, ctypes.c_int64,
                               ctypes.c_int64]
        lib.dp_run.restype = ctypes.c_int
        lib.dp_stream_size.restype = ctypes.c_int64
    except (OSError, AttributeError) as exc:
        return None, f"{path} does not load ({exc}); rebuild it with `make build`"
    if lib.dp_stream_size() != ctypes.sizeof(DpStream):
        return None, (f"{path} was built from another datapath.c (struct of "
                      f"{lib.dp_stream_size()} bytes, expected {ctypes.sizeof(DpStream)}): "
                      "rebuild it with `make build`")
    return lib, None


def load():
    """The shared object (loaded once), or None when it is unusable (see reason())."""
    global _lib, _reason
    if _lib is None and _reason == "not loaded yet":
        _lib, _reason = open_library(LIBRARY)
    return _lib


def available() -> bool:
    return load() is not None


def reason() -> str | None:
    """Why the native data path is unavailable (None when it is available)."""
    load()
    return _reason


def warn_once() -> None:
    """Say once per process that the Python data path runs instead, and why."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"native data path unavailable: {reason()}; the Python data path runs",
                      RuntimeWarning, stacklevel=3)


def _address(array: np.ndarray, dtype) -> int:
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise ValueError(f"native data path: an array of {array.dtype} (contiguous: "
                         f"{array.flags.c_contiguous}) where a contiguous {dtype} one belongs")
    return array.ctypes.data


class NativeWindow:
    """One stream's arrays bound to a struct dp_stream; `run` calls dp_run.

    The arrays are the stream's own (datapath.c reads and writes them in place); this
    object keeps them alive as long as it lives."""

    def __init__(self, *, fd, pool, job, tensor, num_values, vpp, rows, lengths, tos, rounds,
                 sent, done, retransmitted, sent_at, deadline, backoff, sums, counts,
                 contributors, probed, rx, rx_len, rx_tos=None):
        self._lib = load()
        if self._lib is None:
            raise RuntimeError(f"native data path unavailable: {reason()}")
        n_chunks = len(sent)
        self.rtt = np.zeros(max(1, n_chunks), np.float64)   # at most one sample per batch
        self._keep = (rows, lengths, tos, rounds, sent, done, retransmitted, sent_at,
                      deadline, backoff, sums, counts, contributors, probed, rx, rx_len,
                      rx_tos, self.rtt)
        s = self.state = DpStream()
        s.fd, s.pool, s.n_chunks, s.num_values, s.vpp = fd, pool, n_chunks, num_values, vpp
        s.job, s.tensor, s.row_width = job, tensor, rows.shape[1]
        u8, i64, f64 = np.dtype(np.uint8), np.dtype(np.int64), np.dtype(np.float64)
        for name, array, dtype in (
                ("rows", rows, u8), ("lengths", lengths, i64), ("tos", tos, u8),
                ("rounds", rounds, i64), ("sent", sent.view(u8), u8),
                ("done", done.view(u8), u8), ("retransmitted", retransmitted.view(u8), u8),
                ("sent_at", sent_at, f64), ("deadline", deadline, f64),
                ("backoff", backoff, f64), ("sums", sums, u8), ("counts", counts, i64),
                ("contributors", contributors, np.dtype(np.uint32)), ("probed", probed, i64),
                ("rx", rx, u8), ("rx_len", rx_len, i64), ("rtt_out", self.rtt, f64)):
            setattr(s, name, _address(array, dtype))
        s.rx_rows, s.rx_width = rx.shape
        # The ToS of each receive row (the socket has IP_RECVTOS): the CE window's input.
        s.rx_tos = None if rx_tos is None else _address(rx_tos, u8)
        s.rtt_cap = len(self.rtt)
        s.wake_fd = -1
        s.until = float("inf")
        s.grace_at = -1
        self._ref = ctypes.byref(s)

    def run(self, block: bool, target: int, at_least: int | None = None) -> int:
        """dp_run: rounds until chunks [0, target) are done, or at_least chunks in any
        order (None: no such goal); block=False: one round. The counters in `state` are
        this call's (zeroed first)."""
        s = self.state
        for name in COUNTERS:
            setattr(s, name, 0)
        s.rtt_count = s.rx_truncated = s.err = 0
        never = s.n_chunks + 1
        return self._lib.dp_run(self._ref, 1 if block else 0, target,
                                never if at_least is None else at_least)

    def rtt_samples(self) -> list[float]:
        """The RTT samples of the last call."""
        return self.rtt[:min(self.state.rtt_count, len(self.rtt))].tolist()
