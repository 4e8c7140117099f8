"""What an operator is shown of a webhook URL: its origin, nothing more.

A receiver's path and query are often its credential (a chat incoming-webhook
URL, a signed query string), so logs, the ops page and its JSON, the CLI and
the metrics name an endpoint by ``scheme://host[:port]`` only; the circuit
and the failing endpoints are keyed by it too. It sits beneath the store and
the webhooks feature both, which key and show endpoints by it.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url`` (no credentials, path, query or
    fragment); "" for something that is not a URL with a host."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return ""
    host = parts.hostname or ""
    if not parts.scheme or not host:
        return ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme.lower()}://{host}" + (f":{port}" if port is not None else "")
