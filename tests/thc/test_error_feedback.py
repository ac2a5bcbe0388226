"""Rotated-domain error feedback (ErrorFeedback(rotated=True)) against the gradient-domain
one, and the codec entry points it uses: rotate(add=, out=), rotate_and_norms,
quantize(error_out=)."""
import numpy as np
import pytest
import torch

import thc

BACKENDS = ["numpy", "cpu"]


def nmse(est, x):
    x = np.asarray(x, np.float64)
    return float(np.sum((np.asarray(est, np.float64) - x) ** 2) / np.sum(x ** 2))


def gradient_domain_round(codec, ef, g, r, key="w"):
    """One worker's call as host/allreduce.py does it today (two inverse RHTs)."""
    x = ef.compensate(key, g)
    norms = codec.partition_norms(x)
    packed = codec.quantize(codec.rotate(x), norms, worker=0, round=r, tensor=0)
    mean = codec.decode(codec.lookup(packed), 1, norms, len(g))
    ef.update(key, x, codec.inverse_rotate(codec.dequantize(packed, norms), len(g)))
    return mean


def rotated_domain_round(codec, ef, g, r, key="w"):
    """The same call with the error kept after the RHT (one inverse RHT)."""
    x_rot, norms = ef.rotate(codec, key, g)
    packed = ef.quantize(codec, key, x_rot, norms, worker=0, round=r, tensor=0)
    return codec.decode(codec.lookup(packed), 1, norms, len(g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotate_add_out_and_norms(backend):
    rs = np.random.default_rng(10)
    codec = thc.THCCodec(partition_size=256, backend=backend)
    x = rs.standard_normal(700).astype(np.float32)
    padded = codec.padded_length(700)
    e = rs.standard_normal(padded).astype(np.float32)
    plain = codec.rotate(x)
    out = np.full(padded, np.nan, np.float32)
    got = codec.rotate(x, out=out, add=e)
    assert got is out
    np.testing.assert_array_equal(out, plain + e)        # the add is one float add
    rotated, norms = codec.rotate_and_norms(x)
    np.testing.assert_array_equal(rotated, plain)
    # the RHT keeps each partition's norm
    np.testing.assert_allclose(norms, codec.partition_norms(x), rtol=1e-5)
    _, norms_e = codec.rotate_and_norms(x, add=e)
    np.testing.assert_allclose(norms_e, codec.partition_norms(plain + e), rtol=1e-5)
    with pytest.raises(ValueError, match="contiguous float32 buffer of 768"):
        codec.rotate(x, out=np.empty(700, np.float32))
    with pytest.raises(ValueError, match="add"):
        codec.rotate(x, add=np.empty(padded, np.float64))
    bad = x.copy()
    bad[3] = np.nan
    with pytest.raises(thc.NonFiniteError):
        codec.rotate_and_norms(bad)


def test_rotate_torch_out_is_written_in_place():
    codec = thc.THCCodec(partition_size=256)
    x = torch.randn(300)
    out = torch.empty(codec.padded_length(300))
    e = torch.randn(codec.padded_length(300))
    got, norms = codec.rotate_and_norms(x, out=out, add=e)
    assert got is out
    torch.testing.assert_close(out, codec.rotate(x) + e, rtol=0, atol=0)
    assert norms.dtype == np.float32 and norms.shape == (2,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_error_out_is_own_quantization_error(backend):
    rs = np.random.default_rng(11)
    codec = thc.THCCodec(partition_size=128, backend=backend)
    rot = codec.rotate(rs.standard_normal(1000).astype(np.float32))
    norms = codec.partition_norms(rot) * np.float32(0.8)        # some values are clamped
    err = np.empty_like(rot)
    packed = codec.quantize(rot, norms, worker=2, round=3, tensor=4, error_out=err)
    np.testing.assert_array_equal(packed, codec.quantize(rot, norms, worker=2, round=3,
                                                         tensor=4))
    np.testing.assert_array_equal(err, rot - codec.dequantize(packed, norms))
    # the error buffer may be the one just added by rotate (it is consumed first)
    same = rot.copy()
    codec.quantize(same, norms, worker=2, round=3, tensor=4, error_out=same)
    np.testing.assert_array_equal(same, err)


def test_quantize_error_out_matches_between_backends():
    """The fused CPU error equals the composed reference one, including g > 31 (gathered
    tables) and partitions smaller than one vector step."""
    rs = np.random.default_rng(12)
    for granularity, partition_size, d in ((30, 1 << 12, 9000), (51, 64, 1000), (30, 16, 90)):
        ref = thc.THCCodec(granularity=granularity, partition_size=partition_size,
                           backend="numpy")
        cpu = thc.THCCodec(granularity=granularity, partition_size=partition_size,
                           backend="cpu")
        rot = ref.rotate(rs.standard_normal(d).astype(np.float32))
        norms = ref.partition_norms(rot)
        errs = []
        for codec in (ref, cpu):
            err = np.empty_like(rot)
            packed = codec.quantize(rot, norms, worker=1, round=7, tensor=0, error_out=err)
            errs.append((packed, err))
        np.testing.assert_array_equal(errs[0][0], errs[1][0])
        np.testing.assert_array_equal(errs[0][1], errs[1][1])


def test_rotated_feedback_follows_gradient_feedback_round_by_round():
    """No padding, same keys: the two domains make the same rounding choices except where
    float rounding differs by an ulp near a bracket, so almost every decoded value agrees."""
    rs = np.random.default_rng(13)
    d = 1 << 12
    codec = thc.THCCodec(partition_size=1 << 10)
    g = (rs.standard_normal(d) * rs.lognormal(size=d)).astype(np.float32)
    grad_ef, rot_ef = thc.ErrorFeedback(), thc.ErrorFeedback(rotated=True)
    close = []
    for r in range(20):
        a = gradient_domain_round(codec, grad_ef, g, r)
        b = rotated_domain_round(codec, rot_ef, g, r)
        close.append(np.mean(np.abs(a - b) <= 1e-4 * np.abs(g).max()))
        # and the stored errors are the same feedback, one in each domain
        np.testing.assert_allclose(codec.rotate(grad_ef.error("w")), rot_ef.error("w"),
                                   atol=2e-4 * np.abs(g).max())
    assert min(close) > 0.999


@pytest.mark.parametrize("d", [1 << 12, 3000])          # 3000: a padded tail partition
def test_rotated_feedback_same_statistics(d):
    """Unbiased over calls and a bounded error, like the gradient-domain feedback: the
    running mean of what was sent tracks the gradient far better than without feedback,
    and the stored error levels off at the gradient-domain error's size (the padding
    coordinates of a tail partition add a little)."""
    rs = np.random.default_rng(14)
    codec = thc.THCCodec(partition_size=1 << 10)
    g = (rs.standard_normal(d) * rs.lognormal(size=d)).astype(np.float32)
    rounds = 100
    plain, grad_sum, rot_sum = np.zeros(d), np.zeros(d), np.zeros(d)
    grad_ef, rot_ef = thc.ErrorFeedback(), thc.ErrorFeedback(rotated=True)
    grad_norms, rot_norms = [], []
    for r in range(rounds):
        plain += codec.simulate_allreduce([g], round=r)
        grad_sum += gradient_domain_round(codec, grad_ef, g, r)
        rot_sum += rotated_domain_round(codec, rot_ef, g, r)
        grad_norms.append(np.linalg.norm(grad_ef.error("w")))
        rot_norms.append(np.linalg.norm(rot_ef.error("w")))
    target = g.astype(np.float64) * rounds
    plain_err, grad_err, rot_err = (nmse(s, target) for s in (plain, grad_sum, rot_sum))
    print(f"NMSE of the running sum: no feedback {plain_err:.2e}, gradient domain "
          f"{grad_err:.2e}, rotated domain {rot_err:.2e}; error norms at rounds 10/50/100: "
          f"gradient {grad_norms[9]:.3g}/{grad_norms[49]:.3g}/{grad_norms[-1]:.3g}, rotated "
          f"{rot_norms[9]:.3g}/{rot_norms[49]:.3g}/{rot_norms[-1]:.3g}, |g| "
          f"{np.linalg.norm(g):.3g}")
    assert grad_err < 0.05 * plain_err
    assert rot_err < 0.05 * plain_err
    assert rot_err < 2 * grad_err and grad_err < 2 * rot_err
    ratio = np.asarray(rot_norms) / np.asarray(grad_norms)
    assert ratio.max() < 1.2 and ratio.min() > 0.9
    assert np.mean(rot_norms[-10:]) < 1.15 * np.mean(rot_norms[40:50])     # levels off
    assert rot_norms[-1] < 1.2 * np.linalg.norm(g)


def test_rotated_feedback_reuses_its_buffers_and_refuses_misuse():
    codec = thc.THCCodec(partition_size=256)
    ef = thc.ErrorFeedback(rotated=True)
    g = np.ones(300, np.float32)
    x_rot, norms = ef.rotate(codec, "w", g)
    ef.quantize(codec, "w", x_rot, norms, worker=0, round=0, tensor=0)
    e = ef.error("w")
    x_rot2, _ = ef.rotate(codec, "w", g)
    assert x_rot2 is x_rot                                # no new allocation per call
    ef.quantize(codec, "w", x_rot2, norms, worker=0, round=1, tensor=0)
    assert ef.error("w") is e
    with pytest.raises(ValueError, match="reset the key"):
        ef.rotate(codec, "w", np.ones(2000, np.float32))
    ef.reset("w")
    assert ef.error("w") is None
    ef.rotate(codec, "w", np.ones(2000, np.float32))
    with pytest.raises(TypeError, match="rotated domain"):
        ef.compensate("w", g)
    with pytest.raises(TypeError, match="gradient domain"):
        thc.ErrorFeedback().rotate(codec, "w", g)


def test_rotated_feedback_with_torch_tensors():
    codec = thc.THCCodec(partition_size=256)
    ef = thc.ErrorFeedback(rotated=True)
    g = torch.randn(500)
    for r in range(3):
        x_rot, norms = ef.rotate(codec, 0, g)
        packed = ef.quantize(codec, 0, x_rot, norms, worker=0, round=r, tensor=0)
        mean = codec.decode(codec.lookup(packed).int(), 1, norms, 500)
    assert isinstance(x_rot, torch.Tensor) and isinstance(ef.error(0), torch.Tensor)
    assert isinstance(mean, torch.Tensor) and nmse(mean.numpy(), g.numpy()) < 0.1
