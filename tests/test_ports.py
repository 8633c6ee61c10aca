"""free_port: outside the kernel's ephemeral range (where outgoing connections take their
local ports), bindable, never the same twice in a process."""

import itertools
import socket

from kvray.cluster.ports import LOWEST, ephemeral_range, free_port


def test_free_ports_lie_outside_the_ephemeral_range_and_can_be_bound():
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        assert port >= LOWEST and not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = itertools.chain([taken], itertools.count(LOWEST))  # the held one first
        monkeypatch.setattr("kvray.cluster.ports.random.randrange", lambda a, b: next(picks))
        assert free_port() != taken
