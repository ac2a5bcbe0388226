"""The worker CPU benchmark runs end to end (one worker, the reference UDP service on
loopback): every data path it names is measured against the same codec floor."""
import json

from host import native
from host.experiments import bench_worker_cpu


def test_bench_worker_cpu_measures_each_path_against_one_floor(tmp_path, capsys):
    out = tmp_path / "wcpu.json"
    assert bench_worker_cpu.main(["--mb", "1", "--calls", "2", "--values-per-packet", "1024",
                                  "--pool", "16", "--moderation-us", "0,250",
                                  "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = [bench_worker_cpu._path_name(p) for p in result["paths"]]
    assert names == (["native", "native/250", "python"] if native.available() else ["python"])
    floor = result["floor"]["floor"]
    assert floor > 0
    for path in result["paths"]:
        assert path["cpu_ms"] > 0 and path["recv_calls"] >= 1
        assert path["over_floor"] == path["cpu_ms"] / floor
    assert "codec floor" in capsys.readouterr().out
    assert not bench_worker_cpu.dist.is_initialized()     # its own process group, gone
