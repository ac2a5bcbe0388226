"""A job whose frames its ports cannot carry is refused at set-up (docs/protocol.md §8),
naming the limit, and the worker's own check (AggregatorTransport._check_mtu) draws the
line at the same values_per_packet.

The sizes: a DATA frame is 74 + ceil(vpp/2) bytes, a RESULT frame 74 + vpp (dataplane.wire);
net_tap sends at most 1522 bytes behind a tap of MTU 1500, an af_packet port receives whole
at most framesz - 67 bytes (1981 with the PMD's default ring frames).
"""
import os
import shutil
import subprocess

import pytest

from dataplane.config import SwitchConfig
from dataplane.dpdk_runner import (HostService, LiveSwitch, SwitchError, TapService,
                                   af_packet_vdevs, check_job_frames, port_limits)
from host.transport import AggregatorTransport

from .test_live import udp_round

TAP_LARGEST = 1500 - 20 - 8 - 32         # the largest RESULT payload an MTU of 1500 carries


def job(values_per_packet: int) -> SwitchConfig:
    return SwitchConfig.local(workers=2, ip="10.0.0.1", values_per_packet=values_per_packet)


def test_a_tap_service_refuses_results_longer_than_the_tap_carries():
    with pytest.raises(SwitchError) as refused:
        check_job_frames(job(2048), ["net_tap0,iface=thctap9"])
    msg = str(refused.value)
    assert "2122-byte RESULT frames" in msg and "MTU 1500" in msg and "1522" in msg
    assert f"at most {TAP_LARGEST}" in msg and "HostService" in msg
    check_job_frames(job(TAP_LARGEST), ["net_tap0,iface=thctap9"])
    with pytest.raises(SwitchError, match=f"at most {TAP_LARGEST}"):
        check_job_frames(job(TAP_LARGEST + 1), ["net_tap0,iface=thctap9"])


def test_default_af_packet_rings_refuse_data_they_would_cut():
    default_rings = ["net_af_packet0,iface=thcnone9"]
    assert port_limits(default_rings[0]).rx.size == 1981
    with pytest.raises(SwitchError) as refused:
        check_job_frames(job(4096), default_rings)
    msg = str(refused.value)
    assert "2122-byte DATA frames" in msg and "ring frame size 2048" in msg
    assert "af_packet_vdevs" in msg
    # The jumbo rings of af_packet_vdevs on a 9000-byte link take the largest job.
    check_job_frames(job(8192), af_packet_vdevs(["thcnone9"]), {0: 9000})


def test_the_link_mtu_of_an_af_packet_port_limits_both_directions():
    with pytest.raises(SwitchError, match="MTU 1500 of thcnone9") as refused:
        check_job_frames(job(2048), af_packet_vdevs(["thcnone9"]), {0: 1500})
    assert f"at most {TAP_LARGEST}" in str(refused.value)


def test_a_host_service_refuses_before_it_makes_any_link():
    iface = f"thcf{os.getpid() % 100000}"
    service = HostService(job(2048), iface=iface, mtu=1500)
    with pytest.raises(SwitchError, match="MTU 1500"):
        service.start()
    assert not os.path.exists(f"/sys/class/net/{iface}")
    assert service.proc is None


@pytest.fixture
def mtu_1500_path():
    """A veth pair of MTU 1500, 10.213.x.1/24 on one end: sockets to 10.213.x.2 take it."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a veth pair")
    dev, net = f"thcm{os.getpid() % 100000}", f"10.213.{os.getpid() % 250}"
    try:
        for cmd in (["link", "add", dev, "type", "veth", "peer", "name", dev + "p"],
                    ["link", "set", dev + "p", "up"], ["link", "set", dev, "mtu", "1500", "up"],
                    ["addr", "add", f"{net}.1/24", "dev", dev]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "link", "del", dev], capture_output=True)
        pytest.skip(f"cannot make a veth pair here: {exc.stderr.decode().strip()}")
    yield f"{net}.1", f"{net}.2"
    subprocess.run(["ip", "link", "del", dev], capture_output=True)


def test_the_worker_draws_the_line_where_the_switch_does(mtu_1500_path):
    local, aggregator = mtu_1500_path

    def transport(vpp: int) -> AggregatorTransport:
        return AggregatorTransport((aggregator, 50000), job=1, worker=0, expected=1,
                                   pool_size=4, values_per_packet=vpp, local=(local, 0))
    transport(TAP_LARGEST).close()
    with pytest.raises(ValueError, match=f"values_per_packet <= {TAP_LARGEST}"):
        transport(TAP_LARGEST + 1)
    with pytest.raises(SwitchError, match=f"at most {TAP_LARGEST}"):
        check_job_frames(job(TAP_LARGEST + 1), af_packet_vdevs(["x"]), {0: 1500})


@pytest.fixture
def root_dpdk(switch_bin):
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        pytest.skip("needs root and /dev/net/tun")
    return switch_bin


def test_tap_service_start_refuses_and_starts_no_switch(root_dpdk):
    tap = f"thcr{os.getpid() % 100000}"
    service = TapService(job(2048), tap=tap)
    with pytest.raises(SwitchError, match="2122-byte RESULT frames"):
        service.start()
    assert service.proc is None and not os.path.exists(f"/sys/class/net/{tap}")


def test_live_switch_with_default_rings_refuses_a_4096_value_job(root_dpdk):
    with pytest.raises(SwitchError, match="ring frame size 2048"):
        LiveSwitch(job(4096), ["net_af_packet0,iface=lo"]).start()


def test_tap_service_serves_the_largest_job_it_accepts(root_dpdk):
    udp_round(TapService, TAP_LARGEST, tap=f"thcl{os.getpid() % 100000}")
