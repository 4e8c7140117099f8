"""Request ids: unguessable, UUID-shaped, and able to prove they were ours.

A request id is 60 random bits plus a 62-bit HMAC of those bits, the
workspace and the model id, laid out as a version-8 UUID. Two things follow:

* Nobody can guess a live id (60 random bits), nor forge one that would pass
  for another workspace's (the MAC covers the workspace).
* Once a finished request's record has expired from Redis, a read that finds
  no record but a valid MAC for this caller and model knows the request
  existed: it answers ``410`` for good, with nothing kept per request. Every
  other id (malformed, unknown, another workspace's, another model's) is
  ``404 request_not_found``, indistinguishably.

The HMAC secret lives in Redis (``SET NX`` on first use), so every process of a
deployment shares it without configuration.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import uuid

import redis

from . import keys

#: What an id we minted looks like; anything else is answered 404 unread.
#: Always matched whole (``fullmatch``): ``$`` alone would let a trailing
#: newline through, and ``uuid.UUID`` would then raise on it.
ID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


class RequestIds:
    """Mints and verifies request ids for one deployment."""

    def __init__(self, client: redis.Redis):
        self._client = client
        self._secret: bytes | None = None

    def _key(self) -> bytes:
        if self._secret is None:
            self._client.set(keys.id_secret(), secrets.token_hex(32), nx=True)
            value = self._client.get(keys.id_secret())
            self._secret = value if isinstance(value, bytes) else value.encode()
        return self._secret

    def _compose(self, random_part: bytes, workspace: str, model: str) -> str:
        head = bytearray(random_part)
        head[6] = (head[6] & 0x0F) | 0x80  # version 8: custom layout
        message = bytes(head) + b"\0" + workspace.encode() + b"\0" + model.encode()
        tail = bytearray(hmac.new(self._key(), message, hashlib.sha256).digest()[:8])
        tail[0] = (tail[0] & 0x3F) | 0x80  # RFC 4122 variant
        return uuid_text(head + tail)

    def mint(self, workspace: str, model: str) -> str:
        return self._compose(secrets.token_bytes(8), workspace, model)

    def is_ours(self, request_id: str, workspace: str, model: str) -> bool:
        """Whether ``request_id`` was minted for this workspace and model."""
        if not well_formed(request_id):
            return False
        random_part = uuid.UUID(request_id).bytes[:8]
        expected = self._compose(random_part, workspace, model)
        return hmac.compare_digest(expected, request_id)


def uuid_text(raw: bytes | bytearray) -> str:
    """``str(uuid.UUID(bytes=raw))``, without building the ``UUID`` (its checks
    cost a tenth of a lane submit's Python)."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def well_formed(request_id: str) -> bool:
    """Whether ``request_id`` is, whole, an id we could have minted."""
    return ID_PATTERN.fullmatch(request_id) is not None
