"""k-of-n partial aggregation on the main job's model: real codec, reference aggregator rule."""
import numpy as np
import pytest

import thc
from host.experiments.adapcc.partial_training import InProcessAggregator, _thc_step, summarize, train

N, G = 6, 30


def test_aggregator_completes_at_the_kth_contributor():
    codec = thc.THCCodec(granularity=G, seed=1)
    rng = np.random.default_rng(0)
    d = 2500                                  # 3 chunks of 1024, the last one short
    packed = {w: pack(rng.integers(0, 16, d).astype(np.uint8)) for w in range(N)}
    agg = InProcessAggregator(N, 4, codec.table)
    order = [4, 1, 5, 0, 2, 3]
    for k, tensor in ((4, 0), (6, 1), (1, 2)):
        sums, counts, late = agg.aggregate(packed, order, d, tensor=tensor, min_count=k)
        want = np.sum([codec.table[unpack(packed[w], d)] for w in order[:k]], axis=0)
        assert np.array_equal(sums.astype(np.int64), want)
        assert counts.tolist() == [k] * 3
        assert late == (N - k) * 3            # every later worker got a LATE re-serve
    assert agg.slot_rounds.tolist() == [3, 3, 3, 0]
    c = agg.switch.counters()["jobs"][1]
    assert c["results_multicast"] == 9 and c["drop_bad_expected"] == 0


def test_thc_step_decodes_the_mean_of_the_first_k_workers():
    codec = thc.THCCodec(granularity=G, seed=2, partition_size=1 << 12)
    rng = np.random.default_rng(1)
    d = 3000
    grads = [rng.normal(w, 1.0, d).astype(np.float32) for w in range(N)]   # worker w: mean w
    order = np.array([5, 2, 0, 4, 1, 3])
    agg = InProcessAggregator(N, 4, codec.table)
    feedback = [thc.ErrorFeedback() for _ in range(N)]
    mean, late = _thc_step(codec, agg, feedback, grads, order, 3, 0, d)
    first_k = np.mean([grads[w] for w in order[:3]], axis=0)               # mean 7/3
    assert abs(float(mean.mean()) - first_k.mean()) < 0.1
    assert abs(float(mean.mean()) - np.mean(grads)) > 0.1                   # not all 6 (2.5)
    assert np.linalg.norm(mean - first_k) / np.linalg.norm(first_k) < 0.5
    assert late > 0
    assert feedback[3].error(0) is None and feedback[5].error(0) is not None  # late: untouched


@pytest.fixture
def one_torch_thread():
    import torch
    saved = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny matrices: threads only contend on a loaded host
    yield
    torch.set_num_threads(saved)


def test_short_training_runs_learn(one_torch_thread):
    kw = dict(workers=4, steps=25, hidden=32, batch=16, lr=0.1, granularity=G, eval_every=5)
    runs = [train(f, 0, **kw) for f in (None, 0.5)]
    for r in runs:
        assert r["log"]["train_loss"][-1] < 0.7 * r["log"]["train_loss"][0]
        assert r["final_test_acc"] > 0.5                     # 10 classes: chance is 0.1
    assert runs[1]["k"] == 2 and runs[1]["late_replies"] > 0
    rows = summarize(runs, (1.0, 0.5))
    assert [(r["stragglers"], r["fraction"]) for r in rows] == [("none", None), ("iid", 0.5)]


def pack(idx):
    if len(idx) % 2:
        idx = np.concatenate([idx, np.zeros(1, np.uint8)])
    return ((idx[0::2] << 4) | idx[1::2]).astype(np.uint8)


def unpack(packed, d):
    out = np.empty(2 * len(packed), np.int64)
    out[0::2], out[1::2] = packed >> 4, packed & 15
    return out[:d]
