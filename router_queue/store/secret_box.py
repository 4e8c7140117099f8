"""Webhook signing secrets sealed at rest (``WEBHOOK_SECRETS_KEY``).

A secret is stored as :data:`SEALED` and a Fernet token (AES-128-CBC with an
HMAC-SHA256, ``cryptography``), so reading Redis does not let anyone forge a
workspace's webhooks. The key setting lists Fernet keys, newest first: new
secrets are sealed with the first, and any listed key opens (MultiFernet), so
a rotation adds a key in front, runs ``router-queue ops migrate-keys`` (which
seals every secret with the newest), then drops the old one. A secret stored
before encryption (no prefix) still signs until migrated. Once one is sealed,
the store's marker (``keys.secrets_sealed``) makes every process refuse to
start without a key that opens it (:func:`require_key`).
"""

from __future__ import annotations

import redis
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from ..settings import SettingsError
from . import keys

#: What a sealed secret starts with; a stored secret without it is plaintext.
SEALED = "fernet:"
#: What the store's marker seals: opening it proves the keys open the secrets.
_MARKER_TEXT = "router-queue webhook secrets"


class SecretsKeyError(SettingsError):
    """``WEBHOOK_SECRETS_KEY`` is missing, or opens nothing the store holds."""


class SecretBox:
    def __init__(self, fernet_keys: tuple[str, ...]):
        if not fernet_keys:
            raise ValueError("a SecretBox needs at least one key")
        self._newest = Fernet(fernet_keys[0])
        self._any = MultiFernet([Fernet(k) for k in fernet_keys])

    def seal(self, secret: str) -> str:
        return SEALED + self._newest.encrypt(secret.encode()).decode()

    def open(self, stored: str) -> str:
        """The secret ``stored`` holds; plaintext (stored before encryption) as it is."""
        if not stored.startswith(SEALED):
            return stored
        try:
            return self._any.decrypt(stored.removeprefix(SEALED).encode()).decode()
        except InvalidToken:
            raise SecretsKeyError("a webhook secret does not open with any key WEBHOOK_SECRETS_KEY lists "
                                  "(was the key that sealed it dropped before `router-queue ops migrate-keys`?)") \
                from None

    def is_current(self, stored: str) -> bool:
        """Whether ``stored`` is sealed with the newest key (migration leaves it)."""
        if not stored.startswith(SEALED):
            return False
        try:
            self._newest.decrypt(stored.removeprefix(SEALED).encode())
        except InvalidToken:
            return False
        return True

    def mark(self, client: redis.Redis) -> None:
        """Record that the store holds sealed secrets, under the newest key:
        written before the first secret it seals, so no sealed secret is ever unmarked."""
        client.set(keys.secrets_sealed(), self.seal(_MARKER_TEXT))


def open_stored(box: SecretBox | None, stored: str) -> str:
    """``stored`` opened by ``box``; without a box only plaintext opens."""
    if box is not None:
        return box.open(stored)
    if stored.startswith(SEALED):
        raise SecretsKeyError("the store's webhook secrets are encrypted: set WEBHOOK_SECRETS_KEY")
    return stored


def require_key(client: redis.Redis, box: SecretBox | None) -> None:
    """A process's check at start: once the store holds sealed secrets, a key
    that opens its marker must be set, else :class:`SecretsKeyError`."""
    marker = client.get(keys.secrets_sealed())
    if marker is None:
        return
    if box is None:
        raise SecretsKeyError("WEBHOOK_SECRETS_KEY must be set: the store holds webhook signing secrets encrypted "
                              "with it (deploy/README.md, \"Webhook secrets\")")
    try:
        box.open(marker.decode())
    except SecretsKeyError:
        raise SecretsKeyError("WEBHOOK_SECRETS_KEY opens none of the store's webhook secrets: list the key that "
                              "sealed them after the new one until `router-queue ops migrate-keys` has run") from None
