"""Which webhook URLs we POST to, decided in one place, twice per event.

A URL must be ``https`` and every address its host resolves to a public one,
so no caller makes us talk to what only we can reach (SSRF); the one
exception, ``WEBHOOK_ALLOW_LOOPBACK_HTTP`` (tests, ``router-queue dev``), lets
a host that resolves to loopback addresses only be reached over http or https.
The check runs at submit (``400 invalid_input``) and again before every
attempt (DNS rebinding). Why, and the window it leaves:
``docs/ARCHITECTURE.md``, "Webhook delivery".
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Callable
from urllib.parse import urlsplit

#: Longest URL accepted, in characters.
MAX_URL_LENGTH = 2048
#: Cloud metadata endpoints, refused by name whatever else is allowed
#: (AWS/GCP/Azure IMDS, AWS's IPv6 IMDS, Alibaba, Azure's wire server).
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16"))

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[..., list]


class UnsafeWebhookUrl(ValueError):
    """The URL may not receive webhooks; the message says why (no secret in it)."""


def _kind(ip: Address) -> str:
    if ip in METADATA:
        return "a cloud metadata address"
    for name in ("loopback", "unspecified", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{name}"):
            return f"a {name.replace('_', '-')} address"
    return "not a public address"


def _unmapped(ip: Address) -> Address:
    """::ffff:10.0.0.1 is 10.0.0.1 to the kernel; judge it as that."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def allowed_address(ip: Address, *, allow_loopback: bool) -> bool:
    ip = _unmapped(ip)
    if ip in METADATA:
        return False
    if allow_loopback and ip.is_loopback:
        return True
    # is_global alone lets multicast through (224.0.0.1 is "global")
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified or ip.is_link_local
                                 or ip.is_private or ip.is_loopback)


def check(url: str, *, allow_loopback_http: bool, resolve: Resolver | None = None) -> list[Address]:
    """The addresses ``url``'s host resolves to, once every one is allowed;
    else :class:`UnsafeWebhookUrl`. ``resolve`` is ``socket.getaddrinfo``'s
    shape (the system's, by default)."""
    resolve = resolve or socket.getaddrinfo
    if not url or len(url) > MAX_URL_LENGTH or not url.isascii() or not url.isprintable():
        raise UnsafeWebhookUrl(f"must be an absolute https URL of at most {MAX_URL_LENGTH} printable ASCII "
                               "characters")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        raise UnsafeWebhookUrl("has an invalid port") from None
    host = parts.hostname
    if scheme not in ("http", "https") or not host:
        raise UnsafeWebhookUrl("must be an absolute https URL")
    if parts.username is not None or parts.password is not None:
        raise UnsafeWebhookUrl("must not carry credentials; sign-in belongs in the receiver's own check")
    try:
        found = resolve(host, port or (443 if scheme == "https" else 80), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        raise UnsafeWebhookUrl(f"names a host that does not resolve: {host[:100]}") from None
    addresses = sorted({_unmapped(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])) for info in found},
                       key=str)
    if not addresses:
        raise UnsafeWebhookUrl(f"names a host that does not resolve: {host[:100]}")
    for ip in addresses:
        if not allowed_address(ip, allow_loopback=allow_loopback_http):
            raise UnsafeWebhookUrl(f"resolves to {ip}, {_kind(ip)}; webhooks go to public addresses only")
    if scheme == "http" and not (allow_loopback_http and all(ip.is_loopback for ip in addresses)):
        raise UnsafeWebhookUrl("must use https")
    return addresses
