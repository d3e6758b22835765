"""Free TCP ports for servers that bind them later: torch.distributed masters, Ray's nodes.

A port found by binding port 0 is an ephemeral one, and every outgoing connection on the machine (Ray's workers,
vLLM, the suite's other jobs) takes its local port from the same range: one can take the port before the server
that was given it binds it (``EADDRINUSE``, seen when a model group's master bound its port after loading the
model). :func:`free_port` draws below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), which
outgoing connections never take, and never hands out the same port twice in one process.
"""

import random
import socket

_DRAW_WIDTH = 12288  # ports drawn from [ephemeral low - this, ephemeral low)
_given = set()


def ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's default 32768 where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, below the ephemeral range, not handed out before by this process."""
    high = ephemeral_low()
    draws = random.SystemRandom()
    for _ in range(1000):
        port = draws.randrange(max(1024, high - _DRAW_WIDTH), high)
        if port in _given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port below {high}: {len(_given)} handed out by this process")
