"""DLCP per-packet load balancing (DLCP paper, §3.2.3; docs/protocol.md §7).

Over many packets of ONE 5-tuple, every equal-cost next hop carries a share within a
tolerance of 1/k. With 5-tuple ECMP a single flow would stay on one link; the switch
sprays per packet, round-robin in next-hop order, so the split here is exact.

Live testbed: four namespaces on veths whose root ends are ports of the DPDK switch
(net_af_packet, `dataplane.dpdk_runner.LiveSwitch`). Sender h0 sends one UDP flow from a
real socket to 10.77.50.7, a prefix routed over k = 3 next hops (the ports of h1, h2 and
h3); every host captures the frames arriving on its interface. The reference switch
(the executable semantics) is fed the same flow and must choose the same next hops.
"""
from __future__ import annotations

import ipaddress
import os
import struct
import time

import pytest

from dataplane.config import Dlcp, Route, SwitchConfig
from dataplane.reference import ReferenceSwitch
from host.netlab.dlcp_probes import (Capture, PROBE_PORT, Probe, live_switch_skip_reason,
                                         open_sender, send_probes)
from host.netlab.links import NetnsError
from host.netlab.topology import Topology

FLOW_DST = "10.77.50.7"
SPRAY_PREFIX = "10.77.50.0/24"
N_PACKETS = 60
TOLERANCE = 0.1            # each link's share within 1/k +- 10 %
BEST_EFFORT = 0            # DSCP 0: queue 0, no selective drop on unlimited ports


SKIP_REASON = live_switch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))


def spray_config(tb: Topology) -> SwitchConfig:
    """Each host's /24 routed to it, plus the sprayed prefix over h1, h2 and h3."""
    hops = tb.hosts[1:]
    spray = Route(SPRAY_PREFIX, hops[0].port, hops[0].mac,
                  extra_hops=tuple((h.port, h.mac) for h in hops[1:]))
    own = tuple(Route(h.prefix, h.port, h.mac) for h in tb.hosts)
    return SwitchConfig(mac=tb.switch_mac, routes=own + (spray,), dlcp=Dlcp()).validate()


def reference_ports(config: SwitchConfig, src, n: int) -> list[int]:
    """The egress port of each of n packets of the flow, by the reference switch."""
    ref = ReferenceSwitch(config)
    ports = []
    for seq in range(n):
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 28, 0, 0, 64, 17, 0,
                         ipaddress.IPv4Address(src.ip).packed,
                         ipaddress.IPv4Address(FLOW_DST).packed)
        udp = struct.pack(">HHHH", PROBE_PORT, PROBE_PORT, 8, 0)
        frame = bytes.fromhex(config.mac.replace(":", "")) + \
            bytes.fromhex(src.mac.replace(":", "")) + b"\x08\x00" + ip + udp
        (out,) = ref.process(src.port, frame, now=0.0)
        ports.append(out[0])
    return ports


@pytest.fixture(scope="module")
def sprayed():
    from dataplane.dpdk_runner import LiveSwitch, af_packet_vdevs
    try:
        tb = Topology(4, layout="routed", tag=f"s7{os.getpid() % 100000}").up()
    except NetnsError as exc:
        pytest.skip(f"cannot build the netns/veth testbed: {exc}")
    try:
        config = spray_config(tb)
        sender, hops = tb.hosts[0], tb.hosts[1:]
        captures = {h.port: Capture(h) for h in hops}
        sock = open_sender(sender)
        switch = LiveSwitch(config, af_packet_vdevs([h.switch_if for h in tb.hosts]))
        switch.start()
        try:
            probes = [Probe(0, seq, BEST_EFFORT, 0) for seq in range(N_PACKETS)]
            for start in range(0, N_PACKETS, 10):      # small bursts: no veth overruns
                send_probes(sock, FLOW_DST, probes[start:start + 10])
                time.sleep(0.005)
            deadline = time.monotonic() + 10
            while (switch.counters()["ports"][str(sender.port)]["rx"] < N_PACKETS
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        finally:
            final = switch.stop()
        want = reference_ports(config, sender, N_PACKETS)
        got = {}
        for port, cap in captures.items():
            got[port] = [p.seq for p in cap.collect(want.count(port), timeout=5.0)]
            cap.close()
        sock.close()
        yield dict(config=config, hops=hops, sender=sender, final=final, got=got, want=want)
    finally:
        tb.down()


def test_s7_one_flow_is_spread_over_every_equal_cost_link(sprayed):
    k = len(sprayed["hops"])
    assert sprayed["final"]["ports"][str(sprayed["sender"].port)]["rx"] == N_PACKETS
    assert sprayed["final"]["global"]["forwarded"] == N_PACKETS
    shares = {port: len(seqs) / N_PACKETS for port, seqs in sprayed["got"].items()}
    print(f"\nS7: {N_PACKETS} packets of one 5-tuple over k={k} links, shares {shares}")
    assert len(shares) == k and all(abs(s - 1 / k) <= TOLERANCE for s in shares.values()), \
        shares            # 5-tuple ECMP would give one link 1.0 and the others 0.0


def test_s7_the_split_is_round_robin_exactly_as_the_reference_chooses(sprayed):
    want = sprayed["want"]
    assert want[:3] == [h.port for h in sprayed["hops"]]     # listed order, counter from 0
    for port, seqs in sprayed["got"].items():
        assert seqs == [seq for seq, p in enumerate(want) if p == port], f"port {port}"
