"""DLCP-marked traffic through the reference switch (dataplane.reference) with a slow port.

The marks come from DlcpPolicy and the datagrams from the transport's encoder; the
frames the switch lets through are then delivered to a real DlcpReceiver over UDP with
their (possibly CE-marked) ToS byte, so the whole host-switch-host path is checked.
"""
import socket
import time

import numpy as np
import pytest

reference = pytest.importorskip("dataplane.reference", reason="reference switch not available")
from dataplane.wire import L2L4_LEN
from dataplane.config import Dlcp, Route, SwitchConfig, default_thresholds  # noqa: E402
from host.dlcp.marking import ECN_CE, ECN_ECT0, ECN_NOT_ECT, DlcpPolicy, layer_band  # noqa: E402
from host.dlcp.transport import (encode_segments,  # noqa: E402
                                 segment_count)
from host.packets import wrap_frames  # noqa: E402

from .conftest import RawSender  # noqa: E402

VPS = 50
NUM_LAYERS = 7


def layer_frames(layer, values, tensor_id):
    n = segment_count(values.size, VPS)
    dscp, ecn = DlcpPolicy(sample_fraction=1.0)(layer=layer, num_layers=NUM_LAYERS, values=values,
                                                values_per_packet=VPS, num_packets=n)
    rows = encode_segments(tensor_id, values, VPS)
    frames = wrap_frames(rows, np.full(n, rows.shape[1]), src_mac="02:00:00:00:00:01",
                         dst_mac="02:00:00:00:00:fe", src_ip="10.0.0.1", dst_ip="10.0.1.2",
                         sport=40000, dport=40001, tos=(dscp.astype(np.int64) << 2) | ecn)
    return frames, ecn


def make_switch():
    cfg = SwitchConfig(routes=(Route("10.0.1.0/24", 1, "02:00:00:00:01:02"),),
                       dlcp=Dlcp(thresholds=default_thresholds(8, 0.5), capacity=64))
    return reference.ReferenceSwitch(cfg, port_rates={1: 0})       # port 1 paused


def test_marked_traffic_through_reference_switch_then_real_receiver(receiver):
    rng = np.random.default_rng(0)
    switch = make_switch()
    sent, tensors = {}, {}
    for layer in range(NUM_LAYERS):       # one layer per band; back layers first (backprop)
        lay = NUM_LAYERS - 1 - layer
        scale = np.repeat(rng.choice([0.01, 1.0], size=40), VPS)      # half tiny packets
        values = (rng.standard_normal(40 * VPS) * scale).astype(np.float32)
        frames, ecn = layer_frames(lay, values, 1000 + lay)
        tensors[lay] = values
        sent[lay] = ecn
        for f in frames:
            assert switch.process(0, f, now=0.0) == []                 # paused: all queued
    out = [f for _, f in switch.drain([1])]
    # strict priority: all of band b leaves before any of band b+1
    bands = [(f[15] >> 2) - 32 for f in out]
    assert bands == sorted(bands) and set(bands) == set(range(7))
    k = default_thresholds(8, 0.5)
    g = switch.counters()["global"]
    for lay in range(NUM_LAYERS):
        band = layer_band(lay, NUM_LAYERS)
        got = [f for f in out if (f[15] >> 2) - 32 == band]
        kept_ecn = [f[15] & 3 for f in got]
        limit = k[6 - band] + 1                  # occupancy > K admits only ECT
        ect_sent = int((sent[lay] == ECN_ECT0).sum())
        # below the threshold everything is kept unmarked, above it only ECT (as CE)
        assert len(got) == limit + (ect_sent - int((sent[lay][:limit] == ECN_ECT0).sum()))
        assert all(e != ECN_CE for e in kept_ecn[:limit])
        assert all(e == ECN_CE for e in kept_ecn[limit:])
        assert ECN_NOT_ECT not in kept_ecn[limit:]
    assert g["dlcp_selective_drop"] == sum(int((sent[lay][k[6 - layer_band(lay, 7)] + 1:] == 0).sum())
                                           for lay in range(7))
    assert g["dlcp_buffer_drop"] == 0
    # front layers (low threshold) lose unimportant packets first
    drops = [int((sent[lay] == 0).sum()) - sum(1 for f in out if (f[15] >> 2) - 32 == lay and f[15] & 3 == 0)
             for lay in range(7)]
    assert drops[0] >= drops[-1]

    # hand what survived to a real receiver (one iteration of all layers, p = 0): the
    # STATUS asks only for unimportant packets; resending them completes every tensor
    raw = RawSender(receiver, vps=VPS)
    key = raw.announce([(1000 + lay, tensors[lay].size, 0.0) for lay in range(NUM_LAYERS)])
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for f in out:
        payload = f[L2L4_LEN:]
        udp.sendmsg([payload], [(socket.IPPROTO_IP, socket.IP_TOS, bytes([f[15]]))], 0, receiver.udp_addr)
    raw.settle(until_udp=len(out))
    assert sum(v for tos, v in receiver.tos_counts.items() if tos & 3 == ECN_CE) == \
        sum(1 for f in out if f[15] & 3 == ECN_CE)
    raw.end(key, len(out))
    (done, entries), = raw.messages(0.3)
    assert not done
    for lay in range(NUM_LAYERS):
        missing = entries[1000 + lay][1]
        assert (sent[lay][missing] == ECN_NOT_ECT).all()          # no important packet lost
        grams = raw.datagrams(1000 + lay, tensors[lay])
        for seg in missing.tolist():
            raw.send(grams[seg])
    for lay in range(NUM_LAYERS):
        res = receiver.wait(1000 + lay, 5)
        assert res.received.all() and np.array_equal(res.values, tensors[lay])
    udp.close()
    raw.close()


def _burst_drops(thresholds, packets: int, band: int = 0) -> dict:
    """`packets` Not-ECT frames of one band into a paused port: the switch's DLCP drops."""
    cfg = SwitchConfig(routes=(Route("10.0.1.0/24", 1, "02:00:00:00:01:02"),),
                       dlcp=Dlcp(thresholds=thresholds, capacity=64))
    switch = reference.ReferenceSwitch(cfg, port_rates={1: 0})
    rows = encode_segments(7, np.ones(packets * VPS, np.float32), VPS)
    frames = wrap_frames(rows, np.full(packets, rows.shape[1]), src_mac="02:00:00:00:00:01",
                         dst_mac="02:00:00:00:00:fe", src_ip="10.0.0.1", dst_ip="10.0.1.2",
                         sport=40000, dport=40001, tos=((32 + band) << 2) | ECN_NOT_ECT)
    for f in frames:
        switch.process(0, f, now=0.0)
    return switch.counters()["global"]


def test_window_thresholds_leave_a_jobs_own_window_alone():
    """dataplane.config.window_thresholds: every data band's K is at least the packets a
    job's window can queue (workers x pool), capped at the capacity, so the window alone
    meets no selective drop; anything on top of it does (overload)."""
    from dataplane.config import window_thresholds
    workers, pool = 4, 8
    k = window_thresholds(workers, pool, capacity=64)
    assert all(min(workers * pool, 64) <= kq <= 64 for kq in k[:-1])
    assert k[-1] == default_thresholds()[-1]                  # the control queue unbounded
    assert all(kq == 64 for kq in window_thresholds(4, 32, capacity=64)[:-1])
    for band in (0, 6):
        assert _burst_drops(k, workers * pool, band)["dlcp_selective_drop"] == 0
    # The default thresholds (T = 8) drop from the same window: the in-network case of
    # docs/dlcp.md, where one selective drop loses a chunk for every worker.
    assert _burst_drops(default_thresholds(8, 0.5), workers * pool, 0)["dlcp_selective_drop"] > 0
    # On top of the window (overload) the band still drops selectively, above its K.
    overload = _burst_drops(k, workers * pool + 16, 0)["dlcp_selective_drop"]
    assert 0 < overload <= 16


def test_flushes_leave_a_dlcp_queue_before_the_data_sent_after_them():
    """A worker's FLUSHes, as AggregatorTransport.flush sends them (bytes and ToS taken
    from a real socket), wait at a paused port; then the front band's DATA of the first
    stream arrives. Drained, the port sends every FLUSH first (protocol §4.6: the control
    class). At DSCP 0 they sat in the lowest queue, and the DATA overtook them: a flush
    landing after a contribution resets its slot."""
    from dataplane.config import band_to_dscp
    from host.packets import TYPE_DATA, TYPE_FLUSH, decode_headers, encode_data, header_types
    from host.transport import AggregatorTransport
    pool = 8
    agg = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agg.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    agg.bind(("127.0.0.1", 0))
    agg.settimeout(5)
    t = AggregatorTransport(agg.getsockname(), job=1, worker=0, expected=1, pool_size=pool)
    try:
        t.flush(repeats=1)
        flushes = []
        for _ in range(pool):
            data, anc, _, _ = agg.recvmsg(2048, socket.CMSG_SPACE(4))
            flushes.append((data, anc[0][2][0]))
    finally:
        t.close()
        agg.close()
    rows, lengths = encode_data(np.zeros(pool * 8, np.uint8), pool * 16, 16, job=1, worker=0,
                                tensor=1, slots=np.arange(pool), rounds=0, expected=1)
    data_tos = (band_to_dscp(0) << 2) | ECN_ECT0            # the front band, ECT
    frame = dict(src_mac="02:00:00:00:00:01", dst_mac="02:00:00:00:00:fe",
                 src_ip="10.0.0.1", dst_ip="10.0.1.2", sport=47200, dport=47100)
    switch = make_switch()
    for data, tos in flushes:
        raw = np.frombuffer(data, np.uint8)[None, :]
        for f in wrap_frames(raw, [len(data)], tos=tos, **frame):
            assert switch.process(0, f, now=0.0) == []
    for f in wrap_frames(rows, lengths, tos=data_tos, **frame):
        assert switch.process(0, f, now=0.0) == []
    out = [f for _, f in switch.drain([1])]
    types = header_types(decode_headers([f[L2L4_LEN:] for f in out],
                                        [len(f) - L2L4_LEN for f in out])).tolist()
    assert types == [TYPE_FLUSH] * pool + [TYPE_DATA] * pool
