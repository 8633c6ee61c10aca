"""Free TCP ports for servers started by tests and benchmarks.

A port the kernel hands out for `bind(0)` comes from its ephemeral range, the same range
every outgoing connection takes its local port from; a Ray cluster starting up opens
hundreds of those, so such a port can be taken between the pick and the server's bind
(seen: a direct-ingress replica refused with EADDRINUSE). `free_port` picks below the
ephemeral range and above Ray's worker ports (10002-19999 by default) instead.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above Ray's default worker port range
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port nothing is bound to now, outside the ephemeral range, not handed out before
    by this process."""
    low, high = ephemeral_range()
    bottom, top = (LOWEST, low) if low - LOWEST >= 1000 else (high + 1, 65536)  # else above it
    for _ in range(200 if top - bottom >= 1000 else 0):
        port = random.randrange(bottom, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no room outside the ephemeral range: the kernel's pick
        s.bind(("", 0))
        return s.getsockname()[1]
