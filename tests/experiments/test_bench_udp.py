"""The UDP benchmark runs end to end on loopback, and refuses runs too short to time."""
import json

import pytest

from dataplane.udp_service import core_unavailable
from host.experiments import bench_udp


def test_bench_udp_measures_service_and_sink(tmp_path, capsys):
    out_json, out_png = tmp_path / "udp.json", tmp_path / "udp.png"
    assert bench_udp.main(["--workers", "2", "--packets", "5000", "--repeats", "1",
                           "--json", str(out_json), "--plot", str(out_png)]) == 0
    result = json.loads(out_json.read_text())
    median = result["median"]
    assert median["sink_datagrams_per_s"] > 0 and median["service_datagrams_per_s"] > 0
    service = result["repeats"][0]["service"]
    assert 0 < service["aggregated"] <= service["datagrams"] <= 2 * 5000
    assert out_png.stat().st_size > 1000
    out = capsys.readouterr().out
    assert "reference aggregator" in out
    if core_unavailable() is None:          # the switch core in C, measured in the same run
        core = result["repeats"][0]["core"]
        assert result["services"] == ["service", "core"] and median["core_datagrams_per_s"] > 0
        assert 0 < core["aggregated"] <= core["datagrams"] <= 2 * 5000
        assert "switch core (C)" in out


def test_measure_refuses_a_run_that_ends_within_one_poll():
    # every datagram counted before the first poll: there is no busy time to divide by
    with pytest.raises(SystemExit, match="too few to time: raise --packets"):
        bench_udp._measure(lambda: 100, lambda: None, senders=[])


def test_measure_says_when_nothing_arrived():
    with pytest.raises(SystemExit, match="no datagram"):
        bench_udp._measure(lambda: 0, lambda: None, senders=[])
