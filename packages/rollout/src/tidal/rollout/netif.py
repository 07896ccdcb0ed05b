"""Which network interface holds an address: gloo must be told (``GLOO_SOCKET_IFNAME``) on hosts spanning nodes.

Without it gloo advertises the address its host name resolves to, which on many machines (and in the two-host test's
network namespaces) is 127.0.0.1: a peer on another node then connects to its own loopback and the weight broadcast
never forms. tidal sets ``GLOO_SOCKET_IFNAME`` to the interface holding the node's address, unless the user set it.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import MutableMapping

_SIOCGIFADDR = 0x8915  # Linux: the interface's IPv4 address
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def interface_of(address: str) -> str | None:
    """The name of the interface whose IPv4 address is ``address`` (Linux), or None (not found, not IPv4)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def pin_gloo_interface(env: MutableMapping[str, str], address: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``env`` to the interface of a non-loopback ``address`` unless already set.

    Returns:
        The interface set, or None (loopback, already set, or no interface holds the address).
    """
    if address in LOOPBACK_HOSTS or env.get("GLOO_SOCKET_IFNAME"):
        return None
    name = interface_of(address)
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name
    return name
