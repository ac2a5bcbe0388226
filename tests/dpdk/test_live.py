"""The switch live on veth pairs (net_af_packet), as on the testbed: real interfaces,
real raw sockets, stats on SIGUSR1 and on exit."""
import json
import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from dataplane.dpdk_config import write_config
from dataplane.dpdk_runner import eal_args
from host.packets import TYPE_RESULT, parse_frame

from . import streams

pytestmark = pytest.mark.netns

ETH_P_ALL = 0x0003


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def veths():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create veth pairs")
    tag = f"{os.getpid() % 100000}"
    pairs = [(f"tsw{tag}{p}", f"thw{tag}{p}") for p in range(2)]
    try:
        for sw, host in pairs:
            sh("ip", "link", "add", sw, "type", "veth", "peer", "name", host)
            for dev in (sw, host):
                sh("sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1")
                sh("ip", "link", "set", dev, "up")
    except subprocess.CalledProcessError as exc:
        for sw, _ in pairs:
            subprocess.run(["ip", "link", "del", sw], capture_output=True)
        pytest.skip(f"cannot create veth pairs here: {exc.stderr.decode().strip()}")
    yield pairs
    for sw, _ in pairs:
        subprocess.run(["ip", "link", "del", sw], capture_output=True)


def wait_for(path, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_af_packet_round_and_stats_on_sigusr1(switch_bin, veths, tmp_path):
    cfg = streams.config(n_workers=2, pool_size=4)
    conf = write_config(cfg, tmp_path / "switch.conf")
    stats_path = tmp_path / "stats.json"
    vdevs = [f"net_af_packet{p},iface={sw}" for p, (sw, _) in enumerate(veths)]
    proc = subprocess.Popen([str(switch_bin), *eal_args(vdevs), "--", "--config", str(conf),
                             "--stats", str(stats_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    socks = []
    try:
        for _, host in veths:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((host, 0))
            s.settimeout(0.2)
            socks.append(s)
        # The switch says when its poll loop starts; then SIGUSR1 asks for stats.
        line = proc.stdout.readline()
        assert "running" in line, line + proc.stderr.read()
        proc.send_signal(signal.SIGUSR1)
        assert wait_for(stats_path)["jobs"]["1"]["rx"] == 0
        stats_path.unlink()

        rng = np.random.default_rng(5)
        idx = rng.integers(0, 16, (2, 300))
        job = cfg.jobs[0]
        for k, m in enumerate(job.members):
            socks[m.port].send(streams.data_frame(m, idx[k], job=1, slot=2, round_=0,
                                                  expected=job.expected_all))
        want = np.asarray(streams.TABLE)[idx].sum(axis=0).astype(np.uint8)
        for m in job.members:
            got = None
            deadline = time.time() + 10
            while got is None and time.time() < deadline:
                try:
                    frame = socks[m.port].recv(4096)
                except socket.timeout:
                    continue
                if len(frame) > 42 and frame[34:36] == (50000).to_bytes(2, "big"):
                    got = parse_frame(frame)
            assert got is not None, f"no result for worker {m.worker}"
            assert got.ptype == TYPE_RESULT and int(got.header["worker"]) == m.worker
            np.testing.assert_array_equal(np.frombuffer(got.payload, np.uint8), want)

        proc.send_signal(signal.SIGUSR1)
        stats = wait_for(stats_path)
        assert stats["jobs"]["1"]["aggregated"] == 2 and stats["jobs"]["1"]["results_multicast"] == 1
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        final = json.loads(stats_path.read_text())
        assert final["jobs"]["1"]["aggregated"] == 2
        assert out.count('"results_multicast": 1') == 2   # printed on SIGUSR1 and on exit
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_tap_service_aggregates_for_udp_sockets(switch_bin):
    """Workers are ordinary UDP sockets on this host; the switch sits behind a tap."""
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        pytest.skip("needs root and /dev/net/tun for a tap interface")
    from dataplane.config import Job, Member, SwitchConfig
    from dataplane.dpdk_runner import TapService

    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))
            s.settimeout(5.0)
        host_mac, host_ip = "02:00:00:00:aa:01", "10.213.0.1"
        members = tuple(Member(w, 0, host_mac, host_ip, s.getsockname()[1])
                        for w, s in enumerate(socks))
        cfg = SwitchConfig("02:00:00:00:aa:fe", "10.213.0.254",
                           (Job(4, 8, streams.TABLE, members),))
        rng = np.random.default_rng(9)
        idx = rng.integers(0, 16, (3, 777))
        tap = f"thct{os.getpid() % 100000}"
        with TapService(cfg, tap=tap) as service:
            for w, s in enumerate(socks):
                frame = streams.data_frame(members[w], idx[w], job=4, slot=5, round_=0,
                                           expected=0b111)
                s.sendto(frame[42:], (cfg.ip, 50000))       # AGG header + payload only
            want = np.asarray(streams.TABLE)[idx].sum(axis=0).astype(np.uint8)
            for w, s in enumerate(socks):
                data, (src_ip, src_port) = s.recvfrom(4096)
                assert (src_ip, src_port) == (cfg.ip, 50000)
                assert data[0] == 0x21 and data[6] == w             # v2 RESULT for worker w
                np.testing.assert_array_equal(np.frombuffer(data[32:], np.uint8), want)
            stats = service.counters()
            assert stats["jobs"]["4"]["aggregated"] == 3
            assert stats["jobs"]["4"]["results_multicast"] == 1
            # Every member shares the tap's MAC and IPv4 address: the UDP port tells them
            # apart (protocol §4.1). Worker 1's socket posing as worker 0, and a socket
            # that is no member, are refused.
            stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(stranger)
            stranger.bind(("0.0.0.0", 0))
            forged = streams.data_frame(members[0], idx[0], job=4, slot=6, round_=0,
                                        expected=0b111)[42:]
            socks[1].sendto(forged, (cfg.ip, 50000))
            stranger.sendto(forged, (cfg.ip, 50000))
            deadline = time.monotonic() + 5
            while service.counters()["jobs"]["4"]["drop_not_member"] < 2:
                assert time.monotonic() < deadline, service.counters()
                time.sleep(0.05)
            assert service.counters()["jobs"]["4"]["aggregated"] == 3
    finally:
        for s in socks:
            s.close()
