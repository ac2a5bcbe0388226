import numpy as np
import pytest
import torch

import thc
from thc import reference
from thc.layout import Layout


@pytest.fixture(scope="module")
def rs():
    return np.random.default_rng(1)


@pytest.mark.parametrize("d", [0, 1, 2, 3, 7, 8, 100, 1000, 4096, 3 * 1024 + 5])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_inverse_and_norm(d, backend, rs):
    codec = thc.THCCodec(partition_size=1024, backend=backend, seed=7)
    x = rs.standard_normal(d).astype(np.float32)
    y = codec.rotate(x)
    assert y.dtype == np.float32 and len(y) == codec.padded_length(d)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5, abs=1e-6)
    back = codec.inverse_rotate(y, d)
    np.testing.assert_allclose(back, x, atol=1e-5)


def test_padded_lengths():
    codec = thc.THCCodec(partition_size=1024)
    assert [codec.padded_length(d) for d in (0, 1, 2, 3, 5, 1024, 1025, 2048 + 300)] == \
        [0, 2, 2, 4, 8, 1024, 1026, 2048 + 512]
    assert codec.num_partitions(2048 + 300) == 3
    with pytest.raises(ValueError, match="power of two"):
        thc.THCCodec(partition_size=1000)


def test_cpu_kernels_match_reference(rs):
    x = rs.standard_normal(5000).astype(np.float32)
    ref = thc.THCCodec(partition_size=2048, backend="numpy")
    cpu = thc.THCCodec(partition_size=2048, backend="cpu")
    np.testing.assert_allclose(cpu.rotate(x), ref.rotate(x), atol=1e-5)
    np.testing.assert_allclose(cpu.partition_norms(x), ref.partition_norms(x), rtol=1e-6)


def test_fwht_matches_hadamard_matrix(rs):
    from scipy.linalg import hadamard
    from thc.cpu_kernels import fwht_inplace
    for n in (2, 8, 64, 1 << 13):
        v = rs.standard_normal(n).astype(np.float32)
        want = hadamard(n) @ v.astype(np.float64)
        np.testing.assert_allclose(reference.fwht(v), want, atol=1e-3)
        buf = np.concatenate([np.zeros(3, np.float32), v])
        fwht_inplace(buf, 3, n)
        np.testing.assert_allclose(buf[3:], want, atol=1e-3)


def test_rotated_coordinates_look_gaussian(rs):
    d = 1 << 16
    x = rs.lognormal(size=d).astype(np.float32)         # skewed input
    codec = thc.THCCodec(partition_size=d)
    y = codec.rotate(x)
    sigma = np.linalg.norm(x) / np.sqrt(d)
    assert y.std() == pytest.approx(sigma, rel=0.02)
    outside = np.mean(np.abs(y) > codec.t_p * sigma)
    assert outside == pytest.approx(1 / 32, abs=0.004)


def test_signs_depend_on_seed_and_are_balanced():
    pos = np.arange(1 << 14)
    a = thc.rng.signs_np(thc.rng.rademacher_key(0), pos)
    b = thc.rng.signs_np(thc.rng.rademacher_key(1), pos)
    assert abs(a.mean()) < 0.03 and abs(b.mean()) < 0.03
    assert np.mean(a != b) == pytest.approx(0.5, abs=0.03)


def test_torch_in_torch_out_zero_copy(rs):
    codec = thc.THCCodec(partition_size=256)
    x = torch.from_numpy(rs.standard_normal(300).astype(np.float32))
    y = codec.rotate(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.numel() == 256 + 64
    back = codec.inverse_rotate(y, 300)
    assert isinstance(back, torch.Tensor)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=0)
    # a 2-D float64 tensor is flattened and converted
    z = codec.rotate(x.double().reshape(3, 100))
    torch.testing.assert_close(z, y, atol=1e-6, rtol=0)


def test_layout_partitions():
    lay = Layout(2 * 1024 + 3, 1024)
    assert lay.sizes().tolist() == [1024, 1024, 4]
    assert lay.data_lengths().tolist() == [1024, 1024, 3]
    assert lay.starts().tolist() == [0, 1024, 2048]


def test_torch_reference_matches_codec(rs):
    from thc.torch_reference import TorchTHC
    codec = thc.THCCodec(partition_size=512)
    ref = TorchTHC(codec)
    x = torch.from_numpy(rs.standard_normal(1500).astype(np.float32))
    torch.testing.assert_close(ref.rotate(x), codec.rotate(x), atol=1e-5, rtol=0)
    norms = ref.partition_norms(x)
    np.testing.assert_allclose(norms.numpy(), codec.partition_norms(x), rtol=1e-5)
    packed = ref.quantize(ref.rotate(x), norms)
    assert torch.equal(ref.lookup(packed), codec.lookup(packed))
    est = ref.decode(ref.lookup(packed).int(), 1, norms, 1500)
    err = float(((est - x) ** 2).sum() / (x ** 2).sum())
    assert err < 0.03


@pytest.mark.parametrize("partition_size", [2, 4, 8, 64, 1 << 12])
@pytest.mark.parametrize("d", [5, 63, 64, 65, 5000])
def test_every_partition_size_matches_reference(partition_size, d, rs):
    x = rs.standard_normal(d).astype(np.float32)
    ref = thc.THCCodec(partition_size=partition_size, backend="numpy")
    cpu = thc.THCCodec(partition_size=partition_size, backend="cpu")
    np.testing.assert_allclose(cpu.rotate(x), ref.rotate(x), atol=1e-5)
    np.testing.assert_allclose(cpu.inverse_rotate(cpu.rotate(x), d), x, atol=1e-5)


@pytest.mark.parametrize("partition_size", [2, 8, 16, 64, 256, 512, 1 << 13, 1 << 17])
def test_vector_kernels_bit_identical_to_reference(partition_size, rs):
    """Same butterflies in the same stage order, signs and scale where the reference puts
    them: the CPU kernels reproduce the reference exactly (full partitions and a tail)."""
    d = 2 * partition_size + partition_size // 2 + 1
    x = rs.standard_normal(d).astype(np.float32)
    ref = thc.THCCodec(partition_size=partition_size, backend="numpy", seed=5)
    cpu = thc.THCCodec(partition_size=partition_size, backend="cpu", seed=5)
    y = ref.rotate(x)
    np.testing.assert_array_equal(cpu.rotate(x), y)
    np.testing.assert_array_equal(cpu.inverse_rotate(y, d), ref.inverse_rotate(y, d))


def test_rht_deterministic_across_calls_and_thread_counts(rs):
    """One partition is shared by all threads, several are dealt out to them: the result
    (and the fused norms) must not depend on either, nor change between calls."""
    import numba
    x = rs.standard_normal((1 << 16) + 100).astype(np.float32)
    e = rs.standard_normal(3 << 15).astype(np.float32)
    results = []
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            for partition_size in (1 << 16, 1 << 13):
                codec = thc.THCCodec(partition_size=partition_size, backend="cpu")
                pad = codec.padded_length(len(x))
                for _ in range(2):
                    rot, norms = codec.rotate_and_norms(x, add=e[:pad])
                    back = codec.inverse_rotate(rot, len(x))
                    results.append((partition_size, rot, norms, back))
    finally:
        numba.set_num_threads(before)
    for size in (1 << 16, 1 << 13):
        runs = [r for r in results if r[0] == size]
        for other in runs[1:]:
            for a, b in zip(runs[0][1:], other[1:]):
                np.testing.assert_array_equal(a, b)


def test_rotate_matches_fht_cpu_up_to_scaling(rs):
    """fht-cpu (FFHT's kernels) computes the unnormalized Walsh-Hadamard transform in place
    along the last axis; our RHT is that transform of the signed input divided by
    sqrt(n)."""
    fht_cpu = pytest.importorskip("fht_cpu", reason="fht-cpu is a dev extra "
                                  "(pip install -e '.[dev]')")
    n = 1 << 14
    codec = thc.THCCodec(partition_size=n)
    x = rs.standard_normal(4 * n).astype(np.float32)
    signed = x * thc.rng.signs_np(codec.sign_key, np.arange(4 * n))
    want = fht_cpu.fht(signed.reshape(4, n), num_threads=1).reshape(-1) / np.float32(np.sqrt(n))
    np.testing.assert_allclose(codec.rotate(x), want, rtol=0, atol=1e-5)


def _run_codec_check(tmp_path, env_extra: dict, assertion: str) -> None:
    """Quantize and both RHTs in a fresh process under env_extra (a Numba target), against
    the numpy reference, bit for bit."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "target_check.py"
    script.write_text(
        "import numpy as np\n"
        "import thc\n"
        "from thc import vector_kernels as vk\n"
        f"{assertion}\n"
        "rs = np.random.default_rng(0)\n"
        "for ps, d in ((16, 40), (256, 600), (1 << 13, 20000)):\n"
        "    ref = thc.THCCodec(partition_size=ps, backend='numpy')\n"
        "    cpu = thc.THCCodec(partition_size=ps, backend='cpu')\n"
        "    x = rs.standard_normal(d).astype(np.float32)\n"
        "    y = ref.rotate(x)\n"
        "    assert np.array_equal(cpu.rotate(x), y)\n"
        "    assert np.array_equal(cpu.inverse_rotate(y, d), ref.inverse_rotate(y, d))\n"
        "    n = ref.partition_norms(x)\n"
        "    assert np.array_equal(cpu.quantize(y, n, worker=1, round=2, tensor=3),\n"
        "                          ref.quantize(y, n, worker=1, round=2, tensor=3))\n"
        "    err_cpu, err_ref = np.empty_like(y), np.empty_like(y)\n"   # the fused error pass
        "    cpu.quantize(y, n, worker=1, round=2, tensor=3, error_out=err_cpu)\n"
        "    ref.quantize(y, n, worker=1, round=2, tensor=3, error_out=err_ref)\n"
        "    assert np.array_equal(err_cpu, err_ref)\n"
        "print('target ok')\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               **env_extra)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "target ok" in proc.stdout


def test_avx2_build_matches_reference(tmp_path):
    """The kernels compiled for an AVX2 target without AVX-512 (8-lane permute lookups in
    the quantizer) give the same bits as the reference, whatever this host has above AVX2."""
    from llvmlite import binding
    if not binding.get_host_cpu_features().get("avx2", False):
        pytest.skip("this CPU has no AVX2")
    _run_codec_check(tmp_path, {"NUMBA_CPU_NAME": "haswell",
                                "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+sse4.2,+popcnt,+bmi2"},
                     "assert vk.PERMUTE_LOOKUP == 'avx2', vk.PERMUTE_LOOKUP")


def test_portable_build_matches_reference(tmp_path):
    """The kernels compiled for a generic x86-64 target (no FMA, no AVX-512: select-based
    lane butterflies, gathered tables) give the same bits as the reference."""
    _run_codec_check(tmp_path, {"NUMBA_CPU_NAME": "generic"},
                     "assert not vk.USE_FMA and not vk.PERMUTE_LOOKUP")
