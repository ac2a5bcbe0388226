"""The aggregator service over real UDP sockets on loopback (dataplane/udp_service.py): the
reference in a thread or a child process, and the switch core in C (thc_udp_service), each
held to the same cases."""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dataplane.config import ConfigError, Dlcp, Job, Member, SwitchConfig, default_thresholds
from dataplane.dpdk_config import write_config
from dataplane.udp_service import CORE_SERVICE_BIN, core_unavailable, serve
from host.packets import (FLAG_RESERVE, FLAG_RETX, TYPE_RESULT, decode_headers, encode_data,
                          scatter_payloads)
from .scenario import TABLE, pack, sums_of

ROOT = Path(__file__).resolve().parents[2]
VPP = 256


def worker_sockets(n):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.settimeout(5)
        socks.append(s)
    return socks


def loopback_config(socks, job_id=1, pool_size=64):
    members = tuple(Member(w, 0, f"02:00:00:00:00:{w + 1:02x}", "127.0.0.1",
                           s.getsockname()[1]) for w, s in enumerate(socks))
    return SwitchConfig(jobs=(Job(job_id, pool_size, TABLE, members),))


def send_tensor(sock, address, idx, worker, *, expected, flags=0, job=1):
    bufs, lengths = encode_data(pack(idx), len(idx), VPP, job=job, worker=worker, tensor=3,
                                slots=np.arange(-(-len(idx) // VPP)), rounds=0,
                                expected=expected, flags=flags)
    for row, length in zip(bufs, lengths):
        sock.sendto(row[:length].tobytes(), address)
    return len(bufs)


def receive(sock, count):
    return [sock.recv(2048) for _ in range(count)]


needs_core = pytest.mark.skipif(core_unavailable() is not None,
                                reason=f"the switch core's service: {core_unavailable()}")
CORE = pytest.param("core", marks=needs_core)
KINDS = ["thread", "process", CORE]


def start(config, kind):
    """The service of this kind: the reference in a thread or a process, or the C core."""
    return serve(config, "127.0.0.1", 0, process=kind == "process", core=kind == "core")


def run_service_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    """A script of its own (no `__main__` guard) with CONFIG, a one-member job, then body."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os\n"
        "from dataplane.config import Job, Member, SwitchConfig\n"
        "from dataplane.udp_service import serve\n"
        "from tests.packet.scenario import TABLE\n"
        "member = Member(0, 0, '02:00:00:00:00:01', '127.0.0.1', 9)\n"
        "CONFIG = SwitchConfig(jobs=(Job(1, 8, TABLE, (member,)),))\n" + body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=120,
                          capture_output=True, text=True)


def running(pid: int) -> bool:
    """Whether process pid runs (an ended one not yet reaped by init does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture
def workers():
    socks = worker_sockets(3)
    yield socks
    for s in socks:
        s.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_tensor_aggregates_over_udp(workers, kind):
    """A tensor of 59 packets per worker, sent back to back: the C core takes them in
    bursts and sends the results of a burst together (every one of them arrives)."""
    config = loopback_config(workers)
    n = 15000
    idx = np.random.default_rng(0).integers(0, 16, (3, n))
    with start(config, kind) as svc:
        n_pkts = 0
        for w, s in enumerate(workers):
            n_pkts = send_tensor(s, svc.address, idx[w], w, expected=0b111)
        for s in workers:
            datagrams = receive(s, n_pkts)
            hdr = decode_headers(datagrams)
            assert (hdr["ver_type"] & 0xF == TYPE_RESULT).all()
            assert (hdr["contributors"] == 0b111).all() and (hdr["count"] == 3).all()
            out = np.zeros(n, dtype=np.uint8)
            scatter_payloads(datagrams, None, hdr, out)
            np.testing.assert_array_equal(out, sums_of(idx))
        assert svc.counters()["jobs"][1]["aggregated"] == 3 * n_pkts
        c = svc.stop()                 # after the loop's last send has been counted
    assert c["jobs"][1]["aggregated"] == 3 * n_pkts
    assert c["jobs"][1]["results_multicast"] == n_pkts
    assert c["service"]["rx_datagrams"] == 3 * n_pkts
    assert c["service"]["tx_datagrams"] == 3 * n_pkts


@pytest.mark.parametrize("kind", KINDS)
def test_reserve_strangers_and_garbage(workers, kind):
    config = loopback_config(workers[:2])
    idx = np.random.default_rng(1).integers(0, 16, (2, 100))
    with start(config, kind) as svc:
        for w in (0, 1):
            send_tensor(workers[w], svc.address, idx[w], w, expected=0b11)
        for s in workers[:2]:
            receive(s, 1)
        # A lost result: worker 1 retransmits and alone gets the stored result back.
        send_tensor(workers[1], svc.address, idx[1], 1, expected=0b11, flags=FLAG_RETX)
        hdr = decode_headers(receive(workers[1], 1))
        assert hdr["flags"][0] == FLAG_RESERVE
        # The third socket is not a configured address: even claiming worker 0 it is refused.
        send_tensor(workers[2], svc.address, idx[0], 0, expected=0b11)
        workers[0].sendto(b"\x10\x00", svc.address)              # truncated
        workers[0].sendto(bytes(32), svc.address)                # version 0
        workers[0].settimeout(0.3)
        with pytest.raises(socket.timeout):
            workers[0].recv(2048)                                # nothing comes back
        c = svc.stop()
    assert c["jobs"][1]["drop_not_member"] == 1
    assert c["jobs"][1]["results_reserved"] == 1
    assert c["global"]["drop_truncated"] == 1 and c["global"]["drop_bad_version"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_datagram_whose_frame_exceeds_9216_bytes_is_drop_oversize(workers, kind):
    """docs/protocol.md §10: the service counts a datagram drop_oversize when its frame
    (42 bytes more) would exceed MAX_FRAME, as a switch would; a datagram of the largest
    allowed size is judged by the other rules (here: bad length) and a valid round still
    completes."""
    config = loopback_config(workers[:2])
    idx = np.random.default_rng(2).integers(0, 16, (2, 100))
    with start(config, kind) as svc:
        bufs, lengths = encode_data(pack(idx[0]), 100, VPP, job=1, worker=0, tensor=3,
                                    slots=np.arange(1), rounds=0, expected=0b11)
        datagram = bufs[0][:lengths[0]].tobytes()
        workers[0].sendto(datagram + bytes(9175 - len(datagram)), svc.address)
        workers[0].sendto(datagram + bytes(9174 - len(datagram)), svc.address)
        for w in (0, 1):
            send_tensor(workers[w], svc.address, idx[w], w, expected=0b11)
        for s in workers[:2]:
            hdr = decode_headers(receive(s, 1))
            assert hdr["contributors"][0] == 0b11 and hdr["flags"][0] == 0
        c = svc.stop()
    assert c["global"]["drop_oversize"] == 1 and c["global"]["drop_bad_length"] == 1
    assert c["jobs"][1]["aggregated"] == 2 and c["jobs"][1]["rx"] == 2


@pytest.mark.parametrize("kind", KINDS)
def test_members_sharing_an_address_are_refused(kind):
    m = Member(0, 0, "02:00:00:00:00:01", "127.0.0.1", 41000)
    config = SwitchConfig(jobs=(Job(1, 4, TABLE, (m, Member(1, 0, m.mac, m.ip, m.udp_port))),))
    with pytest.raises(ConfigError, match="workers 0 and 1 share the address 127.0.0.1:41000"):
        start(config, kind)


@pytest.mark.parametrize("change, words", [
    (dict(dlcp=Dlcp(thresholds=(-1,) + default_thresholds()[1:])), "threshold -1 of queue 0"),
    (dict(dlcp=Dlcp(capacity=(1 << 20) + 1)), "capacity 1048577"),
    (dict(values_per_packet=8193), "the UDP service's limit of 8192 values per packet"),
], ids=["threshold -1", "capacity 2^20 + 1", "values_per_packet 8193"])
@pytest.mark.parametrize("kind", ["thread", CORE])
def test_the_service_refuses_what_every_plane_refuses(workers, change, words, kind):
    config = loopback_config(workers[:2])
    if "values_per_packet" in change:
        config = dataclasses.replace(config, jobs=(dataclasses.replace(
            config.jobs[0], values_per_packet=change["values_per_packet"]),))
    else:
        config = dataclasses.replace(config, **change)
    with pytest.raises(ConfigError, match=words):
        start(config, kind)


def test_cli_serves_and_reports_counters(workers, tmp_path):
    config = loopback_config(workers[:2])
    cfg_file = config.save(tmp_path / "job.json")
    counters_file = tmp_path / "counters.json"
    proc = subprocess.Popen([sys.executable, "-m", "dataplane.udp_service", "--config",
                             str(cfg_file), "--port", "0", "--counters-json",
                             str(counters_file)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving 1 job(s) on 127.0.0.1:" in line
        address = ("127.0.0.1", int(line.rsplit(":", 1)[1]))
        idx = np.random.default_rng(2).integers(0, 16, (2, 10))
        for w in (0, 1):
            send_tensor(workers[w], address, idx[w], w, expected=0b11)
        assert len(receive(workers[0], 1)[0]) == 32 + 10
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        proc.stdout.close()
    assert proc.returncode == 0
    c = json.loads(counters_file.read_text())
    assert c["jobs"]["1"]["results_multicast"] == 1


@needs_core
def test_the_core_service_refuses_a_bad_address_or_port_with_a_message(workers, tmp_path):
    """thc_udp_service run by hand: an address it cannot bind, or a member on a switch port
    other than 0 (the kernel owns the ports), ends it at once with what to change."""
    config = loopback_config(workers[:2])
    good = write_config(config, tmp_path / "good.conf")
    job = config.jobs[0]
    moved = dataclasses.replace(job, members=(job.members[0],
                                              dataclasses.replace(job.members[1], port=3)))
    bad = write_config(dataclasses.replace(config, jobs=(moved,)), tmp_path / "bad.conf")
    for conf, bind, words in ((good, "nohost:0", "give an IPv4 address"),
                              (bad, "127.0.0.1:0", "worker 1 is on switch port 3")):
        result = subprocess.run([str(CORE_SERVICE_BIN), "--config", str(conf), "--bind", bind],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 1 and words in result.stderr, result.stderr


@needs_core
def test_a_core_service_that_cannot_start_raises_with_its_own_words(workers):
    """serve(core=True) on a port another socket holds: the C process ends at once, and
    the error carries what it said (the log it wrote is gone after)."""
    taken = workers[2].getsockname()[1]
    with pytest.raises(RuntimeError, match=f"did not start: thc_udp_service: cannot bind "
                                           f"127.0.0.1:{taken}"):
        serve(loopback_config(workers[:2]), "127.0.0.1", taken, core=True)


@needs_core
def test_the_core_service_ends_with_the_process_that_started_it(tmp_path):
    """A Python process that dies without stopping its core service leaves none behind:
    the service watches its parent (--parent) and stops within a tick."""
    out = run_service_script(tmp_path, "svc = serve(CONFIG, '127.0.0.1', 0, core=True)\n"
                                       "print(svc.pid, flush=True)\n"
                                       "os._exit(0)\n")
    assert out.returncode == 0, out.stderr[-2000:]
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid), "thc_udp_service outlived the process that started it"


def test_cli_refuses_a_bad_config_with_a_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"jobs": [{"job": 1, "pool_size": 4, "table": [0, 1],
                                         "members": []}]}))
    result = subprocess.run([sys.executable, "-m", "dataplane.udp_service", "--config", str(bad)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "table needs 16 entries" in result.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_a_result_carries_the_tos_of_the_packet_that_completed_it(workers, kind):
    """§5: every reply leaves with the ToS (DSCP and ECN) of the packet that caused it, so a
    CE mark on the completing contribution comes back on the RESULT; the earlier ones'
    marks do not. A plain packet after marked ones gets a plain RESULT (ToS 0)."""
    two = workers[:2]
    for s in two:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    config = loopback_config(two)
    idx = np.random.default_rng(4).integers(0, 16, (2, VPP))
    ect, ce = (33 << 2) | 2, (33 << 2) | 3
    with start(config, kind) as svc:
        for rounds, (first, last, tos_first, tos_last) in enumerate(
                ((0, 1, ect, ce), (1, 0, ce, ect), (0, 1, ce, 0))):
            two[first].setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_first)
            two[last].setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_last)
            for w in (first, last):
                bufs, lengths = encode_data(pack(idx[w]), VPP, VPP, job=1, worker=w, tensor=3,
                                            slots=np.arange(1), rounds=rounds,
                                            expected=0b11)
                two[w].sendto(bufs[0][:lengths[0]].tobytes(), svc.address)
            for s in two:
                data, anc, _, _ = s.recvmsg(2048, socket.CMSG_SPACE(4))
                assert decode_headers([data])["ver_type"][0] & 0xF == TYPE_RESULT
                assert [(level, kind, c[0]) for level, kind, c in anc] == \
                    [(socket.IPPROTO_IP, socket.IP_TOS, tos_last)]



def test_a_service_process_that_dies_before_serving_raises_instead_of_hanging(tmp_path):
    """A script without a `__main__` guard: the spawned child imports it again and dies
    starting a process of its own while bootstrapping. The parent, which waited for the
    child's address forever, now gets the child's exit as an error that names the fix."""
    out = run_service_script(tmp_path, "serve(CONFIG, '127.0.0.1', 0, process=True)\n")
    assert out.returncode != 0
    assert "ended before serving" in out.stderr and "__main__" in out.stderr, out.stderr[-2000:]
