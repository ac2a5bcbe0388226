"""The BMv2 packet-suite target without BMv2: its availability report, and the veth /
network-namespace plumbing it injects and captures through (real links, real sockets)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# The packet suite is the package `packet` under tests/ (as pytest imports it). Never
# "tests.packet": IPython, which p4runtime-shell loads, puts a `tests` package of its own
# on sys.path, and a regular package there wins over our namespace directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from packet.targets import bmv2  # noqa: E402


def test_unavailable_target_says_why():
    ok, reason = bmv2.available()
    if shutil.which("simple_switch_grpc") is None:
        assert not ok and "simple_switch_grpc" in reason
    else:
        assert ok or reason          # never unavailable without a reason


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for veth pairs and a namespace")
def test_links_carry_frames_both_ways_and_hide_own_frames():
    target = bmv2.Bmv2Target()
    target._ports = [0, 3]
    try:
        target._make_links()
        switch_side = {}
        for port in target._ports:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            s.bind((target._switch_if(port), 0))
            s.settimeout(2.0)
            switch_side[port] = s
        frame = bytes.fromhex("020000000001020000000002" "88b5") + b"thc-ina test frame" * 3
        # test side -> switch side (what simple_switch_grpc would receive on port 3)
        target._sockets[3].send(frame)
        while True:
            got = switch_side[3].recv(2048)
            if got[12:14] == b"\x88\xb5":
                break
        assert got == frame
        # switch side -> test side, reported with its port; our own sends are not echoed
        switch_side[0].send(frame[::-1][:14] + frame[14:])
        out = target._collect(0.2)
        assert [(p, f[14:]) for p, f in out if f[14:] == frame[14:]] == [(0, frame[14:])]
        for s in switch_side.values():
            s.close()
    finally:
        target.stop()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert target._tag + "s" not in links
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert target.netns not in namespaces
