"""The reference switch model as a live bottleneck between two veth interfaces.

Runs inside a network namespace (see host.experiments.dlcp.evaluate): frames are read from each
interface with an AF_PACKET socket, handed to ``dataplane.reference.ReferenceSwitch``
(IPv4 forwarding by route + the DLCP egress stage of docs/protocol.md §6: strict priority
over 8 queues, selective drop of Not-ECT above K, CE marking of ECT, capacity drop) and
sent out of the egress interface when the rate-limited port serves them.

Usage (inside the switch namespace)::

    python -m host.dlcp.switchbox --if0 sw0 --if1 sw1 --mac 02:00:00:00:00:fe \\
        --route0 10.0.0.0/24,02:00:00:00:00:01 --route1 10.0.1.0/24,02:00:00:00:01:02 \\
        --rate1 2000 --counters out.json

The counters are written as JSON when the process gets SIGTERM/SIGINT.
"""
from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import struct
import time

from dataplane.config import Dlcp, Route, SwitchConfig, default_thresholds
from dataplane.reference import ReferenceSwitch

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
TIMESPEC = struct.Struct("@qq")


def open_port(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.bind((ifname, 0))
    sock.setblocking(False)
    return sock


def read_frames(idx: int, sock: socket.socket, batch: int = 256) -> list[tuple[float, int, bytes]]:
    """(arrival time, port, frame) of the frames waiting on one port, ours skipped."""
    out = []
    for _ in range(batch):
        try:
            frame, anc, _flags, addr = sock.recvmsg(65535, socket.CMSG_SPACE(TIMESPEC.size))
        except BlockingIOError:
            break
        if addr[2] == PACKET_OUTGOING:
            continue                    # our own transmissions, seen by the packet socket
        stamp = time.time()
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = TIMESPEC.unpack(data[:TIMESPEC.size])
                stamp = sec + nsec * 1e-9
        out.append((stamp, idx, frame))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--if0", required=True)
    ap.add_argument("--if1", required=True)
    ap.add_argument("--mac", default="02:00:00:00:00:fe")
    ap.add_argument("--route0", required=True, help="PREFIX,NEXTHOP_MAC reached via port 0")
    ap.add_argument("--route1", required=True, help="PREFIX,NEXTHOP_MAC reached via port 1")
    ap.add_argument("--rate1", type=float, default=2000.0, help="port 1 service rate, packets/s")
    ap.add_argument("--threshold", type=float, default=8.0, help="T of K = T(1+d*b)")
    ap.add_argument("--d", type=float, default=0.5)
    ap.add_argument("--capacity", type=int, default=64, help="packets per (port, queue)")
    ap.add_argument("--counters", help="write counters as JSON here on exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    routes = tuple(Route(r.split(",")[0], port, r.split(",")[1])
                   for port, r in ((0, args.route0), (1, args.route1)))
    cfg = SwitchConfig(mac=args.mac, routes=routes,
                       dlcp=Dlcp(thresholds=default_thresholds(args.threshold, args.d),
                                 capacity=args.capacity))
    switch = ReferenceSwitch(cfg, port_rates={1: args.rate1}, clock=time.time)
    ports = [open_port(args.if0), open_port(args.if1)]
    running = [True]

    def stop(*_):
        running[0] = False
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    gap = 1.0 / args.rate1
    while running[0]:
        readable, _, _ = select.select(ports, [], [], gap / 2)
        arrivals = []
        for idx, sock in enumerate(ports):
            if sock in readable:
                arrivals += read_frames(idx, sock)
        # The model runs on the kernel's arrival timestamps, in arrival order, so a
        # process that is scheduled late (a loaded machine) does not see artificial
        # bursts: queue build-up is the same as if every frame were handled on arrival.
        arrivals.sort(key=lambda a: a[0])
        out = []
        for stamp, idx, frame in arrivals:
            out += switch.process(idx, frame, stamp)
        out += switch.advance(time.time())
        for egress, frame in out:
            try:
                ports[egress].send(frame)
            except OSError:
                pass                    # interface gone during shutdown
    if args.counters:
        with open(args.counters, "w") as fh:
            json.dump(switch.counters()["global"], fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
