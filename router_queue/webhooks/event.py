"""What a webhook POSTs and how it is signed: the Standard Webhooks format
(https://www.standardwebhooks.com), so a receiver verifies it with any of
that specification's libraries (``standardwebhooks`` in Python) and a secret.

* The body is the event, JSON, built from the snapshot taken when the request
  completed (``lib.lua``'s ``owe_webhook``): the same bytes on every attempt.
* ``webhook-id`` is ``msg_`` + the request id: stable across attempts, so a
  receiver that gets an event twice (delivery is at least once) drops the
  second by its id.
* ``webhook-timestamp`` is the attempt's time, Unix seconds; receivers refuse
  one more than 5 minutes off, so it is signed anew on every attempt.
* ``webhook-signature`` is ``v1,<base64 HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>``
  for each secret that signs, space-separated: during a rotation the new and
  the previous secret both sign, and a receiver holding either verifies.

A secret is ``whsec_`` + base64 of 32 random bytes; the HMAC key is the bytes.
Neither a secret nor a signature is ever logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from datetime import datetime, timezone
from typing import Iterable

SECRET_PREFIX = "whsec_"
#: The event type, in the body's ``type``.
EVENT_TYPE = "request.completed"
USER_AGENT = "router-queue-webhooks/1"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def webhook_id(request_id: str) -> str:
    return f"msg_{request_id}"


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def event_body(*, request_id: str, model: str, status: str, error_type: str | None, response_url: str,
               created_at: float, started_at: float | None, completed_at: float) -> bytes:
    """The event, as the bytes every attempt sends (keys sorted, compact)."""
    event = {
        "type": EVENT_TYPE,
        "request_id": request_id,
        "model": model,
        "status": status,
        "error_type": error_type or None,
        "response_url": response_url,
        "created_at": _iso(created_at),
        "started_at": _iso(started_at),
        "completed_at": _iso(completed_at),
    }
    return json.dumps(event, sort_keys=True, separators=(",", ":")).encode()


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
