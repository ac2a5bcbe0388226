import numpy as np
import pytest
import torch

import thc
from thc import reference
from thc.tables import expected_nmse

BACKENDS = ["numpy", "cpu"]


def nmse(est, x):
    x = np.asarray(x, np.float64)
    return float(np.sum((np.asarray(est, np.float64) - x) ** 2) / np.sum(x ** 2))


@pytest.fixture(scope="module")
def rs():
    return np.random.default_rng(2)


def compress_workers(codec, grads, round=0, tensor=0):
    norms = np.max([codec.partition_norms(g) for g in grads], axis=0)
    packed = [codec.compress(g, norms, worker=w, round=round, tensor=tensor)
              for w, g in enumerate(grads)]
    return norms, packed


@pytest.mark.parametrize("backend", BACKENDS)
def test_homomorphism_exact(backend, rs):
    codec = thc.THCCodec(partition_size=512, backend=backend)
    d, n = 1300, 7
    grads = [rs.standard_normal(d).astype(np.float32) * (w + 1) for w in range(n)]
    norms, packed = compress_workers(codec, grads)
    values = [codec.lookup(p).astype(np.int64) for p in packed]
    total = np.sum(values, axis=0)
    assert total.max() <= n * codec.granularity
    # exact in float64 on the affine map (rotated domain)
    lay = codec.layout(d)
    part = np.arange(lay.padded) // lay.partition_size
    half = (codec.t_p * norms.astype(np.float64) / np.sqrt(lay.sizes()))[part]
    step = 2 * half / codec.granularity
    mean_of_decodes = np.mean([-half + v * step for v in values], axis=0)
    decode_of_sum = -half + (total / n) * step
    np.testing.assert_allclose(decode_of_sum, mean_of_decodes, rtol=0, atol=1e-9)
    # and through the codec (float32 + inverse RHT)
    full = codec.decode(total, n, norms, d)
    singles = np.mean([codec.decode(v, 1, norms, d) for v in values], axis=0)
    np.testing.assert_allclose(full, singles, atol=2e-5 * np.abs(singles).max())


def test_cpu_quantizer_bit_identical_to_reference(rs):
    ref = thc.THCCodec(partition_size=256, backend="numpy")
    cpu = thc.THCCodec(partition_size=256, backend="cpu")
    x = rs.standard_normal(1000).astype(np.float32)
    r = ref.rotate(x)
    norms = ref.partition_norms(x) * np.float32(0.9)     # some values get clamped
    for w in range(3):
        a = ref.quantize(r, norms, worker=w, round=5, tensor=2)
        b = cpu.quantize(r, norms, worker=w, round=5, tensor=2)
        assert a.dtype == np.uint8 and np.array_equal(a, b)
    assert np.array_equal(ref.lookup(a), cpu.lookup(a))
    s = ref.lookup(a).astype(np.int16) * 3
    np.testing.assert_allclose(cpu.decode(s, 3, norms, 1000), ref.decode(s, 3, norms, 1000),
                               atol=1e-5)



@pytest.mark.parametrize("ps", [16, 256, 1 << 13])
def test_cpu_decode_is_the_references_bit_for_bit(ps, rs):
    """The CPU decode runs inside the inverse RHT, chunk by chunk: the same bits as the
    reference's decode then inverse RHT, for every sum width, a count per element (with
    zeros), one count (0 included), full partitions only and a padded tail."""
    ref = thc.THCCodec(partition_size=ps, backend="numpy")
    cpu = thc.THCCodec(partition_size=ps, backend="cpu")
    for d in (ps, 3 * ps, 3 * ps + 5, 600, 20001):
        padded = cpu.layout(d).padded
        norms = ref.partition_norms(rs.standard_normal(d).astype(np.float32)) * 1.3
        for dtype in (np.uint8, np.uint16, np.int32):
            sums = rs.integers(0, 61, padded).astype(dtype)
            for counts in (4, 3, 0, rs.integers(0, 5, padded)):
                want = ref.decode(sums, counts, norms, d)
                assert np.array_equal(cpu.decode(sums, counts, norms, d), want)
                out = np.full(d, np.nan, np.float32)
                assert np.array_equal(cpu.decode(sums, counts, norms, d, out=out), want)

def test_randomness_is_keyed(rs):
    codec = thc.THCCodec(partition_size=256)
    x = rs.standard_normal(512).astype(np.float32)
    r, n = codec.rotate(x), codec.partition_norms(x)
    base = codec.quantize(r, n, worker=0, round=0, tensor=0)
    assert np.array_equal(base, codec.quantize(r, n, worker=0, round=0, tensor=0))
    for kw in (dict(worker=1, round=0, tensor=0), dict(worker=0, round=1, tensor=0),
               dict(worker=0, round=0, tensor=1)):
        assert not np.array_equal(base, codec.quantize(r, n, **kw))
    other_seed = thc.THCCodec(partition_size=256, seed=1)
    assert not np.array_equal(base, other_seed.quantize(r, n, worker=0, round=0, tensor=0))


def test_packing_order_even_index_high_nibble():
    z = np.array([1, 2, 15, 0, 7, 9], dtype=np.uint8)
    packed = reference.pack(z)
    assert packed.tolist() == [0x12, 0xF0, 0x79]
    assert reference.unpack(packed).tolist() == z.tolist()
    codec = thc.THCCodec()
    assert codec.lookup(packed).tolist() == codec.table[z].tolist()


def test_known_values_quantize_to_table_points():
    codec = thc.THCCodec(partition_size=4, rotate=False)
    table, g = codec.table, codec.granularity
    # norm chosen so M = 1 for the 4-element partition: M = t_p * l / sqrt(4)
    norms = np.array([2.0 / codec.t_p], dtype=np.float32)
    points = (-1.0 + 2.0 * table / g).astype(np.float32)
    x = points[[0, 15, 7, 3]]
    packed = codec.quantize(x, norms, worker=0, round=0, tensor=0)
    assert codec.lookup(packed).tolist() == table[[0, 15, 7, 3]].tolist()
    # values beyond M clamp to the ends
    packed = codec.quantize(np.array([5, -5, 1, -1], np.float32), norms, worker=0, round=0,
                            tensor=0)
    assert codec.lookup(packed).tolist() == [g, 0, g, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbiased(backend):
    codec = thc.THCCodec(partition_size=64, rotate=False, backend=backend)
    rs = np.random.default_rng(3)
    norms = np.array([8.0], np.float32)                  # M = t_p * 8 / 8 = t_p
    x = rs.uniform(-codec.t_p, codec.t_p, 64).astype(np.float32)
    draws = 4000
    acc = np.zeros(64)
    for r in range(draws):
        acc += codec.dequantize(codec.quantize(x, norms, worker=0, round=r, tensor=0), norms)
    mean = acc / draws
    # SQ variance per coordinate <= (max gap)^2/4 in value units
    gap = np.diff(codec.table).max() * 2 * codec.t_p / codec.granularity
    tol = 5 * gap / 2 / np.sqrt(draws)
    assert np.abs(mean - x).max() < tol
    assert np.abs(mean - x).mean() < tol / 3


@pytest.mark.parametrize("copies", [1, 4])
def test_nmse_matches_analytic(copies):
    d = 1 << 16
    rs = np.random.default_rng(4)
    codec = thc.THCCodec(partition_size=d, symmetric=False)
    x = rs.standard_normal(d).astype(np.float32)
    est = codec.simulate_allreduce([x] * copies)
    assert nmse(est, x) == pytest.approx(expected_nmse(codec.table, codec.p, copies), rel=0.05)


def test_independent_workers_mean(rs):
    d, n = 1 << 14, 4
    codec = thc.THCCodec(partition_size=d)
    grads = [rs.standard_normal(d).astype(np.float32) for _ in range(n)]
    est = codec.simulate_allreduce(grads)
    assert nmse(est, np.mean(grads, axis=0)) == pytest.approx(0.0203, rel=0.15)


def test_per_element_counts_and_missing(rs):
    codec = thc.THCCodec(partition_size=64)
    d = 64
    grads = [rs.standard_normal(d).astype(np.float32) for _ in range(3)]
    norms, packed = compress_workers(codec, grads)
    values = [codec.lookup(p).astype(np.int32) for p in packed]
    counts = np.full(d, 3)
    counts[:16] = 2                      # worker 2's first 16 values lost
    total = values[0] + values[1] + values[2]
    total[:16] -= values[2][:16]
    rot = codec._decode_rotated(total, counts, norms, "sums")
    two = codec._decode_rotated(values[0] + values[1], 2, norms, "sums")
    three = codec._decode_rotated(values[0] + values[1] + values[2], 3, norms, "sums")
    np.testing.assert_allclose(rot[:16], two[:16], atol=1e-6)
    np.testing.assert_allclose(rot[16:], three[16:], atol=1e-6)
    zero = codec._decode_rotated(np.zeros(d, np.int32), np.zeros(d, np.int32), norms, "sums")
    assert np.all(zero == 0)
    with pytest.raises(ValueError, match="per-element counts"):
        codec.decode(total, np.ones(5), norms, d)


def test_guards(rs):
    codec = thc.THCCodec(partition_size=64)
    with pytest.raises(thc.LaneOverflowError, match="lower|granularity <= 28"):
        codec.check_workers(9)
    codec.check_workers(8)
    with pytest.raises(thc.LaneOverflowError):
        codec.simulate_allreduce([np.ones(8, np.float32)] * 9)
    bad = rs.standard_normal(100).astype(np.float32)
    bad[70] = np.nan
    with pytest.raises(thc.NonFiniteError, match="layer1.weight"):
        codec.partition_norms(bad, name="layer1.weight")
    r = codec.rotate(np.ones(64, np.float32))
    r[3] = np.inf
    with pytest.raises(thc.NonFiniteError, match="1 of 64"):
        codec.quantize(r, np.ones(1, np.float32), worker=0, round=0, tensor=0)
    with pytest.raises(thc.NonFiniteError):
        codec.quantize(r, np.array([np.nan], np.float32), worker=0, round=0, tensor=0)
    with pytest.raises(ValueError, match="one per partition"):
        codec.quantize(np.ones(128, np.float32), np.ones(1), worker=0, round=0, tensor=0)
    with pytest.raises(ValueError, match="padded length"):
        codec.quantize(np.ones(100, np.float32), np.ones(2), worker=0, round=0, tensor=0)
    with pytest.raises(TypeError, match="integer"):
        codec.decode(np.ones(64, np.float32), 1, np.ones(1), 64)
    assert issubclass(thc.NonFiniteError, ValueError)
    assert issubclass(thc.LaneOverflowError, ValueError)


@pytest.mark.parametrize("d", [0, 1, 2, 3, 5, 31, 33])
def test_tiny_and_odd_sizes(d, rs):
    codec = thc.THCCodec(partition_size=16)
    x = rs.standard_normal(d).astype(np.float32)
    est = codec.simulate_allreduce([x, x])
    assert est.shape == (d,) and est.dtype == np.float32
    if d:
        assert nmse(est, x) < 0.2


def test_all_zero_gradient():
    codec = thc.THCCodec(partition_size=16)
    est = codec.simulate_allreduce([np.zeros(20, np.float32)] * 3)
    assert np.all(est == 0)


def test_torch_round_trip(rs):
    codec = thc.THCCodec(partition_size=256)
    grads = [torch.from_numpy(rs.standard_normal(300).astype(np.float32)) for _ in range(2)]
    est = codec.simulate_allreduce(grads)
    assert isinstance(est, torch.Tensor) and est.shape == (300,)
    mean = (grads[0] + grads[1]) / 2
    assert nmse(est.numpy(), mean.numpy()) < 0.05
    packed = codec.compress(grads[0], codec.partition_norms(grads[0]), worker=0, round=0,
                            tensor=0)
    assert isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8


def test_error_feedback_reduces_bias():
    """With EF, the running average of decoded updates tracks the true gradient far better
    than without (the truncation bias is fed back)."""
    d, rounds = 4096, 30
    rs = np.random.default_rng(5)
    g = (rs.standard_normal(d) * rs.lognormal(size=d)).astype(np.float32)
    codec = thc.THCCodec(partition_size=d, rotate=False)
    ef = thc.ErrorFeedback()
    plain_sum = np.zeros(d)
    ef_sum = np.zeros(d)
    for r in range(rounds):
        plain_sum += codec.simulate_allreduce([g], round=r)
        x = ef.compensate("w", g)
        norms = codec.partition_norms(x)
        packed = codec.compress(x, norms, worker=0, round=r, tensor=0)
        own = codec.decode(codec.lookup(packed), 1, norms, d)
        ef.update("w", x, own)
        ef_sum += own
    target = g * rounds
    assert nmse(ef_sum, target) < 0.2 * nmse(plain_sum, target)
    assert ef.error("w") is not None
    ef.reset("w")
    assert ef.error("w") is None
    with pytest.raises(ValueError, match="shape"):
        ef.update("v", np.ones(3), np.zeros(3))
        ef.compensate("v", np.ones(4))


@pytest.mark.parametrize("partition_size", [16, 1 << 12])     # per-byte path, 32-wide path
def test_nonfinite_counted_in_every_quantizer_path(partition_size):
    codec = thc.THCCodec(partition_size=partition_size)
    r = codec.rotate(np.ones(2 * partition_size, np.float32))
    r[[1, 6, -1]] = [np.nan, np.inf, -np.inf]
    norms = np.ones(2, np.float32)
    with pytest.raises(thc.NonFiniteError, match=f"3 of {2 * partition_size}"):
        codec.quantize(r, norms, worker=0, round=0, tensor=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_and_inverse_write_into_out(backend, rs):
    codec = thc.THCCodec(partition_size=256, backend=backend)
    d = 600
    x = rs.standard_normal(d).astype(np.float32)
    norms = codec.partition_norms(x)
    sums = codec.lookup(codec.compress(x, norms, worker=0, round=0, tensor=0)).astype(np.int32)
    out = np.full(d, np.nan, np.float32)
    assert codec.decode(sums * 2, 2, norms, d, out=out) is out
    np.testing.assert_array_equal(out, codec.decode(sums * 2, 2, norms, d))
    rot = codec.rotate(x)
    assert codec.inverse_rotate(rot, d, out=out) is out
    np.testing.assert_array_equal(out, codec.inverse_rotate(rot, d))
    grad = torch.from_numpy(x.copy())              # the mean may replace the gradient
    assert codec.decode(torch.from_numpy(sums), 1, norms, d, out=grad) is grad
    with pytest.raises(ValueError, match="contiguous float32 buffer of 600"):
        codec.decode(sums, 1, norms, d, out=np.empty(d, np.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_layouts_and_constants_follow_the_call(backend, rs):
    """The codec keeps its layouts and the last max norms' constants between calls: a run
    of calls through one codec must give what a fresh codec gives for each call, also
    where only the norms change, or only the padded tail (same partition count)."""
    shared = thc.THCCodec(partition_size=256, backend=backend)
    norms_a = np.array([3.0, 2.0], np.float32)
    calls = [(256 + 10, norms_a), (256 + 100, norms_a),            # tail 16, then 128
             (256 + 100, norms_a * 2), (256 + 10, norms_a), (256 + 10, norms_a * 2)]
    for d, norms in calls:
        x = rs.standard_normal(d).astype(np.float32)
        fresh = thc.THCCodec(partition_size=256, backend=backend)
        rotated = fresh.rotate(x)
        want = fresh.quantize(rotated, norms, worker=0, round=1, tensor=2)
        got = shared.quantize(rotated, norms, worker=0, round=1, tensor=2)
        np.testing.assert_array_equal(got, want)
        sums = fresh.lookup(want).astype(np.int32) * 3
        np.testing.assert_array_equal(shared.decode(sums, 3, norms, d),
                                      fresh.decode(sums, 3, norms, d))
    assert shared.padded_length(256 + 10) == 256 + 16
    with pytest.raises(ValueError, match="tensor length must be >= 0"):
        shared.layout(-1)
