"""The DDP hook marks its packets with DLCP by default: front buckets in higher bands."""
import socket
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

import thc
from dataplane.config import SwitchConfig, band_to_dscp
from host.ddp_hook import thc_hook_state
from host.dlcp import DlcpPolicy, layer_band
from host.packets import HEADER_LEN, TYPE_DATA, decode_headers, encode_results, header_types
from host.transport import default_policy
from hosttest_util import FakeAggregatorSocket, free_port

VALUES_PER_PACKET = 64
TABLE = thc.THCCodec().table.astype(np.uint8)


class OneWorkerAggregator:
    """A one-member aggregator that records the ToS byte of every datagram it receives.

    The real aggregators do not report ToS, so this one answers each DATA packet with the
    RESULT protocol.md §4 gives for a single contributor: the table values of its indices.
    """

    def __init__(self):
        self.socket = FakeAggregatorSocket()
        self.socket.sock.settimeout(0.2)     # the serve loop polls its stop flag
        self.address = self.socket.address
        self.marks = []                      # (tensor, offset, dscp, ecn) of DATA packets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                data, tos, source = self.socket.recv()
            except socket.timeout:
                continue
            hdr = decode_headers([data])
            if header_types(hdr)[0] != TYPE_DATA:
                continue                     # FLUSH at start: no reply
            h = hdr[0]
            nv = int(h["num_values"])
            packed = np.frombuffer(data, np.uint8, offset=HEADER_LEN)
            idx = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)[:nv]
            self.marks.append((int(h["tensor"]), int(h["offset"]), tos >> 2, tos & 3))
            bufs, lens = encode_results(TABLE[idx], nv, nv, job=int(h["job"]), worker=0,
                                        tensor=int(h["tensor"]), slots=int(h["slot"]),
                                        rounds=int(h["round"]), expected=int(h["expected"]),
                                        contributors=1, count=1,
                                        first_offset=int(h["offset"]))
            self.socket.sock.sendto(bufs[0, :lens[0]].tobytes(), source)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.socket.sock.close()


@pytest.fixture
def one_worker_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    agg = OneWorkerAggregator()
    yield agg
    agg.close()
    dist.destroy_process_group()


def one_member_job() -> SwitchConfig:
    """The job description the worker takes its settings from: job 3, one member."""
    return SwitchConfig.local(addresses=[("127.0.0.1", free_port())], job=3, pool_size=8,
                              values_per_packet=VALUES_PER_PACKET)


def two_steps(state, sizes=(3000, 5000)):
    """Two DDP-like steps over buckets 0 and 1 (DDP's order: bucket 0 holds the last layers)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for key, size in enumerate(sizes):
            state.reduce(torch.randn(size, generator=gen), key)


def test_hook_marks_front_buckets_in_higher_bands_by_default(one_worker_group):
    agg = one_worker_group
    state = thc_hook_state(aggregator=agg.address, job_config=one_member_job(), job=3,
                           pool_size=8,
                           values_per_packet=VALUES_PER_PACKET, timeout=10)
    assert isinstance(state.allreduce.exchange.transport.policy, DlcpPolicy)
    two_steps(state)
    # Second step: 2 buckets known; bucket 1 holds the front layers (layer 0), bucket 0 the
    # back layers (layer 1 of 2).
    # The exchange is synchronous, so the marks come in runs per bucket: 0, 1, 0, 1.
    runs = [[agg.marks[0]]]
    for mark in agg.marks[1:]:
        if mark[0] == runs[-1][-1][0]:
            runs[-1].append(mark)
        else:
            runs.append([mark])
    assert [run[0][0] for run in runs] == [0, 1, 0, 1]
    dscp_by_tensor = {run[0][0]: {d for _, _, d, _ in run} for run in runs[2:]}
    assert dscp_by_tensor[1] == {band_to_dscp(layer_band(0, 2))}
    assert dscp_by_tensor[0] == {band_to_dscp(layer_band(1, 2))}
    assert band_to_dscp(layer_band(1, 2)) != band_to_dscp(layer_band(0, 2))
    # Importance marks are DLCP's: ECT(0) or Not-ECT, never CE from a host.
    assert {e for *_, e in agg.marks} <= {0, 2}


def test_hook_marking_can_be_turned_off(one_worker_group):
    agg = one_worker_group
    state = thc_hook_state(aggregator=agg.address, job_config=one_member_job(), job=3,
                           pool_size=8,
                           values_per_packet=VALUES_PER_PACKET, timeout=10,
                           policy=default_policy)
    two_steps(state)
    assert agg.marks and {(d, e) for *_, d, e in agg.marks} == {(0, 0)}


def test_hook_marks_whole_rht_partitions_by_their_norm(one_worker_group):
    """On the wire: every packet of a partition above the median RMS is ECT(0), every other
    packet Not-ECT (after the RHT the packets of a partition all look alike)."""
    agg = one_worker_group
    partition = 1024
    state = thc_hook_state(aggregator=agg.address, job_config=one_member_job(), job=3,
                           pool_size=8,
                           values_per_packet=VALUES_PER_PACKET, timeout=10,
                           codec=thc.THCCodec(partition_size=partition), error_feedback=False)
    scale = np.array([1.0, 8.0, 0.5, 4.0, 2.0])            # partitions 1 and 3 important
    g = torch.randn(5 * partition, generator=torch.Generator().manual_seed(1))
    g *= torch.from_numpy(np.repeat(scale, partition)).float()
    state.reduce(g, 0)
    ecn = {off // partition: set() for _, off, _, _ in agg.marks}
    for _, off, _, e in agg.marks:
        ecn[off // partition].add(e)
    assert ecn == {0: {0}, 1: {2}, 2: {0}, 3: {2}, 4: {0}}
