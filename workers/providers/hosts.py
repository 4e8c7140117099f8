"""Where a provider call may go, decided before our credential leaves.

A catalog entry names an upstream URL, and a provider may name more (BFL's
``polling_url``). Each is called with our key in a header, so a URL on
another host would hand that key to whoever runs it: a catalog typo, or a
compromised or spoofed provider answer. Every provider call therefore goes
only to https on a host of ``PROVIDER_HOSTS`` (the real providers' by
default), or to the origin ``PROVIDER_ORIGIN_OVERRIDE`` names (the stub, in
dev and tests), and never follows a redirect (``base.send``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from fnmatch import fnmatchcase
from urllib.parse import urlsplit

from router_queue.settings import Settings


@dataclass(frozen=True)
class ProviderHosts:
    #: fnmatch patterns on the lower-cased host name, over https.
    patterns: tuple[str, ...]
    #: (scheme, host:port) of ``PROVIDER_ORIGIN_OVERRIDE``, allowed as it is.
    override: tuple[str, str] | None = None

    @classmethod
    def of(cls, settings: Settings) -> "ProviderHosts":
        override = None
        if settings.provider_origin_override:
            parts = urlsplit(settings.provider_origin_override)
            override = (parts.scheme.lower(), parts.netloc.lower())
        return cls(settings.provider_hosts, override)

    def refusal(self, url: str) -> str | None:
        """Why ``url`` may not be called, or None when it may."""
        try:
            parts = urlsplit(url)
            host = (parts.hostname or "").lower()
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            return f"{url[:100]!r} is not a URL we can call"
        if self.override is not None and (parts.scheme.lower(), parts.netloc.lower()) == self.override:
            return None
        if parts.scheme.lower() != "https":
            return f"{parts.scheme or 'no'} scheme for {host or url[:100]!r}: provider calls are https only"
        if parts.username is not None or parts.password is not None:
            return f"{host!r}: a URL with credentials in it"
        if host and any(fnmatchcase(host, pattern) for pattern in self.patterns):
            return None
        return f"{host or url[:100]!r} is not one of the provider hosts (PROVIDER_HOSTS)"


def same_site(url: str, other: str) -> bool:
    """Whether ``other`` is on ``url``'s own site: the same origin, or, for a
    host name of three or more labels, a host under its last two
    (api.bfl.ai -> api.us1.bfl.ai, bfl.ai). Pins a provider-given URL to the
    provider the catalog names."""
    first, second = urlsplit(url), urlsplit(other)
    if (first.scheme, first.netloc.lower()) == (second.scheme, second.netloc.lower()):
        return True
    host, candidate = (first.hostname or "").lower(), (second.hostname or "").lower()
    if not host or not candidate or _is_address(host) or host.count(".") < 2 or second.scheme != first.scheme:
        return False
    site = ".".join(host.split(".")[-2:])
    return candidate == site or candidate.endswith("." + site)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
