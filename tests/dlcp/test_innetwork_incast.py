"""THC incast through the live DPDK switch's DLCP queues (root, netns, DPDK; seconds).

Four worker namespaces send the THC packets of one tensor, DLCP-marked (band from the
layer, ECT per RHT partition by norm), to the reference aggregator in a fifth namespace;
the switch routes them (the aggregator's port is outside the aggregation range) through
the aggregator's port, served at RATE_PPS, so the four windows meet in one DLCP queue.
Exact mode: every worker gets the exact integer sums despite the drops (retransmissions
go out ECT, so they are marked, not dropped again). Bounded mode (p = 0.25, no wait):
each stream finishes early, and with the union of the missing sets the workers' sums
agree on every chunk.
"""
from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

import thc
from dataplane.config import Dlcp, Job, Member, SwitchConfig, default_thresholds
from host.dlcp.marking import DlcpPolicy, partition_importance
from dataplane.udp_service import core_unavailable
from host.experiments.dlcp.innetwork_incast import AGG_UDP_PORT, WORKER_UDP_PORT
from host.netlab.dlcp_probes import live_switch_skip_reason
from host.netlab.links import NetnsError, in_netns
from host.netlab.topology import Topology

SKIP_REASON = live_switch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

WORKERS = 4
VPP = 256
PARTITION = 2048
D = 64 * VPP                    # 8 partitions, 64 packets per worker
RATE_PPS = 4000.0
DLCP = Dlcp(thresholds=default_thresholds(8.0, 0.5), capacity=64)


def _gradients():
    rng = np.random.default_rng(3)
    scale = np.repeat(np.array([4.0, 0.5, 3.0, 0.3, 5.0, 0.4, 2.0, 0.2]), PARTITION)
    return [(rng.standard_normal(D) * scale).astype(np.float32) for _ in range(WORKERS)]


def _wait_for_flushes(service, quiet_polls: int = 3, poll: float = 0.05, limit: float = 5.0):
    """The barrier flush() asks for: the aggregator has taken in every FLUSH that got
    through the rate-limited queue (its count stopped moving), so none lands after a
    contribution and resets a slot the workers already count on."""
    import time
    last, quiet, deadline = -1, 0, time.monotonic() + limit
    while quiet < quiet_polls and time.monotonic() < deadline:
        time.sleep(poll)
        flushes = service.counters()["jobs"][1]["flushes"]
        quiet = quiet + 1 if flushes == last else 0
        last = flushes
    assert last > 0, "no FLUSH reached the aggregator"


@pytest.fixture(scope="module")
def incast():
    from dataplane.dpdk_runner import LiveSwitch, af_packet_vdevs
    from dataplane.udp_service import serve
    from host.allreduce import AggregatorExchange
    from host.transport import AggregatorTransport
    try:
        # offloads off: checksums filled in by the stack, not left to the NIC
        tb = Topology(WORKERS + 1, layout="routed", offloads=False,
                      tag=f"ti{os.getpid() % 10000}").up()
    except NetnsError as exc:
        pytest.skip(f"cannot build the netns/veth testbed: {exc}")
    agg = tb.receiver
    members = [Member(worker=w, port=w, mac=h.mac, ip=h.ip, udp_port=WORKER_UDP_PORT)
               for w, h in enumerate(tb.senders)]
    job = Job.from_thc(1, 64, members, values_per_packet=VPP)
    service = in_netns(agg.ns, serve, SwitchConfig(ip=agg.ip, jobs=(job,)).validate(),
                       agg.ip, AGG_UDP_PORT)
    switch = LiveSwitch(tb.switch_config(DLCP), af_packet_vdevs([h.switch_if for h in tb.hosts]),
                        port_rates={agg.port: RATE_PPS}).start()
    codec = thc.THCCodec(seed=1, partition_size=PARTITION)
    grads = _gradients()
    norms = np.max([codec.partition_norms(g) for g in grads], axis=0)
    packed = [codec.quantize(codec.rotate(g), norms, worker=w, round=0, tensor=1)
              for w, g in enumerate(grads)]

    def bound_socket(ip):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((ip, WORKER_UDP_PORT))
        return s
    transports = [AggregatorTransport((agg.ip, AGG_UDP_PORT), job=1, worker=w,
                                      expected=(1 << WORKERS) - 1, pool_size=64,
                                      values_per_packet=VPP, timeout=10, policy=DlcpPolicy(),
                                      sock=in_netns(h.ns, bound_socket, h.ip))
                  for w, h in enumerate(tb.senders)]
    exchanges = [AggregatorExchange(t, codec) for t in transports]
    out = {"exact": [None] * WORKERS, "bounded": [None] * WORKERS,
           "missing": [None] * WORKERS, "errors": []}

    def worker(w, mode, tensor):
        try:
            stream = exchanges[w].open(D, tensor, layer=0, num_layers=1)
            stream.submit(0, D, packed[w], None, norms)
            if mode == "bounded":
                out["missing"][w] = stream.settle(0.25, 0.0)
            result = stream.stream.finish()
            out[mode][w] = (result.sums.copy(), result.counts.copy())
        except Exception as exc:            # noqa: BLE001 (reported by the test)
            out["errors"].append(f"worker {w} {mode}: {type(exc).__name__}: {exc}")
    try:
        for w in range(WORKERS):
            transports[w].flush()
        _wait_for_flushes(service)
        for mode, tensor in (("exact", 1), ("bounded", 2)):
            before = switch.counters()["global"]
            threads = [threading.Thread(target=worker, args=(w, mode, tensor))
                       for w in range(WORKERS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            after = switch.counters()["global"]
            out[f"{mode}_switch"] = {k: after[k] - before[k] for k in
                                     ("dlcp_selective_drop", "dlcp_buffer_drop",
                                      "dlcp_ce_marked", "forwarded")}
    finally:
        for t in transports:
            t.close()
        switch.stop()
        service.stop()
        tb.down()
    out.update(codec=codec, packed=packed, norms=norms)
    return out


def test_exact_sums_reach_every_worker_through_the_congested_queue(incast):
    assert not incast["errors"], "\n".join(incast["errors"])
    codec = incast["codec"]
    expected = np.sum([np.asarray(codec.lookup(p)).astype(np.int64)
                       for p in incast["packed"]], axis=0)
    for sums, counts in incast["exact"]:
        assert np.array_equal(sums.astype(np.int64), expected)
        assert (counts == WORKERS).all()
    sw = incast["exact_switch"]
    # The queue overflowed its threshold: Not-ECT packets were dropped, ECT ones marked.
    assert sw["dlcp_selective_drop"] > 0 and sw["dlcp_ce_marked"] > 0, sw


def test_selective_drops_fall_on_the_unimportant_partitions(incast):
    sizes = np.full(D // PARTITION, PARTITION)
    important = partition_importance(incast["norms"], sizes)
    assert important.tolist() == [True, False, True, False, True, False, True, False]
    # Selective drops hit only Not-ECT packets: first transmissions of unimportant
    # partitions (retransmissions go out ECT), so at most that many per worker.
    unimportant_packets = WORKERS * int((~important).sum()) * PARTITION // VPP
    assert incast["exact_switch"]["dlcp_selective_drop"] <= unimportant_packets


def test_bounded_incast_agrees_on_one_missing_set(incast):
    assert not incast["errors"], "\n".join(incast["errors"])
    union = np.any(incast["missing"], axis=0)
    assert union.mean() <= 0.25 + 1e-9
    base_sums, _ = incast["bounded"][0]
    keep = np.repeat(~union, VPP)
    for sums, counts in incast["bounded"]:
        # Outside the agreed missing set every worker holds the same complete sums.
        assert np.array_equal(sums[keep], base_sums[keep])
        assert (counts[~union] == WORKERS).all()


@pytest.mark.parametrize("aggregator", ["reference", pytest.param("core", marks=pytest.mark.skipif(
    core_unavailable() is not None, reason=f"the switch core's service: {core_unavailable()}"))])
def test_paired_training_alternates_the_modes_step_by_step(aggregator):
    """`innetwork incast --paired`: one training through the live switch, DLCP on the even
    steps and off on the odd ones; each mode's calls are summarized apart, with where their
    time went (the bounded-loss settle only in DLCP's). The job is served by the Python
    reference or by the switch core in C (`--aggregator`)."""
    import argparse

    from host.experiments.dlcp import innetwork_incast
    ap = argparse.ArgumentParser()
    innetwork_incast.add_arguments(ap)
    args = ap.parse_args(["--paired", "--steps", "6", "--run-timeout", "120",
                          "--aggregator", aggregator])
    runs = innetwork_incast.run(args)["runs"]
    assert [r["mode"] for r in runs] == ["dlcp (paired)", "off (paired)"]
    dlcp, off = runs
    # two buckets per step, 3 steps each; DDP's first step makes one call (its buckets are
    # built after it), which is left out as the set-up
    assert (dlcp["calls"], off["calls"]) == (2 * 2, 2 * 3)
    assert dlcp["ms_per_call_by_part"]["settle"] > 0 == off["ms_per_call_by_part"]["settle"]
    assert dlcp["test_acc"] == off["test_acc"] > 0.1
    with pytest.raises(SystemExit, match="without background"):
        innetwork_incast.run(ap.parse_args(["--paired", "--background-pps", "100"]))
