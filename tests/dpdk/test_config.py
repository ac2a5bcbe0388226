"""One description, two consumers: dataplane/dpdk_config.py writes what the C switch
reads, and both refuse a bad configuration with a message saying what to change."""
import subprocess

import pytest

from dataplane.config import ConfigError, Job, Route, SwitchConfig
from dataplane.dpdk_config import main as config_main
from dataplane.dpdk_config import render, write_config
from dataplane.dpdk_runner import eal_args

from . import streams

GOOD = streams.config(n_workers=2, routes=streams.routes()[:1])


def run_switch(switch_bin, conf_path, n_ports=2):
    """Start the switch on net_null ports with an empty schedule: set-up, then exit."""
    empty = conf_path.parent / "empty.schedule"
    empty.write_text("")
    vdevs = [f"net_null{p}" for p in range(n_ports)]
    return subprocess.run([str(switch_bin), *eal_args(vdevs), "--", "--config", str(conf_path),
                           "--schedule", str(empty)], capture_output=True, text=True, timeout=60)


def test_written_file_lists_every_part_of_the_description():
    text = render(GOOD)
    assert "switch 02:00:00:00:00:fe 10.0.0.254" in text
    assert "job 1 8 1024 " + " ".join(map(str, streams.TABLE)) in text
    assert "member 1 1 1 02:00:00:00:01:02 10.1.0.2 40101" in text
    assert "route 10.0.0.0/8 4 02:00:00:00:00:a8" in text
    assert text.count("threshold ") == 8 and "capacity 64" in text
    assert "dscp 48 7 0" in text and "dscp 32 6 1" in text


def test_equal_cost_next_hops_are_written_in_order_on_the_route_line():
    spray = Route("10.3.0.0/16", 1, "02:00:00:00:03:01",
                  extra_hops=((0, "02:00:00:00:03:02"), (4, "02:00:00:00:03:03")))
    text = render(streams.config(n_workers=2, routes=(spray,)))
    assert ("route 10.3.0.0/16 1 02:00:00:00:03:01 0 02:00:00:00:03:02 "
            "4 02:00:00:00:03:03\n") in text
    with pytest.raises(ConfigError, match="port 40 must be in 0..31"):
        render(SwitchConfig(routes=(Route("10.4.0.0/16", 1, "02:00:00:00:04:01",
                                          extra_hops=((40, "02:00:00:00:04:02"),)),)))


def test_python_side_refuses_what_protocol_md_refuses():
    four = tuple(streams.member(1, w, w) for w in range(4))
    with pytest.raises(ConfigError, match="overflows the 8-bit"):
        render(SwitchConfig(jobs=(Job(1, 4, tuple(range(15)) + (100,), four),)))
    with pytest.raises(ConfigError, match="pool_size"):
        render(streams.config(pool_size=70000))
    with pytest.raises(ConfigError, match="exceeds the DPDK switch"):
        render(SwitchConfig(jobs=(Job(1, 4, streams.TABLE, (streams.member(1, 0, 40),)),)))
    with pytest.raises(ConfigError, match="the DPDK switch's limit of 8192 values per packet"):
        render(SwitchConfig(jobs=(Job(1, 4, streams.TABLE, four, values_per_packet=8193),)))


def test_values_per_packet_is_written_on_the_job_line():
    cfg = SwitchConfig(jobs=(Job(3, 2, streams.TABLE, (streams.member(3, 0, 0),),
                                 values_per_packet=8192),))
    assert "job 3 2 8192 " + " ".join(map(str, streams.TABLE)) in render(cfg)


def test_cli_writes_the_file(tmp_path):
    GOOD.save(tmp_path / "job.json")
    assert config_main([str(tmp_path / "job.json"), str(tmp_path / "switch.conf")]) == 0
    assert (tmp_path / "switch.conf").read_text() == render(GOOD)


def test_switch_accepts_the_written_file(switch_bin, tmp_path):
    res = run_switch(switch_bin, write_config(GOOD, tmp_path / "ok.conf"), n_ports=5)
    assert res.returncode == 0, res.stderr
    assert '"jobs": {"1": {"rx": 0' in res.stdout


BAD = {
    "table must start at 0 and strictly increase": "job 1 4 1024 0 1 2 2 5 7 9 11 13 15 17 19 21 24 27 30",
    "overflows the 8-bit": "job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 200\n"
                           "member 1 0 0 02:00:00:00:01:01 10.1.0.1 40100\n"
                           "member 1 1 1 02:00:00:00:01:02 10.1.0.2 40101",
    "duplicate worker id 0": "job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30\n"
                             "member 1 0 0 02:00:00:00:01:01 10.1.0.1 40100\n"
                             "member 1 0 1 02:00:00:00:01:02 10.1.0.2 40101",
    "slot budget": "job 1 70000 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30",
    "two jobs share the id 1": "job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30\n"
                               "member 1 0 0 02:00:00:00:01:01 10.1.0.1 40100\n"
                               "job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30",
    "has no members": "job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30",
    "only 2 ports exist": "job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30\n"
                          "member 1 0 9 02:00:00:00:01:01 10.1.0.1 40100",
    "not an IPv4 address": "job 1 4 1024 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30\n"
                           "member 1 0 0 02:00:00:00:01:01 10.1.0.300 40100",
    "unknown directive 'jbo'": "jbo 1",
    "values_per_packet '8193' must be in 1..8192": "job 1 4 8193 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30",
    "values_per_packet '0' must be in 1..8192": "job 1 4 0 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30",
    "expected 'job <id> <pool_size> <values_per_packet>": "job 1 4 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30",
    "workers 0 and 2 share the address 10.1.0.1:40100": (
        "job 1 4 64 0 1 2 3 5 7 9 11 13 15 17 19 21 24 27 30\n"
        "member 1 0 0 02:00:00:00:01:01 10.1.0.1 40100\n"
        "member 1 1 1 02:00:00:00:01:02 10.1.0.1 40101\n"
        "member 1 2 1 02:00:00:00:01:03 10.1.0.1 40100"),
    "expected 'capacity <packets, 1..1048576>'": "capacity 1048577",
    "expected 'threshold <queue 0..7> <K 0..4294967295>'": "threshold 2 4294967296",
    "more than 8 next hops": "route 10.0.0.0/8 " + " ".join(
        f"{p % 2} 02:00:00:00:00:{p:02x}" for p in range(9)),
    "route 10.0.0.0/8: port '40' must be in": "route 10.0.0.0/8 0 02:00:00:00:00:01 "
                                              "40 02:00:00:00:00:02",
    "expected 'route <a.b.c.d/len> <port> <next-hop mac>": "route 10.0.0.0/8 0 "
                                                           "02:00:00:00:00:01 1",
}


def test_switch_refuses_bad_config_with_a_message(switch_bin, tmp_path):
    for message, body in BAD.items():
        path = tmp_path / "bad.conf"
        path.write_text("switch 02:00:00:00:00:fe 10.0.0.254\n" + body + "\n")
        res = run_switch(switch_bin, path)
        assert res.returncode == 2, f"{message}: exit {res.returncode}\n{res.stderr}"
        assert "refusing configuration" in res.stderr and message in res.stderr, res.stderr
