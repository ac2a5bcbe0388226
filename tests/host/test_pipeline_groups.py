"""The pipelined allreduce's norm exchanges by group and its in-place rotation (one rank,
gloo, the collective's sum exchange): the same bits as each chunk coded on its own."""
import numpy as np
import pytest
import torch

import thc
from host.allreduce import (CHUNK_KEY_STRIDE, SumAllreduceExchange, THCAllreduce,
                            _norm_group_end)

from hosttest_util import one_rank_group  # noqa: F401 (fixture)

PARTITION = 1 << 10
PIPELINE = 1 << 12
D = 7 * PIPELINE - 300          # 7 chunks, the last one padded
CALLS = 3


def _groups(n):
    out, start = [], 0
    while start < n:
        end = _norm_group_end(start, n)
        out.append((start, end))
        start = end
    return out


def test_norm_groups_double_after_chunk_zero():
    assert _groups(1) == [(0, 1)]
    assert _groups(2) == [(0, 1), (1, 2)]
    assert _groups(4) == [(0, 1), (1, 2), (2, 4)]
    assert _groups(7) == [(0, 1), (1, 2), (2, 4), (4, 7)]
    assert _groups(16) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16)]


def _simulate(codec, xs, ranges, key):
    """One worker, rotated-domain error feedback, each chunk coded on its own with a fresh
    rotation buffer: the means of the calls and the error after each."""
    padded = np.cumsum([0] + [codec.padded_length(hi - lo) for lo, hi in ranges])
    e = np.zeros(int(padded[-1]), np.float32)
    means, errors = [], []
    for rnd, x in enumerate(xs):
        mean = np.empty(len(x), np.float32)
        for k, (lo, hi) in enumerate(ranges):
            err = e[padded[k]:padded[k + 1]]
            rotated, norms = codec.rotate_and_norms(x[lo:hi], add=err)
            assert not np.shares_memory(rotated, err)
            packed = codec.quantize(rotated, norms, worker=0, round=rnd,
                                    tensor=key + k * CHUNK_KEY_STRIDE, error_out=err)
            mean[lo:hi] = codec.decode(codec.lookup(packed), 1, norms, hi - lo)
        means.append(mean)
        errors.append(e.copy())
    return means, errors


def _counting(monkeypatch, ar):
    """dtype of every MAX exchange of ar (norm exchanges are float32; control, float64),
    whichever channel carries it."""
    seen = []
    original = ar._max_exchange

    def counted(vector):
        seen.append(vector.dtype)
        return original(vector)
    monkeypatch.setattr(ar, "_max_exchange", counted)
    return seen


def test_grouped_in_place_pipeline_gives_the_bits_of_chunks_coded_alone(one_rank_group,
                                                                        monkeypatch):
    codec = thc.THCCodec(seed=3, partition_size=PARTITION)
    ar = THCAllreduce(codec, SumAllreduceExchange(codec), pipeline_values=PIPELINE)
    ranges = ar.chunk_ranges(D)
    assert len(ranges) == 7
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(D).astype(np.float32) for _ in range(CALLS)]
    expected_means, expected_errors = _simulate(codec, xs, ranges, key=4)

    rotations = []
    rotate = codec.rotate_and_norms

    def recorded(x, *args, out=None, add=None, **kwargs):
        rotations.append(out is not None and np.shares_memory(np.asarray(out),
                                                               np.asarray(add)))
        return rotate(x, *args, out=out, add=add, **kwargs)
    monkeypatch.setattr(codec, "rotate_and_norms", recorded)
    exchanges = _counting(monkeypatch, ar)
    for rnd, x in enumerate(xs):
        rotations.clear()
        exchanges.clear()
        mean = ar(torch.from_numpy(x), 4).numpy()
        assert np.array_equal(mean, expected_means[rnd]), rnd
        assert np.array_equal(ar.error_feedback.error(4).numpy(), expected_errors[rnd]), rnd
        # Norms in 4 groups (chunk 0; 1; 2-3; 4-6). From the second call on, chunk 0's
        # ride the control exchange and it is rotated into a buffer of its own (the
        # exchange may refuse the call); every later chunk into its error slice.
        norm_exchanges = exchanges.count(torch.float32)
        if rnd == 0:
            assert norm_exchanges == 4 and rotations == [True] * 7
        else:
            assert norm_exchanges == 3 and rotations == [False] + [True] * 6


def test_a_refused_call_leaves_the_error_feedback_as_it_was(one_rank_group):
    codec = thc.THCCodec(seed=3, partition_size=PARTITION)
    ar = THCAllreduce(codec, SumAllreduceExchange(codec), pipeline_values=PIPELINE)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(D).astype(np.float32) for _ in range(2)]
    ar(torch.from_numpy(xs[0]), 0)
    before = ar.error_feedback.error(0).numpy().copy()
    bad = xs[1].copy()
    bad[5 * PIPELINE + 7] = np.nan
    with pytest.raises(Exception, match="NaN"):
        ar(torch.from_numpy(bad), 0)
    assert np.array_equal(ar.error_feedback.error(0).numpy(), before)
    # and the next call goes on from it, as if the refused one had not happened
    means, _ = _simulate(codec, [xs[0], xs[1]], ar.chunk_ranges(D), key=0)
    assert np.array_equal(ar(torch.from_numpy(xs[1]), 0).numpy(), means[1])


def test_a_stream_that_reads_rotated_values_gets_them_in_buffers_of_their_own(one_rank_group):
    codec = thc.THCCodec(seed=3, partition_size=PARTITION)
    ar = THCAllreduce(codec, SumAllreduceExchange(codec), pipeline_values=PIPELINE)
    flat = torch.zeros(D)

    class Reads:
        reads_rotated = True
    assert ar._rotates_in_place(object(), flat)
    assert not ar._rotates_in_place(Reads(), flat)


@pytest.mark.parametrize("kind", ["gradient", "none"])
def test_without_in_place_rotation_each_chunk_has_its_own_exchange(one_rank_group, monkeypatch,
                                                                     kind):
    """Gradient-domain or no error feedback: the rotations need buffers of their own, so
    a group would hold several at once; the norms go chunk by chunk, as the memory allows."""
    codec = thc.THCCodec(seed=3, partition_size=PARTITION)
    options = ({"error_domain": "gradient"} if kind == "gradient"
               else {"error_feedback": False})
    ar = THCAllreduce(codec, SumAllreduceExchange(codec), pipeline_values=PIPELINE,
                      **options)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal(D).astype(np.float32))
    ar(x, 0)
    exchanges = _counting(monkeypatch, ar)
    ar(x, 0)
    assert exchanges.count(torch.float32) == 6          # chunks 1..6, chunk 0 in control
