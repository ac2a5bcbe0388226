import numpy as np
import pytest

from thc import baselines as B


@pytest.fixture(scope="module")
def grads():
    rs = np.random.default_rng(6)
    return [rs.lognormal(size=4096).astype(np.float32) for _ in range(4)]


def test_every_compressor_runs_and_reports_bits(grads):
    mean = np.mean(grads, axis=0)
    for comp in B.default_compressors(partition_size=4096):
        est = comp.aggregate(grads)
        assert est.shape == mean.shape and est.dtype == np.float32
        assert 0 < comp.bits_up(4) <= 32 and 0 < comp.bits_down(4) <= 32
        assert np.isfinite(B.nmse(est, mean))


def test_ordering_matches_paper(grads):
    mean = np.mean(grads, axis=0)
    err = {c.name: B.nmse(c.aggregate(grads), mean) for c in B.default_compressors(4096)}
    assert err["none (fp32)"] < 1e-12
    thc_err = err["THC b=4 g=30"]
    assert thc_err < 0.03
    assert err["TernGrad"] > 50 * thc_err                     # "THC far below TernGrad"
    assert err["THC b=4 g=30 (no RHT)"] > 3 * thc_err          # rotation matters on skew
    assert err["uniform THC b=4"] > thc_err                     # the table helps


def test_unbiased_baselines_average_out():
    rs = np.random.default_rng(7)
    x = rs.standard_normal(512).astype(np.float32)
    for comp in (B.TernGrad(), B.QSGD(7, bucket=64), B.UniformTHC(4, partition_size=512)):
        acc = np.mean([comp.aggregate([x], round=r) for r in range(300)], axis=0)
        single = B.nmse(comp.aggregate([x], round=999), x)
        assert B.nmse(acc, x) < single / 30, comp.name


def test_topk_error_feedback_conserves_mass():
    rs = np.random.default_rng(8)
    x = rs.standard_normal(1000).astype(np.float32)
    comp = B.TopK(0.1)
    sent = sum(comp.aggregate([x]) for _ in range(20))
    # everything not yet sent sits in the error memory: sent + error == 20 x
    np.testing.assert_allclose(sent + comp.errors[0], 20 * x.astype(np.float64), atol=1e-3)
    comp.reset()
    assert not comp.errors


def test_bits_down_grows_with_workers():
    thc4 = B.THCCompressor(4, 30, 1 / 32, partition_size=256)
    assert thc4.bits_down(8) == 8 and thc4.bits_down(9) == 9 and thc4.bits_up(9) == 4
    lane = B.THCCompressor(4, 30, 1 / 32, partition_size=256, lane_max=255)
    from thc import LaneOverflowError
    with pytest.raises(LaneOverflowError):
        lane.aggregate([np.ones(4, np.float32)] * 9)


def test_lognormal_copies_bits_sweep():
    """THC paper, App. D.4: roughly an order of magnitude less error per extra bit."""
    rs = np.random.default_rng(9)
    x = rs.lognormal(size=1 << 14).astype(np.float32)
    errs = {}
    for bits, g in ((2, 8), (3, 20), (4, 30)):
        comp = B.THCCompressor(bits, g, 1 / 1024, partition_size=1 << 14)
        errs[bits] = B.nmse(comp.aggregate([x] * 10), x)
    assert errs[2] == pytest.approx(0.063, rel=0.15)
    assert errs[3] == pytest.approx(0.0105, rel=0.15)
    assert errs[4] == pytest.approx(0.0026, rel=0.2)
