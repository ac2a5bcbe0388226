"""Building blocks of packet scenarios: a topology, frame builders, output checks.

A scenario is written once: frames in on ports, then the frames expected out on ports
and the counters expected, checked the same way on every target.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dataplane.config import (CONTROL_DSCP, Dlcp, Job, Member, SwitchConfig, band_to_dscp,
                              default_thresholds)
from dataplane.reference import GLOBAL_COUNTERS, JOB_COUNTERS
from host.packets import (AGG_PORT_BASE, HEADER_DTYPE, TYPE_DATA, TYPE_FLUSH, TYPE_RESULT,
                          VERSION, encode_data, encode_headers, parse_frame, wrap_frames)

# Strictly increasing from 0; 8 workers x 30 = 240 fits the 8-bit lanes.
TABLE = (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 24, 27, 30)
# Values per packet of the scenarios' jobs: within every plane's limit (BMv2: 64).
SCENARIO_VPP = 64
SWITCH_MAC, SWITCH_IP = "02:00:00:00:00:fe", "10.0.0.254"
ECN_NOT_ECT, ECN_ECT1, ECN_ECT0, ECN_CE = 0, 1, 2, 3


def member(worker: int, port: int, job: int = 1) -> Member:
    host = 16 * job + worker + 1
    return Member(worker, port, f"02:00:00:00:{job:02x}:{worker + 1:02x}", f"10.0.{job}.{host}",
                  41000 + 100 * job + worker)


def make_job(job: int, n_workers: int, pool_size: int = 16, first_port: int = 0,
             ports=None, values_per_packet: int = SCENARIO_VPP) -> Job:
    ports = ports or [first_port + w for w in range(n_workers)]
    return Job(job, pool_size, TABLE, tuple(member(w, ports[w], job) for w in range(n_workers)),
               values_per_packet)


def make_config(*jobs: Job, dlcp: Dlcp | None = None, routes=()) -> SwitchConfig:
    return SwitchConfig(SWITCH_MAC, SWITCH_IP, tuple(jobs), dlcp or Dlcp(), tuple(routes))


def small_dlcp(threshold: int = 2, capacity: int = 6) -> Dlcp:
    """Small thresholds so queue build-up needs only a few packets: K[6-b] = 2(1+b/2)."""
    return Dlcp(thresholds=default_thresholds(threshold, 0.5), capacity=capacity)


def vpp_for(target) -> int:
    return min(SCENARIO_VPP, target.max_values)


def pack(idx) -> np.ndarray:
    idx = np.asarray(idx, dtype=np.uint8)
    padded = np.zeros(len(idx) + len(idx) % 2, dtype=np.uint8)
    padded[:len(idx)] = idx
    return (padded[0::2] << 4) | padded[1::2]


def tos_of(band: int | None = None, ecn: int = ECN_ECT0, dscp: int | None = None) -> int:
    if dscp is None:
        dscp = CONTROL_DSCP if band is None else band_to_dscp(band)
    return dscp << 2 | ecn


def data_frames(m: Member, idx, *, job: int, slot: int = 0, round_: int = 0, expected: int,
                vpp: int, min_count: int = 0, tensor: int = 7, offset: int = 0, flags: int = 0,
                tos: int = 0) -> list[tuple[int, bytes]]:
    """The DATA frames of one worker's values, consecutive slots from `slot`."""
    idx = np.asarray(idx)
    n_pkts = -(-len(idx) // vpp)
    bufs, lengths = encode_data(pack(idx), len(idx), vpp, job=job, worker=m.worker,
                                tensor=tensor, slots=slot + np.arange(n_pkts), rounds=round_,
                                expected=expected, min_count=min_count, flags=flags,
                                first_offset=offset)
    frames = wrap_frames(bufs, lengths, src_mac=m.mac, dst_mac=SWITCH_MAC, src_ip=m.ip,
                         dst_ip=SWITCH_IP, sport=m.udp_port, dport=AGG_PORT_BASE, tos=tos)
    return [(m.port, f) for f in frames]


def raw_frame(m: Member, agg: bytes, *, tos: int = 0, dport: int = AGG_PORT_BASE) -> tuple[int, bytes]:
    """A frame around arbitrary AGG bytes (for malformed input)."""
    buf = np.frombuffer(agg, dtype=np.uint8).reshape(1, -1) if agg else np.zeros((1, 0), np.uint8)
    frame = wrap_frames(buf, [len(agg)], src_mac=m.mac, dst_mac=SWITCH_MAC, src_ip=m.ip,
                        dst_ip=SWITCH_IP, sport=m.udp_port, dport=dport, tos=tos)[0]
    return m.port, frame


def header_bytes(**fields) -> bytes:
    """A 32-byte AGG header; `type`/`version` set ver_type, the rest by protocol name."""
    hdr = np.zeros(1, dtype=HEADER_DTYPE)
    hdr["ver_type"] = (fields.pop("version", VERSION) << 4) | fields.pop("type", TYPE_DATA)
    for name, value in fields.items():
        hdr[name] = value
    return encode_headers(hdr)[0].tobytes()


def flush_frame(m: Member, *, job: int, slot: int) -> tuple[int, bytes]:
    return raw_frame(m, header_bytes(type=TYPE_FLUSH, job=job, slot=slot, worker=m.worker))


def sums_of(idx_rows) -> np.ndarray:
    return np.asarray(TABLE)[np.asarray(idx_rows)].sum(axis=0).astype(np.uint8)


@dataclass
class Out:
    port: int
    frame: bytes

    def __post_init__(self):
        self.p = parse_frame(self.frame)

    @property
    def type(self) -> int:
        return self.p.ptype

    def __getattr__(self, name):
        p = self.__dict__["p"]
        if name in HEADER_DTYPE.names:
            return int(p.header[name])
        return getattr(p, name)

    @property
    def values(self) -> np.ndarray:
        return np.frombuffer(self.p.payload, dtype=np.uint8)


def outputs(frames) -> list[Out]:
    return [Out(port, frame) for port, frame in frames]


def check_emitted(o: Out, m: Member, tos: int | None = None) -> None:
    """The addressing every emitted packet carries (docs/protocol.md §5)."""
    p = o.p
    assert o.port == m.port, f"sent out of port {o.port}, member {m.worker} is on {m.port}"
    assert (p.eth_src, p.eth_dst) == (SWITCH_MAC, m.mac)
    assert (p.ip_src, p.ip_dst) == (SWITCH_IP, m.ip)
    assert p.ihl == 5 and p.ttl == 64 and p.ip_id == 0 and p.ip_flags_frag == 0x4000
    assert p.ip_checksum_ok, "IPv4 header checksum invalid"
    assert (p.sport, p.dport, p.udp_checksum) == (AGG_PORT_BASE, m.udp_port, 0)
    assert p.ip_len == 20 + p.udp_len and p.udp_len == 8 + 32 + len(p.payload)
    assert len(o.frame) >= 34 + p.udp_len
    if tos is not None:
        assert p.tos == tos


def check_result(o: Out, m: Member, *, job: int, slot: int, round_: int, sums, contributors: int,
                 expected: int, flags: int = 0, offset: int = 0, tensor: int = 7,
                 min_count: int = 0, tos: int | None = None) -> None:
    check_emitted(o, m, tos)
    assert o.type == TYPE_RESULT and o.ver_type >> 4 == VERSION
    assert (o.job, o.slot, o.round, o.worker) == (job, slot, round_, m.worker)
    assert o.flags == flags, f"flags {o.flags:#x} != {flags:#x}"
    assert o.contributors == contributors and o.count == bin(contributors).count("1")
    assert (o.expected, o.min_count, o.tensor, o.offset) == (expected, min_count, tensor, offset)
    assert o.num_values == len(sums) and o.reserved == 0
    np.testing.assert_array_equal(o.values, np.asarray(sums, dtype=np.uint8))


def check_counters(target, glob: dict | None = None, jobs: dict | None = None) -> None:
    """Every counter of §4.5 present, and equal to the given value or else to 0."""
    got = target.counters()
    want_global = dict.fromkeys(GLOBAL_COUNTERS, 0) | (glob or {})
    assert {k: got["global"].get(k) for k in GLOBAL_COUNTERS} == want_global
    for job, values in (jobs or {}).items():
        want = dict.fromkeys(JOB_COUNTERS, 0) | values
        assert {k: got["jobs"][job].get(k) for k in JOB_COUNTERS} == want, f"job {job}"

