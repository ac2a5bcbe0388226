"""Set-up refusals (docs/protocol.md §3, §6, §8): every control plane refuses the same
descriptions, before any packet, with a message that says what to change."""
import dataclasses

import pytest

from dataplane.config import ConfigError, Dlcp, default_thresholds
from .scenario import make_config, make_job


def thresholds_with(queue: int, value: int) -> tuple:
    k = list(default_thresholds())
    k[queue] = value
    return tuple(k)


BAD_DLCP = {
    "capacity above 2^20": (Dlcp(capacity=(1 << 20) + 1), "capacity 1048577 must be"),
    "capacity 0": (Dlcp(capacity=0), "capacity 0 must be"),
    "negative threshold": (Dlcp(thresholds=thresholds_with(6, -1)), "threshold -1 of queue 6"),
    "threshold of 2^32": (Dlcp(thresholds=thresholds_with(0, 1 << 32)),
                          "threshold 4294967296 of queue 0"),
    "seven thresholds": (Dlcp(thresholds=default_thresholds()[:7]), "need 8 thresholds"),
    "DSCP 64": (Dlcp(dscp_map={64: (1, True)}), "DSCP 64"),
}


@pytest.mark.parametrize("case", BAD_DLCP, ids=list(BAD_DLCP))
def test_dlcp_limits_are_refused(target, case):
    dlcp, words = BAD_DLCP[case]
    with pytest.raises(ConfigError, match=words):
        target.start(make_config(make_job(1, 2), dlcp=dlcp))


def test_members_sharing_an_address_are_refused(target):
    job = make_job(1, 3)
    m0, m1, m2 = job.members
    twin = dataclasses.replace(m2, ip=m0.ip, udp_port=m0.udp_port, mac="02:00:00:00:77:77")
    with pytest.raises(ConfigError, match=r"workers 0 and 2 share the address 10\.0\.1\.17:41100"):
        target.start(make_config(dataclasses.replace(job, members=(m0, m1, twin))))


def test_values_per_packet_above_the_plane_limit_are_refused(target):
    limit = target.max_values
    with pytest.raises(ConfigError, match=f"limit of {limit} values per packet; "
                                          "lower values_per_packet"):
        target.start(make_config(make_job(1, 2, values_per_packet=limit + 1)))
    with pytest.raises(ConfigError, match="values_per_packet 0 must be a positive integer"):
        target.start(make_config(make_job(1, 2, values_per_packet=0)))
