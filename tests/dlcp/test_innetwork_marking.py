"""DLCP importance on THC traffic: per RHT partition, decided by the rotation-invariant norm.

On a real gradient of the main job's model (one backward pass, seconds): the per-packet
rule on rotated values marks at random, the partition rule marks half the partitions, the
ones that hold most of the gradient, and dropping the Not-ECT packets costs less decoded
error than dropping as many packets at random.
"""
import numpy as np
import pytest

import thc
from host.experiments.dlcp.innetwork import drop_experiment, main_job_gradient, marks
from host.dlcp.marking import (ECN_ECT0, ECN_NOT_ECT, DlcpPolicy, partition_importance,
                               partition_marks, partition_packet_ecn)


def test_partition_rule_marks_above_the_median_rms():
    norms = np.array([4.0, 1.0, 3.0, 2.0, 0.5])
    sizes = np.array([16, 16, 16, 16, 4])          # the short tail: RMS 0.25, not 0.125
    assert partition_importance(norms, sizes).tolist() == [True, False, True, False, False]
    assert partition_importance(np.array([0.0]), np.array([8])).tolist() == [True]
    with pytest.raises(ValueError, match="NaN"):
        partition_importance(np.array([1.0, np.nan]), np.array([4, 4]))


def test_every_packet_of_a_partition_carries_its_mark():
    important = np.array([False, True, False])
    ecn = partition_packet_ecn(important, np.array([8, 8, 4]), 4, 5)
    assert ecn.tolist() == [ECN_NOT_ECT] * 2 + [ECN_ECT0] * 2 + [ECN_NOT_ECT]
    # A packet larger than a partition is important when any partition it carries is.
    assert partition_packet_ecn(important, np.array([8, 8, 4]), 16, 2).tolist() == \
        [ECN_ECT0, ECN_NOT_ECT]


def test_the_policys_one_pass_kernel_marks_as_the_two_rules_do():
    """partition_marks (the Numba pass the policy runs per chunk) against the two numpy
    rules composed: random partitions (even, with a short tail, uneven), norms with ties
    (rounded) and zeros, packets smaller and larger than a partition; the same refusals."""
    rng = np.random.default_rng(3)
    for trial in range(600):
        n, size = int(rng.integers(1, 20)), int(rng.choice([4, 8, 64]))
        sizes = np.full(n, size, np.int64)
        if trial % 3 == 1:
            sizes[-1] = int(rng.integers(1, size + 1))
        elif trial % 3 == 2:
            sizes = rng.integers(1, 40, n)
        norms = np.round(rng.random(n), 1) * (trial % 5 != 0)
        vpp = int(rng.choice([1, 3, 4, 16, 100]))
        packets = -(-int(sizes.sum()) // vpp)
        expected = partition_packet_ecn(partition_importance(norms, sizes), sizes, vpp, packets)
        assert partition_marks(norms, sizes, vpp, packets).tolist() == expected.tolist(), \
            (norms, sizes, vpp)
    for norms, sizes, packets, match in (([1.0, np.nan], [4, 4], 2, "NaN"),
                                         ([1.0, 2.0], [4, 0], 1, "positive"),
                                         ([1.0, 2.0], [4, 4], 3, "need more")):
        with pytest.raises(ValueError, match=match):
            partition_marks(np.array(norms), np.array(sizes), 4, packets)


def test_policy_uses_partitions_on_thc_traffic_and_packets_on_fp32():
    policy = DlcpPolicy()
    values = np.concatenate([np.full(8, 5.0), np.full(8, 0.1)]).astype(np.float32)
    kw = dict(layer=0, num_layers=1, values=values, values_per_packet=4, num_packets=4)
    _, per_packet = policy(**kw)
    assert per_packet.tolist() == [ECN_ECT0] * 2 + [ECN_NOT_ECT] * 2
    _, per_partition = policy(**kw, partition_norms=np.array([0.1, 9.0]),
                              partition_sizes=np.array([8, 8]))
    assert per_partition.tolist() == [ECN_NOT_ECT] * 2 + [ECN_ECT0] * 2


@pytest.fixture(scope="module")
def gradient():
    return main_job_gradient(hidden=256, seed=0)


def test_partition_marks_mean_something_on_the_main_jobs_gradient(gradient):
    for size in (1 << 12, 1 << 14):
        m = marks(gradient, thc.THCCodec(seed=0, partition_size=size), values_per_packet=1024)
        # The rule's intent: the partitions above the median, i.e. half of them (+-1) ...
        assert abs(m["partition_important"].sum() - m["partitions"] // 2) <= 1
        # ... and they hold most of the gradient's energy.
        assert m["energy_important"] > 0.7
    # The per-packet rule on rotated values: with several packets per partition it marks
    # (nearly) everything ECT, so a DLCP switch has nothing to drop selectively.
    assert m["packets_ect_rotated_rule"] > 0.95


def test_selective_drops_cost_less_than_random_drops(gradient):
    codec = thc.THCCodec(seed=0, partition_size=1 << 12)
    res = drop_experiment(gradient, codec, values_per_packet=1024, drop_fraction=0.2,
                          trials=4)
    assert res["selective_nmse"] < 0.75 * res["random_nmse"], res
    assert res["lossless_nmse"] < res["selective_nmse"]
