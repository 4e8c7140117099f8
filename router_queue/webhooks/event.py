"""What a webhook POSTs and how it is signed: the Standard Webhooks format
(https://www.standardwebhooks.com), so a receiver verifies it with any of
that specification's libraries and a secret.

The events a caller chose (:func:`parse_events`), each body built from the
snapshot taken in the step that owed it (the same bytes on every attempt);
``webhook-id`` stable across an event's attempts (``webhooks/ids.py``);
``webhook-timestamp`` the attempt's; ``webhook-signature`` one ``v1,`` HMAC
per secret that signs. A secret is ``whsec_`` + base64 of 32 random bytes.
Neither a secret nor a signature is ever logged. In full:
``docs/ARCHITECTURE.md``, "Webhook delivery"; a receiver's view: ``docs/API.md``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from datetime import datetime, timezone
from typing import Any, Iterable

SECRET_PREFIX = "whsec_"
#: The events a caller may choose, in the order a request owes them.
EVENTS = ("started", "progress", "completed")
#: The events of a request that chose none.
DEFAULT_EVENTS = "completed"
#: The header that chooses them, on either submit route.
EVENTS_HEADER = "X-Comfy-Webhook-Events"
#: The header that names where they go, on either submit route.
URL_HEADER = "X-Comfy-Webhook-Url"
#: The completed event's type, in the body's ``type`` (the others': ``request.{event}``).
EVENT_TYPE = "request.completed"
USER_AGENT = "router-queue-webhooks/1"


class UnknownEvents(ValueError):
    """The list of events is empty or names one that does not exist."""


def parse_events(raw: str) -> str:
    """A comma-separated choice of :data:`EVENTS` (whitespace and repeats
    tolerated), canonical: in :data:`EVENTS`' order, comma-separated."""
    names = {name.strip() for name in raw.split(",")}
    names.discard("")
    unknown = sorted(names - set(EVENTS))
    if unknown:
        raise UnknownEvents(f"names an unknown event {unknown[0][:40]!r}; choose among {', '.join(EVENTS)}")
    if not names:
        raise UnknownEvents(f"names no event; choose among {', '.join(EVENTS)}")
    return ",".join(name for name in EVENTS if name in names)


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def event_body(*, request_id: str, model: str, status: str, error_type: str | None, response_url: str,
               created_at: float, started_at: float | None, completed_at: float | None,
               cost: dict[str, Any], event: str = "completed", progress: float | None = None,
               listed: dict[str, Any] | None = None) -> bytes:
    """The event, as the bytes every attempt sends (keys sorted, compact): the
    request as it was when the event was owed; ``progress`` on a progress
    event only; ``cost`` its ``{"credits", "state"}`` at that step (held, or as
    its completion settled it); ``listed``: the request's fields listed on
    events (``requests/record.py``), as shown."""
    body: dict[str, Any] = {
        "type": f"request.{event}",
        "request_id": request_id,
        "model": model,
        "status": status,
        "error_type": error_type or None,
        "response_url": response_url,
        "created_at": _iso(created_at),
        "started_at": _iso(started_at),
        "completed_at": _iso(completed_at),
        "cost": cost,
    }
    if event == "progress":
        body["progress"] = progress
    if listed:
        body.update(listed)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signed_headers(msg_id: str, body: bytes, signing_secrets: Iterable[str], timestamp: int) -> dict[str, str]:
    """The headers of one attempt: id, timestamp, a signature per secret."""
    return {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, msg_id, timestamp, body) for s in signing_secrets),
    }
