"""Packet streams for the DPDK tests: realistic rounds, random mixes, mutated garbage.

Frames are built with scapy (Ether/IP/UDP/AggHeader, the project's layer) so the tests
do not depend on the vectorized codec they are meant to cross-check.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scapy.layers.inet import IP, UDP, IPOption_Router_Alert
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw

from dataplane.config import Dlcp, Job, Member, Route, SwitchConfig, default_thresholds
from host.packets import (AGG_FRAME_OVERHEAD, AGG_PORT_BASE, L2L4_LEN, TYPE_DATA, TYPE_FLUSH,
                          AggHeader)

SWITCH_MAC, SWITCH_IP = "02:00:00:00:00:fe", "10.0.0.254"
TABLE = (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 24, 27, 30)


def member(job: int, worker: int, port: int) -> Member:
    return Member(worker, port, f"02:00:00:00:{job:02x}:{worker + 1:02x}",
                  f"10.{job}.0.{worker + 1}", 40000 + 100 * job + worker)


def config(n_workers: int = 4, pool_size: int = 8, jobs=(1,), routes=(),
           dlcp: Dlcp | None = None) -> SwitchConfig:
    js = tuple(Job(j, pool_size, TABLE, tuple(member(j, w, w) for w in range(n_workers)))
               for j in jobs)
    return SwitchConfig(SWITCH_MAC, SWITCH_IP, js, dlcp or Dlcp(), tuple(routes))


def pack(idx) -> bytes:
    idx = np.asarray(idx, dtype=np.uint8)
    padded = np.zeros(len(idx) + len(idx) % 2, dtype=np.uint8)
    padded[:len(idx)] = idx
    return ((padded[0::2] << 4) | padded[1::2]).astype(np.uint8).tobytes()


def data_frame(m: Member, idx, *, job: int, slot: int, round_: int, expected: int,
               min_count: int = 0, tensor: int = 3, offset: int = 0, tos: int = 0x82,
               ptype: int = TYPE_DATA, flags: int = 0) -> bytes:
    payload = pack(idx) if ptype == TYPE_DATA else b""
    nv = len(idx) if ptype == TYPE_DATA else 0
    pkt = (Ether(src=m.mac, dst=SWITCH_MAC) / IP(src=m.ip, dst=SWITCH_IP, tos=tos, flags="DF")
           / UDP(sport=m.udp_port, dport=AGG_PORT_BASE, chksum=0)
           / AggHeader(type=ptype, flags=flags, job=job, slot=slot, worker=m.worker,
                       min_count=min_count, round=round_, expected=expected, tensor=tensor,
                       offset=offset, num_values=nv) / Raw(payload))
    return bytes(pkt)


def rounds_stream(cfg: SwitchConfig, n_rounds: int, values: int, rng) -> tuple[list, dict]:
    """Every member of job 1 sends every slot for n_rounds rounds (window rule kept):
    returns (frames, {(slot, round): expected sums})."""
    job = cfg.jobs[0]
    expected = job.expected_all
    frames, sums = [], {}
    for r in range(n_rounds):
        for s in range(job.pool_size):
            idx = rng.integers(0, 16, (len(job.members), values))
            sums[(s, r)] = np.asarray(TABLE)[idx].sum(axis=0).astype(np.uint8)
            for k, m in enumerate(job.members):
                frames.append((m.port, data_frame(m, idx[k], job=job.job, slot=s, round_=r,
                                                  expected=expected, tos=(32 + s % 7) << 2 | 2)))
    return frames, sums


def mutate(frame: bytes, rng) -> bytes:
    """One random corruption of a frame: flipped bytes, truncation, extension or a
    rewritten header field."""
    b = bytearray(frame)
    kind = rng.integers(0, 5)
    if kind == 0 and b:
        for _ in range(rng.integers(1, 6)):
            b[rng.integers(0, len(b))] = rng.integers(0, 256)
    elif kind == 1:
        b = b[:rng.integers(0, len(b) + 1)]
    elif kind == 2:
        b += rng.integers(0, 256, rng.integers(1, 64)).astype(np.uint8).tobytes()
    elif kind == 3 and len(b) >= AGG_FRAME_OVERHEAD:
        pos = L2L4_LEN + rng.choice([0, 1, 2, 4, 6, 7, 8, 12, 28, 29])
        b[pos] = rng.integers(0, 256)
    elif len(b) >= L2L4_LEN:
        pos = rng.choice([14, 16, 17, 23, 36, 37, 38, 39])   # IHL, lengths, proto, ports
        b[pos] = rng.integers(0, 256)
    return bytes(b)


def fragment_of(frame: bytes, rng, dst: str | None = None) -> bytes:
    """The frame as a random IPv4 fragment (first with MF, middle or last), optionally
    to another destination; the IPv4 checksum is made valid again."""
    pkt = Ether(frame)
    kind = rng.integers(0, 3)
    pkt[IP].flags = "MF" if kind < 2 else 0
    pkt[IP].frag = 0 if kind == 0 else int(rng.integers(1, 200))
    if dst is not None:
        pkt[IP].dst = dst
    del pkt[IP].chksum
    return bytes(pkt)


def with_ip_options(dst: str, src: Member, tos: int) -> bytes:
    """Ordinary UDP with an IPv4 option (router alert): IHL 6."""
    return bytes(Ether(dst=SWITCH_MAC, src=src.mac)
                 / IP(src=src.ip, dst=dst, tos=tos, options=[IPOption_Router_Alert()])
                 / UDP(sport=1234, dport=53) / Raw(b"o" * 24))


def spoofed(m: Member, rng) -> Member:
    """m with one of its source addresses forged (MAC, IPv4 or UDP port)."""
    field = ("mac", "ip", "udp_port")[rng.integers(0, 3)]
    forged = {"mac": "02:00:00:00:99:99", "ip": "10.99.0.1", "udp_port": m.udp_port + 77}
    return dataclasses.replace(m, **{field: forged[field]})


def random_mix(cfg: SwitchConfig, n: int, rng, values_max: int = 64) -> list[tuple[int, bytes]]:
    """A random mix of valid DATA (small rounds, retransmissions, stragglers, partial
    completion, rounds near the 32-bit wrap), FLUSH, non-members, forged sources,
    fragments, ordinary traffic (some with IP options) and mutated frames."""
    out = []
    jobs = cfg.jobs
    for _ in range(n):
        job = jobs[rng.integers(0, len(jobs))]
        m = job.members[rng.integers(0, len(job.members))]
        port = m.port if rng.random() < 0.9 else int(rng.integers(0, 6))
        choice = rng.random()
        tos = int(rng.choice([0x80, 0x82, 0x83, 0x81, 0xC0, 0x00, 0x8a, 0x98]))
        if choice < 0.6:
            nv = int(rng.integers(1, values_max + 1))
            expected = job.expected_all if rng.random() < 0.7 else int(rng.integers(0, 1 << len(job.members)))
            min_count = 0 if rng.random() < 0.7 else int(rng.integers(0, len(job.members) + 1))
            slot = int(rng.integers(0, job.pool_size + (1 if rng.random() < 0.1 else 0)))
            round_ = int(rng.integers(0, 4))
            if rng.random() < 0.2:
                round_ = (round_ - 2) % (1 << 32)            # 0xFFFFFFFE .. 1: the wrap
            out.append((port, data_frame(m, rng.integers(0, 16, nv), job=job.job, slot=slot,
                                         round_=round_, expected=expected,
                                         min_count=min_count, tos=tos)))
        elif choice < 0.65:
            out.append((port, data_frame(m, [], job=job.job, slot=int(rng.integers(0, job.pool_size)),
                                         round_=0, expected=0, ptype=TYPE_FLUSH, tos=tos)))
        elif choice < 0.75:
            dst = f"10.{rng.integers(0, 3)}.{rng.integers(0, 3)}.{rng.integers(1, 255)}"
            out.append((port, bytes(Ether(dst=SWITCH_MAC, src=m.mac) / IP(src=m.ip, dst=dst, tos=tos)
                                    / UDP(sport=1234, dport=int(rng.integers(1, 60000))) / Raw(b"x" * 20))))
        elif choice < 0.78:
            out.append((port, bytes(Ether(dst="ff:ff:ff:ff:ff:ff", src=m.mac) / ARP(psrc=m.ip))))
        elif choice < 0.82:
            base = data_frame(m, rng.integers(0, 16, int(rng.integers(1, values_max + 1))),
                              job=job.job, slot=int(rng.integers(0, job.pool_size)), round_=0,
                              expected=job.expected_all, tos=tos)
            dst = None if rng.random() < 0.5 else f"10.{rng.integers(0, 4)}.1.{rng.integers(1, 9)}"
            out.append((port, fragment_of(base, rng, dst)))
        elif choice < 0.86:
            out.append((m.port, data_frame(spoofed(m, rng), rng.integers(0, 16, 8), job=job.job,
                                           slot=0, round_=0, expected=job.expected_all,
                                           tos=tos)))
        elif choice < 0.89:
            dst = f"10.{rng.integers(0, 4)}.2.{rng.integers(1, 9)}"
            out.append((port, with_ip_options(dst, m, tos)))
        else:
            base = data_frame(m, rng.integers(0, 16, int(rng.integers(1, values_max + 1))),
                              job=job.job, slot=int(rng.integers(0, job.pool_size)),
                              round_=int(rng.integers(0, 3)), expected=job.expected_all, tos=tos)
            out.append((port, mutate(base, rng)))
    return out


def small_dlcp() -> Dlcp:
    return Dlcp(thresholds=default_thresholds(2, 0.5), capacity=6)


def routes() -> tuple[Route, ...]:
    return (Route("10.0.0.0/8", 4, "02:00:00:00:00:a8"),
            Route("10.1.0.0/16", 5, "02:00:00:00:00:b0"),
            Route("10.1.1.0/24", 3, "02:00:00:00:00:c8"))
