"""dataplane.ports.free_port: the ports the tests and experiments hand to a rendezvous, a store
or a job's members."""
import socket

from dataplane import ports


def test_a_free_port_is_below_the_ephemeral_range_and_free_for_tcp_and_udp():
    picked = [ports.free_port() for _ in range(20)]
    assert len(set(picked)) == len(picked)
    low = ports._ephemeral_low()
    for port in picked:
        assert ports.LOWEST_PORT <= port < low
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
            with socket.socket(socket.AF_INET, kind) as s:
                s.bind(("127.0.0.1", port))


class _Draws:
    """Stands in for the random source only: the candidates come in a known order."""
    def __init__(self, *values):
        self.values = list(values)

    def randrange(self, low, high):
        return self.values.pop(0)


def test_a_port_held_by_tcp_only_or_udp_only_is_skipped(monkeypatch):
    tcp_held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    udp_held = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with tcp_held, udp_held:
        tcp_held.bind(("127.0.0.1", ports.free_port()))
        tcp_held.listen()
        udp_held.bind(("127.0.0.1", ports.free_port()))
        free = ports.free_port()
        for s in (tcp_held, udp_held):                 # skipped for being held, not handed out
            ports._handed_out.discard(s.getsockname()[1])
        ports._handed_out.discard(free)
        monkeypatch.setattr(ports, "_rng", _Draws(tcp_held.getsockname()[1],
                                                  udp_held.getsockname()[1], free))
        assert ports.free_port() == free
