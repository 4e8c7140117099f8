"""Which webhook URLs we POST to, decided in one place, twice per event.

A URL must be one ``http.client`` sends as it is, ``https``, and every address
its host resolves to a public one (an IPv4 carried inside IPv6 judged too), so
no caller makes us talk to what only we can reach (SSRF); the one exception,
``WEBHOOK_ALLOW_LOOPBACK_HTTP`` (tests, ``router-queue dev``), lets a host that
resolves to loopback addresses only be reached over http or https. The name
lookup has a budget (``lookup.py``). The check runs at submit (``400
invalid_input``) and again before every attempt (DNS rebinding). Why, and the
window it leaves: ``docs/ARCHITECTURE.md``, "Webhook delivery".
"""

from __future__ import annotations

import http.client
import ipaddress
import re
import socket
from typing import Callable
from urllib.parse import SplitResult, urlsplit

from . import lookup
from .lookup import LookupsBusy

__all__ = ["LookupsBusy", "UnresolvedInTime", "UnsafeWebhookUrl", "check", "refusal", "request_target"]

#: Longest URL accepted, in characters.
MAX_URL_LENGTH = 2048
#: Seconds a host's name lookup may take unless the caller says (the
#: settings' ``webhook_resolve_timeout_s`` has the same default).
RESOLVE_TIMEOUT_S = 2.0
#: Cloud metadata endpoints, refused by name whatever else is allowed
#: (AWS/GCP/Azure IMDS, AWS's IPv6 IMDS, Alibaba, Azure's wire server).
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16"))
#: NAT64's well-known prefix (RFC 6052): its last 32 bits are the IPv4 reached.
NAT64 = ipaddress.ip_network("64:ff9b::/96")
#: A host name as DNS has it: dot-separated labels of letters, digits, ``-``
#: and ``_`` (not a label's first or last ``-``), 63 characters each.
_DNS_NAME = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)(\.(?!-)[a-z0-9_-]{1,63}(?<!-))*\.?")
#: Kinds of address no webhook goes to, by ``ipaddress``'s property names.
_KINDS = ("loopback", "unspecified", "link_local", "site_local", "multicast", "private", "reserved")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[..., list]


class UnsafeWebhookUrl(ValueError):
    """The URL may not receive webhooks; the message says why (no secret in it)."""


class UnresolvedInTime(UnsafeWebhookUrl):
    """The host's name lookup outlived its budget (abandoned, ``lookup.py``)."""


def _unmapped(ip: Address) -> Address:
    """::ffff:10.0.0.1 is 10.0.0.1 to the kernel; judge it as that."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _carried(ip: Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address a packet to ``ip`` ends up at, by 6to4 or NAT64, and which."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.sixtofour is not None:
            return ip.sixtofour, "6to4"
        if ip in NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "NAT64"
    return None


def refusal(ip: Address, *, allow_loopback: bool) -> str | None:
    """Why no webhook goes to ``ip`` (``"a private address"``), or None."""
    ip = _unmapped(ip)
    if ip in METADATA:
        return "a cloud metadata address"
    carried = _carried(ip)
    if carried is not None:
        inner = refusal(carried[0], allow_loopback=False)
        if inner is not None:
            return f"which carries {carried[0]} ({carried[1]}), {inner}"
    if allow_loopback and ip.is_loopback:
        return None
    for name in _KINDS:
        if getattr(ip, f"is_{name}", False):
            return f"a {name.replace('_', '-')} address"
    # is_global alone lets multicast through (224.0.0.1 is "global"): the kinds come first
    return None if ip.is_global else "not a public address"


def request_target(parts: SplitResult) -> str:
    """What the POST's request line names: the path and query, ``/`` at least."""
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _parsed(url: str) -> tuple[SplitResult, int]:
    """``url`` split, and its port (the scheme's when none is named), once it
    is well-formed and one ``http.client`` would send as it is."""
    if not url or len(url) > MAX_URL_LENGTH or not url.isascii() or not url.isprintable():
        raise UnsafeWebhookUrl(f"must be an absolute https URL of at most {MAX_URL_LENGTH} printable ASCII "
                               "characters")
    if " " in url:
        raise UnsafeWebhookUrl("contains a space; percent-encode it (%20)")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise UnsafeWebhookUrl("has a malformed host (an IPv6 address goes in [brackets])") from None
    try:
        port = parts.port
    except ValueError:
        raise UnsafeWebhookUrl("has an invalid port; name one from 1 to 65535, or none") from None
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in ("http", "https") or not host:
        raise UnsafeWebhookUrl("must be an absolute https URL")
    if port == 0:
        raise UnsafeWebhookUrl("has port 0; name one from 1 to 65535, or none")
    if parts.username is not None or parts.password is not None:
        raise UnsafeWebhookUrl("must not carry credentials; sign-in belongs in the receiver's own check")
    if _literal(host) is None and (len(host) > 253 or not _DNS_NAME.fullmatch(host)):
        raise UnsafeWebhookUrl(f"has a host that is neither a DNS name nor an IP address: {host[:100]}")
    port = port or (443 if scheme == "https" else 80)
    _sendable(parts, host, port)
    return parts, port


def _sendable(parts: SplitResult, host: str, port: int) -> None:
    """Run ``http.client``'s own checks of the host, the request line and the
    Host header, as ``delivery.post`` sends them, without sending anything."""
    try:
        connection = http.client.HTTPConnection(host, port)
        try:
            connection.putrequest("POST", request_target(parts), skip_host=True, skip_accept_encoding=True)
            connection.putheader("Host", parts.netloc)
        finally:
            connection.close()
    except (http.client.HTTPException, ValueError, UnicodeError):
        raise UnsafeWebhookUrl("is not one http.client would send (a character its host, path or query "
                               "may not hold); percent-encode it") from None


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _addresses(host: str, port: int, resolve: Resolver, timeout_s: float, holder: str) -> list[Address]:
    """Every address ``host`` names (an IP literal is its own: no lookup)."""
    literal = _literal(host)
    if literal is not None:
        return [_unmapped(literal)]
    try:
        found = lookup.resolve_within(resolve, host, port, timeout_s, holder)
    except lookup.LookupTimedOut:
        raise UnresolvedInTime(f"names a host that did not resolve within {timeout_s:g} s: {host[:100]}") from None
    except (socket.gaierror, UnicodeError, OSError):
        raise UnsafeWebhookUrl(f"names a host that does not resolve: {host[:100]}") from None
    addresses = sorted({_unmapped(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])) for info in found},
                       key=str)
    if not addresses:
        raise UnsafeWebhookUrl(f"names a host that does not resolve: {host[:100]}")
    return addresses


def check(url: str, *, allow_loopback_http: bool, resolve: Resolver | None = None,
          resolve_timeout_s: float = RESOLVE_TIMEOUT_S, holder: str = "") -> list[Address]:
    """The addresses ``url``'s host resolves to, once every one is allowed;
    else :class:`UnsafeWebhookUrl` (:class:`UnresolvedInTime` past
    ``resolve_timeout_s``), or :class:`LookupsBusy`. ``resolve`` is
    ``socket.getaddrinfo``'s shape (the system's, by default); ``holder``
    the workspace whose lookup it is (``webhooks/lookup.py``'s share)."""
    parts, port = _parsed(url)
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    if scheme == "http" and not allow_loopback_http and _literal(host) is None:
        raise UnsafeWebhookUrl("must use https")  # refused anyway: no lookup for it
    addresses = _addresses(host, port, resolve or socket.getaddrinfo, resolve_timeout_s, holder)
    for ip in addresses:
        why = refusal(ip, allow_loopback=allow_loopback_http)
        if why is not None:
            raise UnsafeWebhookUrl(f"resolves to {ip}, {why}; webhooks go to public addresses only")
    if scheme == "http" and not all(ip.is_loopback for ip in addresses):
        raise UnsafeWebhookUrl("must use https")
    return addresses
