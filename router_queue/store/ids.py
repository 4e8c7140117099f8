"""Request ids: unguessable, UUID-shaped, and able to prove they were ours.

A version-9 id is 60 random bits, a 54-bit HMAC of those bits, the workspace,
the model id and its provider's code, and that code in its last byte
(``keys.provider_code``: the request's keys share its provider's slot).
Ids of an earlier layout (version 8, no code) are not ours any more:
``ops migrate-keys`` drops what is left of them. So no live id can be
guessed or forged for another workspace, and an expired request's id with a
valid MAC answers ``410`` for good while every other id is ``404``,
indistinguishably. The HMAC secret lives in Redis (``SET NX`` on first use).
In full: ``docs/ARCHITECTURE.md``, "The store's parts".
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
ID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-9[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


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

    def _compose(self, random_part: bytes, workspace: str, model: str, code: int) -> str:
        """The id of ``random_part`` for a workspace and model, carrying the
        provider's ``code``."""
        head = bytearray(random_part)
        head[6] = (head[6] & 0x0F) | 0x90  # a custom layout's version
        message = bytes(head) + b"\0" + workspace.encode() + b"\0" + model.encode() + b"\0" + bytes([code])
        digest = hmac.new(self._key(), message, hashlib.sha256).digest()
        tail = bytearray(digest[:7] + bytes([code]))
        tail[0] = (tail[0] & 0x3F) | 0x80  # RFC 4122 variant
        return uuid_text(head + tail)

    def mint(self, workspace: str, model: str) -> str:
        """A new id for a request of ``model`` (``provider/name``): it carries
        the model's provider's code."""
        code = int(keys.provider_code(model.split("/", 1)[0]), 16)
        return self._compose(secrets.token_bytes(8), workspace, model, code)

    def is_ours(self, request_id: str, workspace: str, model: str) -> bool:
        """Whether ``request_id`` was minted for this workspace and model."""
        if not well_formed(request_id):
            return False
        raw = uuid.UUID(request_id).bytes
        expected = self._compose(raw[:8], workspace, model, raw[15])
        return hmac.compare_digest(expected, request_id)


def uuid_text(raw: bytes | bytearray) -> str:
    """``str(uuid.UUID(bytes=raw))``, without building the ``UUID`` (its checks
    cost a tenth of a lane submit's Python)."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def well_formed(request_id: str) -> bool:
    """Whether ``request_id`` is, whole, an id we could have minted."""
    return ID_PATTERN.fullmatch(request_id) is not None
