"""Which address and interface a worker's process groups use.

Peers reach a worker at its node's IP (Ray's, or KVRAY_HOST). Gloo, left alone, binds to
the address the machine's hostname resolves to, and where that is not a local address
(a container, a network namespace, many cloud images) it falls back to the loopback
address and advertises `127.0.0.1` to its peer: on one node that works, across nodes every
connection is refused. So before a process builds a group, `bind_collectives_to` names
the interface that carries the node's IP in GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
(NCCL's bootstrap makes the same guess), unless the user has set them.
"""

from __future__ import annotations

import ipaddress
import logging
import os

import psutil
import ray

logger = logging.getLogger(__name__)
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def node_ip() -> str:
    """The address peers reach this node at: KVRAY_HOST if set, else Ray's. Never a guess:
    a loopback address on a multi-node cluster would make every pull fail silently."""
    host = os.environ.get("KVRAY_HOST")
    if host:
        return host
    try:
        return ray.util.get_node_ip_address()
    except Exception as e:
        raise RuntimeError(
            f"cannot tell this node's IP address ({e!r}); set KVRAY_HOST to the address "
            "the other nodes reach it at"
        ) from e


def interface_of(ip: str) -> str | None:
    """The name of the local interface that holds `ip`, or None."""
    try:
        wanted = ipaddress.ip_address(ip)
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            try:
                if ipaddress.ip_address(addr.address.split("%")[0]) == wanted:
                    return name
            except ValueError:  # a MAC address
                continue
    return None


def bind_collectives_to(ip: str) -> str | None:
    """Make this process's gloo and NCCL groups use the interface holding `ip`; returns
    the interface (None: not a local address, nothing changed)."""
    name = interface_of(ip)
    if name is None:
        logger.warning(
            "kvray: %s is not an address of this machine; gloo/NCCL keep their own choice "
            "(set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME if pulls fail)",
            ip,
        )
        return None
    for var in SOCKET_IFNAME_VARS:
        os.environ.setdefault(var, name)
    return name
