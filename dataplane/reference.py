"""The reference aggregator: docs/protocol.md as executable Python.

`ReferenceSwitch` is the semantics model every data plane is held to by the packet
suite (tests/packet/). It takes Ethernet frames in on switch ports and emits frames out of
switch ports:

    ingress:  parse -> validate (§4.1, first failure decides the drop counter)
              -> aggregation (§4.2-§4.6) or ordinary IPv4 forwarding (§7)
    egress:   DLCP stage (§6): DSCP -> one of 8 strict-priority queues per port,
              threshold/capacity admission with ECN marking, per-port service rate

The aggregation core (`handle_agg`) works on the AGG header + payload alone so that the
UDP service (dataplane/udp_service.py), where the kernel owns Ethernet/IP/UDP, runs the
very same code. Per packet the work is a fixed number of Python steps; the values are
added with one numpy table lookup per packed byte (two lanes per byte), never a Python
loop over values.
"""
from __future__ import annotations

import ipaddress
import struct
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from dataplane.config import (MAX_VALUES, NUM_QUEUES, PROTOCOL_VERSION, Job, Member,
                              SwitchConfig)
from dataplane.wire import (AGG_PORT_BASE, AGG_PORT_MASK, FLAG_LATE, FLAG_RESERVE, HEADER_LEN,
                            HEADER_STRUCT, L2L4_LEN, MAX_FRAME, TYPE_DATA, TYPE_FLUSH,
                            TYPE_RESULT, TYPE_STRAGGLER, payload_len)

MAX_SLOTS = 65536              # slots per job (§8); MAX_VALUES (8192) comes with the config

ECN_MASK, ECN_CE = 0x03, 0x03
IP_MF, IP_FRAG_OFFSET = 0x2000, 0x1FFF
ROUND_MOD, ROUND_HALF = 1 << 32, 1 << 31

JOB_COUNTERS = ("rx", "aggregated", "results_multicast", "results_reserved",
                "straggler_notices", "flushes", "drop_bad_slot", "drop_not_member",
                "drop_bad_expected", "drop_unsatisfiable", "drop_duplicate")
GLOBAL_COUNTERS = ("drop_oversize", "drop_fragment", "drop_truncated", "drop_bad_version",
                   "drop_bad_type", "drop_bad_length", "drop_unknown_job", "drop_not_routable",
                   "dlcp_selective_drop", "dlcp_buffer_drop", "dlcp_ce_marked", "forwarded")


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _popcount(x: int) -> int:
    return bin(x).count("1")


def ipv4_header_checksum(header: bytes | bytearray | memoryview) -> int:
    """Internet checksum of a 20-byte IPv4 header, its checksum field taken as 0."""
    words = struct.unpack(">10H", bytes(header[:20]))
    return ~_fold(sum(words) - words[5]) & 0xFFFF


def checksum_update(checksum: int, old_word: int, new_word: int) -> int:
    """RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m'), the checksum after one 16-bit word changed.

    Needs no header length (IPv4 options included); a bad checksum stays bad by as much.
    """
    return ~_fold((~checksum & 0xFFFF) + (~old_word & 0xFFFF) + new_word) & 0xFFFF


def round_newer(a: int, b: int) -> bool:
    """Serial-number order of 32-bit rounds (§4.2, RFC 1982 style): a is newer than b."""
    d = (a - b) % ROUND_MOD
    return d != 0 and d < ROUND_HALF


@dataclass
class Reply:
    """One packet the aggregation core emits: AGG header + payload for one member."""
    member: Member
    agg: bytes
    tos: int


class _JobState:
    """The slots of one job: two copies per slot, selected by round parity (§4)."""

    def __init__(self, job: Job):
        self.job = job
        self.members = {m.worker: m for m in job.members}
        # The sources a member's packets may carry (R2): from a frame (ingress port,
        # Ethernet source, IPv4 source, UDP source port), or from a socket (ip, udp_port).
        self.sources = {m.worker: {(m.port, bytes.fromhex(m.mac.replace(":", "")),
                                    ipaddress.IPv4Address(m.ip).packed, m.udp_port),
                                   (m.ip, m.udp_port)} for m in job.members}
        self.member_mask, self.member_count = job.member_mask, job.member_count
        self.by_worker = sorted(job.members, key=lambda m: m.worker)
        # One lookup per packed byte yields both lanes: the little-endian 16-bit pair[b]
        # holds T[b >> 4] in its first byte and T[b & 15] in its second (np.take of a
        # 1-D table: a tenth of the time of indexing a (256, 2) one, per DATA packet).
        table = np.asarray(job.table, dtype=np.uint16)
        byte = np.arange(256)
        self.pair_lanes = (table[byte >> 4] | (table[byte & 0x0F] << 8)).astype("<u2")
        copies = 2 * job.pool_size     # copy index = 2 * slot + (round & 1)
        self.copy_round = [0] * copies
        self.bitmap = [0] * copies
        self.count = [0] * copies
        self.done = [False] * copies
        self.result_header = [None] * copies     # header tuple of the completing packet
        self.sums = np.zeros((copies, job.values_per_packet), dtype=np.uint8)
        self.counters = dict.fromkeys(JOB_COUNTERS, 0)

    def reset_copy(self, c: int, round_: int) -> None:
        self.copy_round[c] = round_
        self.bitmap[c] = 0
        self.count[c] = 0
        self.done[c] = False
        self.result_header[c] = None
        self.sums[c] = 0


class _EgressPort:
    """Eight strict-priority FIFO queues and a service rate (§6)."""

    def __init__(self, rate: float | None):
        self.queues = [deque() for _ in range(NUM_QUEUES)]
        self.rate = rate               # packets/s; None = unlimited; 0 = paused
        self.busy_until = 0.0          # simulated time the port finishes its current send

    def empty(self) -> bool:
        return not any(self.queues)

    def pop(self) -> bytes:
        for queue in reversed(self.queues):      # queue 7 first
            if queue:
                return queue.popleft()
        raise IndexError("pop from an empty port")

    def serve(self, now: float) -> list[bytes]:
        """The frames that leave by simulated time `now` at this port's rate."""
        if self.rate == 0:
            return []
        out = []
        if self.rate is None:
            while not self.empty():
                out.append(self.pop())
            return out
        gap = 1.0 / self.rate
        while not self.empty() and self.busy_until <= now:
            out.append(self.pop())
            self.busy_until += gap
        return out

    def drain(self) -> list[bytes]:
        out = []
        while not self.empty():
            out.append(self.pop())
        return out


class ReferenceSwitch:
    """The reference data plane for one SwitchConfig (docs/protocol.md)."""

    max_values = MAX_VALUES

    def __init__(self, config: SwitchConfig, port_rates: dict[int, float] | None = None,
                 clock=time.monotonic):
        self.config = config.validate(MAX_SLOTS, MAX_VALUES, "the reference aggregator")
        self.jobs = {j.job: _JobState(j) for j in config.jobs}
        self.global_counters = dict.fromkeys(GLOBAL_COUNTERS, 0)
        self._mac = bytes.fromhex(config.mac.replace(":", ""))
        self._ip = ipaddress.IPv4Address(config.ip).packed
        # (network, mask, prefix length, route index, next hops [(port, MAC bytes)])
        self._routes = sorted(
            ((int(net.network_address), int(net.netmask), net.prefixlen, i,
              [(port, bytes.fromhex(mac.replace(":", ""))) for port, mac in r.next_hops])
             for i, r in enumerate(config.routes) for net in [ipaddress.IPv4Network(r.prefix)]),
            key=lambda route: -route[2])
        # Per-route round-robin position: the next hop the next matching packet takes (§7).
        self._route_turn = [0] * len(config.routes)
        self._dscp_map = [config.dlcp.classify(d) for d in range(64)]
        self._thresholds = config.dlcp.thresholds
        self._capacity = config.dlcp.capacity
        self._port_rates = dict(port_rates or {})
        for port, rate in self._port_rates.items():
            if rate is not None and rate < 0:
                raise ValueError(f"port {port}: service rate {rate} must be >= 0 packets/s")
        self._ports: dict[int, _EgressPort] = {}
        self._member_addr: dict[Member, tuple[bytes, bytes]] = {}
        self._clock = clock

    # ------------------------------------------------------------------ counters
    def counters(self) -> dict:
        """{"global": {...}, "jobs": {job: {...}}}: names as in §4.5, zeros included."""
        return {"global": dict(self.global_counters),
                "jobs": {job: dict(state.counters) for job, state in self.jobs.items()}}

    # ------------------------------------------------------------------ frames in/out
    def process(self, port: int, frame: bytes, now: float | None = None) -> list[tuple[int, bytes]]:
        """One frame in on `port`: every (egress port, frame) that leaves by time `now`."""
        now = self._clock() if now is None else now
        out = []
        for egress, emitted in self.ingress(port, frame):
            self._enqueue(egress, emitted, now)
        for egress, egress_port in self._ports.items():
            out.extend((egress, f) for f in egress_port.serve(now))
        return out

    def advance(self, now: float | None = None) -> list[tuple[int, bytes]]:
        """Frames whose service time has come by `now` (rate-limited ports)."""
        now = self._clock() if now is None else now
        return [(egress, f) for egress, p in self._ports.items() for f in p.serve(now)]

    def drain(self, ports=None) -> list[tuple[int, bytes]]:
        """Empty the queues of `ports` (default: all), strict priority order per port."""
        chosen = self._ports if ports is None else {p: self._ports[p] for p in ports
                                                    if p in self._ports}
        return [(egress, f) for egress, p in chosen.items() for f in p.drain()]

    def queue_depths(self, port: int) -> list[int]:
        p = self._ports.get(port)
        return [len(q) for q in p.queues] if p else [0] * NUM_QUEUES

    def ingress(self, port: int, frame: bytes) -> list[tuple[int, bytes]]:
        """Parse, validate and act on one frame; the frames it causes, before DLCP."""
        frame = bytes(frame)
        if len(frame) > MAX_FRAME:
            self.count_oversize()
            return []
        if self._is_ipv4(frame) and int.from_bytes(frame[20:22], "big") & (IP_MF | IP_FRAG_OFFSET):
            if self._fragment_for_aggregator(frame):
                self.global_counters["drop_fragment"] += 1
                return []
            return self._forward(frame)
        if not self._is_agg(frame):
            return self._forward(frame)
        ip_len = int.from_bytes(frame[16:18], "big")
        udp_len = int.from_bytes(frame[38:40], "big")
        l34_ok = ip_len == 20 + udp_len and 8 <= udp_len <= len(frame) - 34
        tos = frame[15]
        source = (port, frame[6:12], frame[26:30], int.from_bytes(frame[34:36], "big"))
        replies = self.handle_agg(port, memoryview(frame)[L2L4_LEN:], udp_len - 8, l34_ok, tos,
                                  source)
        return [(r.member.port, self.frame_for(r)) for r in replies]

    @staticmethod
    def _is_ipv4(frame: bytes) -> bool:
        return len(frame) >= 34 and frame[12:14] == b"\x08\x00" and frame[14] >> 4 == 4

    @staticmethod
    def _is_agg(frame: bytes) -> bool:
        return (len(frame) >= L2L4_LEN and frame[12:14] == b"\x08\x00" and frame[14] == 0x45
                and frame[23] == 17
                and (int.from_bytes(frame[36:38], "big") & AGG_PORT_MASK) == AGG_PORT_BASE)

    def _fragment_for_aggregator(self, frame: bytes) -> bool:
        """An IPv4 fragment aimed at the aggregator (§4.1, R4): a first fragment that would
        be an aggregation packet, or any fragment to the switch's own address."""
        first = int.from_bytes(frame[20:22], "big") & IP_FRAG_OFFSET == 0
        return frame[30:34] == self._ip or (first and self._is_agg(frame))

    def frame_for(self, reply: Reply) -> bytes:
        """Ethernet/IPv4/UDP around an emitted AGG packet (§5)."""
        m = reply.member
        addr = self._member_addr.get(m)
        if addr is None:
            addr = self._member_addr[m] = (
                bytes.fromhex(m.mac.replace(":", "")) + self._mac + b"\x08\x00",
                ipaddress.IPv4Address(m.ip).packed)
        eth, ip_dst = addr
        udp_len = 8 + len(reply.agg)
        ip = bytearray(struct.pack(">BBHHHBBH4s4s", 0x45, reply.tos, 20 + udp_len, 0, 0x4000,
                                   64, 17, 0, self._ip, ip_dst))
        ip[10:12] = ipv4_header_checksum(ip).to_bytes(2, "big")
        udp = struct.pack(">HHHH", AGG_PORT_BASE, m.udp_port, udp_len, 0)
        return b"".join((eth, ip, udp, reply.agg))

    # ------------------------------------------------------------------ forwarding (§7)
    def _forward(self, frame: bytes) -> list[tuple[int, bytes]]:
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[14] >> 4 != 4:
            self.global_counters["drop_not_routable"] += 1
            return []
        dst = int.from_bytes(frame[30:34], "big")
        for network, mask, _, index, hops in self._routes:
            if dst & mask == network:
                self.global_counters["forwarded"] += 1
                # Packet spraying: successive packets take the next hops in turn (§7).
                turn = self._route_turn[index]
                self._route_turn[index] = (turn + 1) % len(hops)
                egress, mac = hops[turn]
                # Layer 2 rewrite only: the IPv4 header is left as it is (§7).
                return [(egress, mac + self._mac + frame[12:])]
        self.global_counters["drop_not_routable"] += 1
        return []

    # ------------------------------------------------------------------ aggregation (§4)
    def count_oversize(self) -> None:
        """A frame (or, for the UDP service, a datagram) above MAX_FRAME: dropped (§4.1)."""
        self.global_counters["drop_oversize"] += 1

    def handle_agg(self, port: int, data, udp_payload_len: int, l34_ok: bool, tos: int,
                   source: tuple[str, int] | None = None) -> list[Reply]:
        """The AGG header + payload of one packet in on `port`: the replies it causes.

        `data` holds the bytes after the UDP header (it may run past the UDP length:
        Ethernet padding); `l34_ok` says whether the IPv4 and UDP lengths agree with each
        other and with the frame. `source` is where the packet came from and must be the
        member's (R2): from a frame (port, Ethernet source, IPv4 source bytes, UDP source
        port), from the UDP service's socket (ip, udp_port). None: an in-process caller
        vouches for the address, only the switch port is checked.
        """
        g = self.global_counters
        if len(data) < HEADER_LEN:
            g["drop_truncated"] += 1
            return []
        h = HEADER_STRUCT.unpack_from(data)
        ver_type, flags, job_id, slot, worker, min_count, round_, expected = h[:8]
        num_values = h[11]
        if ver_type >> 4 != PROTOCOL_VERSION:
            g["drop_bad_version"] += 1
            return []
        ptype = ver_type & 0x0F
        if ptype != TYPE_DATA and ptype != TYPE_FLUSH:
            g["drop_bad_type"] += 1
            return []
        if (not l34_ok or udp_payload_len != HEADER_LEN + payload_len(ptype, num_values)
                or (ptype == TYPE_DATA and not 1 <= num_values <= MAX_VALUES)):
            g["drop_bad_length"] += 1
            return []
        state = self.jobs.get(job_id)
        if state is None:
            g["drop_unknown_job"] += 1
            return []
        if ptype == TYPE_DATA and num_values > state.job.values_per_packet:
            g["drop_bad_length"] += 1
            return []
        jc = state.counters
        if slot >= state.job.pool_size:
            jc["drop_bad_slot"] += 1
            return []
        member = state.members.get(worker)
        if (member is None or member.port != port
                or (source is not None and source not in state.sources[worker])):
            jc["drop_not_member"] += 1
            return []
        if ptype == TYPE_DATA:
            if (expected == 0 and min_count == 0) or (expected != 0 and not expected >> worker & 1):
                jc["drop_bad_expected"] += 1
                return []
            if expected & ~state.member_mask or min_count > (
                    _popcount(expected) if expected else state.member_count):
                jc["drop_unsatisfiable"] += 1
                return []
        jc["rx"] += 1
        if ptype == TYPE_FLUSH:
            state.reset_copy(2 * slot, 0)
            state.reset_copy(2 * slot + 1, 0)
            jc["flushes"] += 1
            return []
        return self._data(state, member, h, data, tos)

    def _data(self, state: _JobState, member: Member, h: tuple, data, tos: int) -> list[Reply]:
        """The slot state machine for one valid DATA packet (§4.2)."""
        slot, worker, min_count, round_, expected = h[3], h[4], h[5], h[6], h[7]
        num_values = h[11]
        c = 2 * slot + (round_ & 1)
        jc = state.counters
        if state.bitmap[c] == 0 or round_newer(round_, state.copy_round[c]):
            state.reset_copy(c, round_)
        elif round_ != state.copy_round[c]:
            jc["straggler_notices"] += 1
            return [self._straggler(state, c, member, h, tos)]
        bit = 1 << worker
        if state.bitmap[c] & bit or state.done[c]:
            if not state.done[c]:
                jc["drop_duplicate"] += 1
                return []
            jc["results_reserved"] += 1
            return [self._reserve(state, c, member, tos)]
        payload = np.frombuffer(data, dtype=np.uint8, count=(num_values + 1) // 2,
                                offset=HEADER_LEN)
        lanes = np.take(state.pair_lanes, payload).view(np.uint8)[:num_values]
        sums = state.sums[c, :num_values]
        np.add(sums, lanes, out=sums)             # uint8: wraps mod 256 by construction
        state.bitmap[c] |= bit
        state.count[c] += 1
        jc["aggregated"] += 1
        complete = (state.count[c] >= min_count if min_count > 0
                    else state.bitmap[c] == expected)
        if not complete:
            return []
        state.done[c] = True
        state.result_header[c] = h
        jc["results_multicast"] += 1
        # One RESULT per member, identical except for the addressed worker (byte 6).
        result = bytearray(self._result_bytes(state, c, 0, 0))
        replies = []
        for m in state.by_worker:
            result[6] = m.worker
            replies.append(Reply(m, bytes(result), tos))
        return replies

    def _result_bytes(self, state: _JobState, c: int, worker: int, flags: int) -> bytes:
        h = state.result_header[c]
        bitmap = state.bitmap[c]
        num_values = h[11]
        header = HEADER_STRUCT.pack((PROTOCOL_VERSION << 4) | TYPE_RESULT, flags, h[2], h[3],
                                    worker, h[5], h[6], h[7], bitmap, h[9], h[10], num_values,
                                    _popcount(bitmap), 0)
        return header + state.sums[c, :num_values].tobytes()

    def _reserve(self, state: _JobState, c: int, member: Member, tos: int) -> Reply:
        flags = FLAG_RESERVE
        if not state.bitmap[c] >> member.worker & 1:
            flags |= FLAG_LATE
        return Reply(member, self._result_bytes(state, c, member.worker, flags), tos)

    def _straggler(self, state: _JobState, c: int, member: Member, h: tuple, tos: int) -> Reply:
        header = HEADER_STRUCT.pack((PROTOCOL_VERSION << 4) | TYPE_STRAGGLER, h[1], h[2], h[3],
                                    h[4], h[5], state.copy_round[c], h[7], state.bitmap[c], h[9],
                                    h[10], 0, state.count[c], h[13])
        return Reply(member, header, tos)

    # ------------------------------------------------------------------ DLCP egress (§6)
    def _port(self, egress: int) -> _EgressPort:
        p = self._ports.get(egress)
        if p is None:
            p = self._ports[egress] = _EgressPort(self._port_rates.get(egress))
        return p

    def _enqueue(self, egress: int, frame: bytes, now: float) -> None:
        port = self._port(egress)
        if port.rate is not None and port.rate > 0 and port.empty() and port.busy_until < now:
            port.busy_until = now              # an idle port starts sending at once
        tos = frame[15] if len(frame) >= 34 and frame[12:14] == b"\x08\x00" else 0
        queue_id, is_data = self._dscp_map[tos >> 2]
        queue = port.queues[queue_id]
        occupancy = len(queue)
        if port.rate is None:
            occupancy = 0                      # unlimited: every packet leaves at once
        g = self.global_counters
        if occupancy >= self._capacity:
            g["dlcp_buffer_drop"] += 1
            return
        if is_data and occupancy > self._thresholds[queue_id]:
            if tos & ECN_MASK == 0:
                g["dlcp_selective_drop"] += 1
                return
            if tos & ECN_MASK != ECN_CE:
                frame = self._mark_ce(frame)
                g["dlcp_ce_marked"] += 1
        queue.append(frame)

    @staticmethod
    def _mark_ce(frame: bytes) -> bytes:
        marked = bytearray(frame)
        old_word = int.from_bytes(frame[14:16], "big")
        marked[15] |= ECN_CE
        checksum = checksum_update(int.from_bytes(frame[24:26], "big"), old_word,
                                   int.from_bytes(marked[14:16], "big"))
        marked[24:26] = checksum.to_bytes(2, "big")
        return bytes(marked)
