"""Who a call without a key comes from: its rate bucket's address.

Behind nginx (and an ingress before it) the peer is a proxy, and every keyless
caller would share its one bucket. ``X-Forwarded-For`` is believed only from
the proxies gunicorn trusts (``FORWARDED_ALLOW_IPS``, which deploy/'s nginx
``set_real_ip_from`` lists too): walked from the right, past each trusted
proxy, to the first address that is not one; what a caller wrote to the left
of it is never read. Only calls without a workspace key come here.
"""

from __future__ import annotations

import ipaddress
from typing import Any

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class TrustedProxies:
    def __init__(self, allowed: tuple[str, ...]):
        #: Every peer trusted (``*``, as gunicorn reads it).
        self.everyone = "*" in allowed
        self.networks = tuple(ipaddress.ip_network(n, strict=False) for n in allowed if n != "*")

    def trusts(self, address: Address) -> bool:
        return self.everyone or any(address in network for network in self.networks)

    def caller(self, environ: dict[str, Any]) -> str:
        """The address a keyless call is counted under: the peer, or, from a
        trusted proxy, the rightmost forwarded address that is no trusted proxy."""
        peer = environ.get("REMOTE_ADDR") or ""
        nearest = _address(peer)
        if nearest is None or not self.trusts(nearest):
            return peer
        for hop in reversed(environ.get("HTTP_X_FORWARDED_FOR", "").split(",")):
            address = _address(hop)
            if address is None:
                break  # not what a trusted proxy writes: stay with the last one known
            nearest = address
            if not self.trusts(address):
                break
        return str(nearest)
