"""H1-H3: layer -> band -> DSCP -> queue, and magnitude -> ECN importance."""
import math

import numpy as np
import pytest

from dataplane.config import CONTROL_DSCP, NUM_QUEUES, Dlcp
from host.dlcp.marking import (ECN_ECT0, ECN_NOT_ECT, DlcpPolicy, layer_band, layer_dscp,
                               median_abs_estimate, packet_mean_abs, sample_size)


@pytest.mark.parametrize("num_layers", [1, 2, 3, 6, 7, 8, 13, 54, 161, 1000])
def test_h1_band_range_monotone_front_highest(num_layers):
    bands = [layer_band(x, num_layers) for x in range(num_layers)]
    assert bands[0] == 0
    assert all(0 <= b <= 6 for b in bands)
    assert all(a <= b for a, b in zip(bands, bands[1:]))
    if num_layers >= 7:
        assert bands[-1] == 6
        assert set(bands) == set(range(7))     # every band used once L >= P
    assert bands == [math.floor(x * 7 / num_layers) for x in range(num_layers)]


def test_h1_bad_layer_refused():
    with pytest.raises(ValueError, match="layer 5 outside"):
        layer_band(5, 5)
    with pytest.raises(ValueError, match="num_layers"):
        layer_band(0, 0)


def test_h2_front_layer_queue_served_before_back_and_control_on_top():
    dlcp = Dlcp()
    queues = [dlcp.classify(layer_dscp(x, 54))[0] for x in range(54)]
    assert all(dlcp.classify(layer_dscp(x, 54))[1] for x in range(54))    # data: selective drop
    # strict priority serves larger queue numbers first: front layers must not be below back ones
    assert all(a >= b for a, b in zip(queues, queues[1:]))
    assert queues[0] == 6 and queues[-1] == 0
    control_queue, control_is_data = dlcp.classify(CONTROL_DSCP)
    assert control_queue == NUM_QUEUES - 1 and not control_is_data
    assert control_queue > max(queues)
    assert sum(1 for d in range(64) if dlcp.classify(d)[0] == NUM_QUEUES - 1) == 1


def test_h3_sample_size_rule():
    assert [sample_size(n) for n in (1, 999, 1000, 1001, 1_000_000)] == [1, 1, 1, 2, 1000]


def test_h3_importance_iff_mean_above_median_exact_sample():
    rng = np.random.default_rng(1)
    vpp, n = 128, math.ceil(10_000 / 128)
    scale = np.repeat(rng.uniform(0.1, 3, n), vpp)[:10_000]      # packets differ in magnitude
    values = (rng.standard_t(3, 10_000) * scale).astype(np.float32)
    pol = DlcpPolicy(sample_fraction=1.0)        # the sample is the whole tensor: exact median
    dscp, ecn = pol(layer=0, num_layers=10, values=values, values_per_packet=vpp, num_packets=n)
    means = np.array([np.abs(values[k * vpp:(k + 1) * vpp].astype(np.float64)).mean() for k in range(n)])
    median = np.median(np.abs(values.astype(np.float64)))
    assert np.array_equal(ecn == ECN_ECT0, means > median)
    assert set(np.unique(ecn)) <= {ECN_ECT0, ECN_NOT_ECT} and 0 < (ecn == ECN_ECT0).sum() < n
    assert dscp.dtype == np.uint8 and ecn.dtype == np.uint8 and (dscp == 32).all()


def test_h3_ties_are_not_important():
    """The comparison is strict: a packet whose mean equals the median is Not-ECT."""
    values = np.full(1000, -0.5, np.float32)
    _, ecn = DlcpPolicy()(layer=0, num_layers=1, values=values, values_per_packet=100, num_packets=10)
    assert (ecn == ECN_NOT_ECT).all()


def test_h3_sampled_median_is_close_and_marks_big_packets():
    rng = np.random.default_rng(2)
    values = rng.standard_normal(2_000_000).astype(np.float32)
    est = median_abs_estimate(values, np.random.default_rng(3))
    assert abs(est - 0.6745) < 0.06                 # 2000-value sample of |N(0,1)|
    values[:350 * 50] *= 0.01                       # 50 packets of tiny gradients
    _, ecn = DlcpPolicy()(layer=3, num_layers=4, values=values, values_per_packet=350,
                           num_packets=math.ceil(values.size / 350))
    assert (ecn[:50] == ECN_NOT_ECT).all() and (ecn[50:] == ECN_ECT0).all()


def test_packet_means_partial_last_packet():
    means = packet_mean_abs(np.array([1, -3, 2, 2, -5], np.float32), 2, 3)
    assert np.allclose(means, [2, 2, 5])
    with pytest.raises(ValueError, match="make 3 packets"):
        packet_mean_abs(np.ones(5), 2, 4)


def test_policy_switches_and_bad_input():
    vals = np.arange(1, 101, dtype=np.float32)
    dscp, ecn = DlcpPolicy(enabled=False)(layer=0, num_layers=1, values=vals, values_per_packet=10, num_packets=10)
    assert (dscp == 0).all() and (ecn == ECN_NOT_ECT).all()
    dscp, ecn = DlcpPolicy(mark_importance=False)(layer=6, num_layers=7, values=vals, values_per_packet=10, num_packets=10)
    assert (dscp == 38).all() and (ecn == ECN_ECT0).all()
    vals[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        DlcpPolicy()(layer=0, num_layers=1, values=vals, values_per_packet=10, num_packets=10)
    with pytest.raises(ValueError, match="num_bands"):
        DlcpPolicy(num_bands=8)
