"""Ports for servers that bind them later: below the ephemeral range, free, never handed out twice."""

import socket

import pytest

from d3s_openrlhf.cpu import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    low = ports.ephemeral_low()
    given = [ports.free_port() for _ in range(200)]
    assert all(max(1024, low - 12288) <= port < low for port in given)
    assert len(set(given)) == len(given)
    for port in given:  # nothing listens there
        with socket.socket() as sock:
            sock.bind(("", port))


def test_a_port_that_is_taken_is_never_handed_out(monkeypatch):
    low = ports.ephemeral_low()
    monkeypatch.setattr(ports, "_DRAW_WIDTH", 2)  # two candidates: low - 2, low - 1
    monkeypatch.setattr(ports, "_given", set())
    with socket.socket() as listener:
        listener.bind(("", low - 2))
        listener.listen()
        assert ports.free_port() == low - 1
        with pytest.raises(RuntimeError, match="no free port below"):
            ports.free_port()  # low - 2 is taken, low - 1 was handed out
