"""The DLCP switch stage end to end on a live testbed (docs/protocol.md §6).

Three sender namespaces and one receiver namespace, each on a veth pair whose root end
is a port of the DPDK switch (net_af_packet, `dataplane.dpdk_runner.LiveSwitch`). The
switch routes the hosts' /24s (plain IPv4 forwarding, same DLCP egress stage), and the
receiver's port is *paused*: nothing leaves until the switch stops, then the queues
drain in strict priority. So every queue's occupancy at each arrival is known and the
outcome of every packet follows from §6 (`expected_paused`).

The senders are real UDP sockets with a per-packet IP_TOS (bands DSCP 32+b, ECT(0),
ECT(1), CE and Not-ECT, control DSCP 48, best effort DSCP 0); they send one after the
other, each waiting until the switch counted the previous one's packets, so the
arrival order at the switch is the send order. The receiver captures whole frames
(AF_PACKET) to read the ToS byte and the IPv4 checksum as the switch left them.

The same offered sequence then goes through the reference switch model live
(`host.dlcp.switchbox`, a Python process on the same veths) for a side-by-side check
of the counters.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataplane.config import CONTROL_DSCP, Dlcp, band_to_dscp, default_thresholds
from host.netlab.dlcp_probes import (Capture, ECN_CE, Probe, expected_paused,
                                         live_switch_skip_reason, open_sender, send_probes,
                                         verdict_counts)
from host.netlab.links import NetnsError
from host.netlab.topology import Topology

REPO = Path(__file__).resolve().parents[2]
NOT_ECT, ECT1, ECT0, CE = 0, 1, 2, 3
BEST_EFFORT_DSCP = 0
# K = 8, 12, 16, ... for bands 0, 1, 2, ...; a small capacity so the band-0 queue also
# overflows (buffer drops) without hundreds of packets.
DLCP = Dlcp(thresholds=default_thresholds(8.0, 0.5), capacity=32)
SWITCHBOX_RATE_PPS = 0.5       # the model cannot pause a port; see switchbox_run


SKIP_REASON = live_switch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))


def offered_traffic() -> list[list[Probe]]:
    """Per sender, in send order. Seq numbers are unique over all senders."""
    rng = random.Random(8)
    seq = iter(range(10_000))

    def burst(sender, dscp, ecn_cycle, n):
        return [Probe(sender, 0, dscp, ecn_cycle[i % len(ecn_cycle)]) for i in range(n)]

    plans = [
        # 0: control above the data thresholds, band 0 half Not-ECT, best effort, band 5 below its K
        burst(0, CONTROL_DSCP, [NOT_ECT], 16) + burst(0, band_to_dscp(0), [NOT_ECT, ECT0], 24)
        + burst(0, BEST_EFFORT_DSCP, [NOT_ECT], 6) + burst(0, band_to_dscp(5), [NOT_ECT, ECT0], 8),
        # 1: band 0 ECT of every kind until the queue is full; band 2 mixed
        burst(1, band_to_dscp(0), [ECT0, ECT1, CE], 20)
        + burst(1, band_to_dscp(2), [NOT_ECT, ECT0, NOT_ECT, ECT1], 26),
        # 2: band 1 mixed, band 6 Not-ECT below K (its queue 0 is shared with best effort)
        burst(2, band_to_dscp(1), [ECT0, NOT_ECT], 20) + burst(2, band_to_dscp(6), [NOT_ECT], 10)
        + burst(2, CONTROL_DSCP, [ECT0], 5),
    ]
    out = []
    for plan in plans:
        rng.shuffle(plan)                  # bands interleave on the wire
        out.append([Probe(p.sender, next(seq), p.dscp, p.ecn) for p in plan])
    return out


@pytest.fixture(scope="module")
def testbed():
    try:
        with Topology(4, layout="routed") as tb:      # 3 senders, 1 receiver
            yield tb
    except NetnsError as exc:
        pytest.skip(f"cannot build the netns/veth testbed: {exc}")


def wait_rx(switch, port: int, count: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = switch.counters()
        if stats["ports"][str(port)]["rx"] >= count or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture(scope="module")
def dpdk_run(testbed):
    from dataplane.dpdk_runner import LiveSwitch, af_packet_vdevs
    plans = offered_traffic()
    offered = [p for plan in plans for p in plan]
    outcomes, departures = expected_paused(offered, DLCP)
    capture = Capture(testbed.receiver)
    senders = [open_sender(h) for h in testbed.senders]
    switch = LiveSwitch(testbed.switch_config(DLCP),
                        af_packet_vdevs([h.switch_if for h in testbed.hosts]),
                        port_rates={testbed.receiver.port: 0})
    switch.start()
    try:
        arrived = []
        for host, sock, plan in zip(testbed.senders, senders, plans):
            send_probes(sock, testbed.receiver.ip, plan)
            arrived.append(wait_rx(switch, host.port, len(plan))["ports"][str(host.port)]["rx"])
        paused = switch.counters()
    finally:
        final = switch.stop()
    received = capture.collect(len(departures), timeout=10.0)
    capture.close()
    for s in senders:
        s.close()
    print(f"\npaused port: offered {len(offered)}, received {len(received)}, "
          + ", ".join(f"{k} {final['global'][k]}" for k in verdict_counts([])))
    return dict(plans=plans, offered=offered, outcomes=outcomes, departures=departures,
                arrived=arrived, paused=paused, final=final, received=received,
                rx_port=str(testbed.receiver.port))


def test_every_packet_reached_the_switch_and_waited_at_the_paused_port(dpdk_run):
    assert dpdk_run["arrived"] == [len(p) for p in dpdk_run["plans"]]
    port = dpdk_run["paused"]["ports"][dpdk_run["rx_port"]]
    assert port["tx"] == 0, "the paused port sent before the switch stopped"
    assert port["queued"] == len(dpdk_run["departures"])
    assert dpdk_run["final"]["global"]["forwarded"] == len(dpdk_run["offered"])


def test_strict_priority_between_bands_fifo_within(dpdk_run):
    received = dpdk_run["received"]
    queues = [DLCP.classify(r.sent_tos >> 2)[0] for r in received]
    assert queues == sorted(queues, reverse=True), "a lower queue left before a higher one"
    expected = [(o.probe.sender, o.probe.seq) for o in dpdk_run["departures"]]
    assert [(r.sender, r.seq) for r in received] == expected
    port = dpdk_run["final"]["ports"][dpdk_run["rx_port"]]
    assert port["tx"] == len(received) and port["tx_dropped"] == 0


def test_not_ect_above_threshold_is_selectively_dropped(dpdk_run):
    outcomes, stats = dpdk_run["outcomes"], dpdk_run["final"]["global"]
    got = {(r.sender, r.seq) for r in dpdk_run["received"]}
    missing = [o for o in outcomes if (o.probe.sender, o.probe.seq) not in got]
    selective = [o for o in missing if o.verdict == "selective"]
    assert len(selective) > 0
    assert all(o.probe.ecn == NOT_ECT and o.occupancy > DLCP.thresholds[o.queue] for o in selective)
    assert stats["dlcp_selective_drop"] == len(selective)
    # everything else that is missing met a full queue
    assert stats["dlcp_buffer_drop"] == len(missing) - len(selective) > 0
    assert all(o.verdict == "buffer" and o.occupancy >= DLCP.capacity
               for o in missing if o.verdict != "selective")


def test_ect_above_threshold_arrives_ce_with_valid_checksum(dpdk_run):
    by_id = {(o.probe.sender, o.probe.seq): o for o in dpdk_run["outcomes"]}
    above = [r for r in dpdk_run["received"]
             if by_id[(r.sender, r.seq)].verdict in ("ce", "ect_above")]
    assert len(above) > 0
    assert all(r.tos == r.sent_tos | ECN_CE for r in above)
    assert all(r.checksum_ok for r in dpdk_run["received"]), "bad IPv4 checksum after the switch"
    newly_marked = sum(r.sent_tos & 3 != CE for r in above)
    assert dpdk_run["final"]["global"]["dlcp_ce_marked"] == newly_marked > 0


def test_control_and_below_threshold_untouched(dpdk_run):
    by_id = {(r.sender, r.seq): r for r in dpdk_run["received"]}
    control = [o for o in dpdk_run["outcomes"] if o.probe.dscp == CONTROL_DSCP]
    # control meets occupancies at which a data packet would be dropped, and passes
    assert max(o.occupancy for o in control) > min(DLCP.thresholds[:7])
    assert all(o.verdict == "pass" for o in control)
    below = [o for o in dpdk_run["outcomes"] if o.verdict == "pass"]
    for o in below:
        r = by_id.get((o.probe.sender, o.probe.seq))
        assert r is not None, f"{o} was dropped below its threshold"
        assert r.tos == o.probe.tos, f"{o} was changed below its threshold"


def test_counters_match_section_6(dpdk_run):
    stats = dpdk_run["final"]["global"]
    expected = verdict_counts(dpdk_run["outcomes"])
    assert {k: stats[k] for k in expected} == expected


# ---------------------------------------------------------------------------- rated port

RATE_PPS = 200.0
TOKEN_BURST = 32        # the switch's token bucket holds at most one burst (BURST_SIZE in dataplane/dpdk/switch_app.h)


@pytest.fixture(scope="module")
def rated_run(testbed, dpdk_run):
    """One sender's burst into a receiver port served at RATE_PPS (token bucket, live):
    queues build while the burst arrives and drain while the port keeps sending."""
    from dataplane.dpdk_runner import LiveSwitch, af_packet_vdevs
    rng = random.Random(200)
    host = testbed.senders[1]
    # Sized so that no queue can reach capacity whatever the service timing (band 0:
    # at most 9 + 20 ECT, band 3: at most 30 < 32): every loss must be a selective drop.
    plan = ([(band_to_dscp(0), (NOT_ECT, ECT0)[i % 2]) for i in range(40)]
            + [(band_to_dscp(3), (NOT_ECT, ECT0, ECT1)[i % 3]) for i in range(30)]
            + [(CONTROL_DSCP, NOT_ECT)] * 20)
    rng.shuffle(plan)
    offered = [Probe(1, 30_000 + i, dscp, ecn) for i, (dscp, ecn) in enumerate(plan)]
    capture = Capture(testbed.receiver)
    sock = open_sender(host)
    switch = LiveSwitch(testbed.switch_config(DLCP),
                        af_packet_vdevs([h.switch_if for h in testbed.hosts]),
                        port_rates={testbed.receiver.port: RATE_PPS})
    switch.start()
    try:
        send_probes(sock, testbed.receiver.ip, offered)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:       # until the burst is in and drained
            port = switch.counters()["ports"]
            if port[str(host.port)]["rx"] >= len(offered) and port[str(testbed.receiver.port)]["queued"] == 0:
                break
            time.sleep(0.05)
    finally:
        final = switch.stop()
    received = capture.collect(final["ports"][str(testbed.receiver.port)]["tx"], timeout=5.0)
    capture.close()
    sock.close()
    span = received[-1].stamp - received[0].stamp if received else 0.0
    print(f"\nrated port {RATE_PPS:.0f} pps: offered {len(offered)}, received {len(received)} "
          f"over {span:.3f} s, "
          + ", ".join(f"{k} {final['global'][k]}" for k in verdict_counts([])))
    return dict(offered=offered, final=final, received=received,
                rx_port=str(testbed.receiver.port))


def test_rated_port_drops_only_not_ect_data_and_marks_ect(rated_run):
    stats, offered = rated_run["final"]["global"], rated_run["offered"]
    got = {r.seq for r in rated_run["received"]}
    missing = [p for p in offered if p.seq not in got]
    assert stats["dlcp_selective_drop"] == len(missing) > 0
    assert stats["dlcp_buffer_drop"] == 0
    assert all(p.ecn == NOT_ECT and DLCP.classify(p.dscp)[1] for p in missing)
    assert len(got) == len(rated_run["received"]), "a packet arrived twice"
    marked = [r for r in rated_run["received"] if r.tos != r.sent_tos]
    assert stats["dlcp_ce_marked"] == len(marked) > 0
    assert all(r.sent_tos & 3 in (ECT0, ECT1) and r.tos == r.sent_tos | ECN_CE
               and DLCP.classify(r.sent_tos >> 2)[1] for r in marked)
    assert all(r.checksum_ok for r in rated_run["received"])
    assert {p.seq for p in offered if p.dscp == CONTROL_DSCP} <= got


def test_rated_port_keeps_fifo_per_queue_and_its_rate(rated_run):
    received = rated_run["received"]
    for queue in range(8):
        seqs = [r.seq for r in received if DLCP.classify(r.sent_tos >> 2)[0] == queue]
        assert seqs == sorted(seqs), f"queue {queue} reordered"
    # Lower bound only (a loaded machine can only make it slower): beyond one token
    # burst, the port sends no faster than its rate.
    span = received[-1].stamp - received[0].stamp
    assert span >= (len(received) - TOKEN_BURST - 1) / RATE_PPS * 0.95


# ---------------------------------------------------------------------------- side by side

def packet_socket_backlog(pid: int) -> tuple[int, int]:
    """(AF_PACKET sockets the process holds, bytes waiting in their receive buffers),
    from /proc/PID/fd and /proc/net/packet (both in the root namespace, like the
    switchbox)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = backlog = 0
    with open("/proc/net/packet") as fh:
        next(fh)
        for line in fh:
            cols = line.split()     # sk RefCnt Type Proto Iface R Rmem User Inode
            if cols[8] in inodes:
                count += 1
                backlog += int(cols[6])
    return count, backlog


def wait_read(pid: int, timeout: float = 20.0) -> None:
    """Until the switchbox has read every frame waiting for it (0.3 s of empty buffers)."""
    deadline, empty_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if packet_socket_backlog(pid)[1] == 0:
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since >= 0.3:
                return
        else:
            empty_since = None
        time.sleep(0.02)


@pytest.fixture(scope="module")
def switchbox_run(testbed, dpdk_run, tmp_path_factory):
    """The same offered sequence, all from sender 0, through host.dlcp.switchbox between
    sender 0's port and the receiver's port.

    The model cannot pause a port, so it serves SWITCHBOX_RATE_PPS: the first packet to
    reach the idle port leaves at once and then one every 2 s, always from the highest
    queue. Readiness probes (control) and the offered control packets fill queue 7 first,
    so no data packet leaves during the run and data occupancies match the paused DPDK run.
    """
    src, rx = testbed.senders[0], testbed.receiver
    counters = tmp_path_factory.mktemp("switchbox") / "counters.json"
    cmd = [sys.executable, "-m", "host.dlcp.switchbox", "--if0", src.switch_if,
           "--if1", rx.switch_if,
           "--mac", testbed.switch_mac, "--route0", f"{src.prefix},{src.mac}",
           "--route1", f"{rx.prefix},{rx.mac}", "--rate1", str(SWITCHBOX_RATE_PPS),
           "--threshold", "8", "--d", "0.5", "--capacity", str(DLCP.capacity),
           "--counters", str(counters)]
    capture = Capture(rx)
    sock = open_sender(src)
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while (packet_socket_backlog(proc.pid)[0] < 2 and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)       # until both of its AF_PACKET sockets are open
        ready, probes = False, 0
        while not ready and proc.poll() is None and time.monotonic() < deadline:
            send_probes(sock, rx.ip, [Probe(0, 20_000 + probes, CONTROL_DSCP, NOT_ECT)])
            probes += 1
            ready = bool(capture.collect(1, timeout=0.3, quiet_s=0))
        assert ready, ("the switchbox forwarded no readiness probe: "
                       f"{proc.stderr.read() if proc.poll() is not None else 'still running'}")
        offered = [Probe(0, p.seq, p.dscp, p.ecn) for p in dpdk_run["offered"]]
        send_probes(sock, rx.ip, offered)
        time.sleep(0.1)
        wait_read(proc.pid)            # then SIGTERM ends the loop after this iteration
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        capture.close()
        sock.close()
    assert proc.returncode == 0, err
    ref = json.loads(counters.read_text())
    print(f"\nswitchbox: offered {len(offered)} + {probes} readiness probe(s), "
          + ", ".join(f"{k} {ref[k]}" for k in verdict_counts([])))
    return dict(counters=ref, probes=probes, offered=offered)


def test_reference_switchbox_gives_the_same_counts_live(dpdk_run, switchbox_run):
    ref = switchbox_run["counters"]
    # readiness probes share queue 7 with 21 control packets (capacity 32)
    assert switchbox_run["probes"] <= 10, "too many readiness probes: queue 7 could overflow"
    assert ref["forwarded"] == len(switchbox_run["offered"]) + switchbox_run["probes"], \
        "the switchbox did not read every offered packet before it stopped"
    names = ("dlcp_selective_drop", "dlcp_ce_marked", "dlcp_buffer_drop")
    dpdk = dpdk_run["final"]["global"]
    assert {k: ref[k] for k in names} == {k: dpdk[k] for k in names}
    assert {k: ref[k] for k in names} == verdict_counts(expected_paused(switchbox_run["offered"], DLCP)[0])
