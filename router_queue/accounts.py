"""Workspaces and their API keys, kept in Redis.

An API key is shown once, when minted, and stored only as its SHA-256: keys
are 256-bit random tokens, so a fast hash is enough (nothing to brute-force)
and the lookup by hash never compares secret bytes in Python at all.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

import redis

from . import keys

KEY_PREFIX = "rq_"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class Workspace:
    id: str
    name: str
    queue_enabled: bool
    credits: int


class Accounts:
    def __init__(self, client: redis.Redis):
        self.client = client

    def create_workspace(self, name: str, *, queue_enabled: bool = False, credits: int = 0) -> str:
        workspace_id = "ws_" + secrets.token_hex(8)
        pipe = self.client.pipeline()
        pipe.hset(
            keys.workspace(workspace_id),
            mapping={
                "name": name,
                "queue_enabled": "1" if queue_enabled else "0",
                "credits": credits,
                "created_at": repr(time.time()),
            },
        )
        pipe.sadd(keys.workspaces(), workspace_id)
        pipe.execute()
        return workspace_id

    def get(self, workspace_id: str) -> Workspace | None:
        values = self.client.hgetall(keys.workspace(workspace_id))
        if not values:
            return None
        row = {k.decode(): v.decode() for k, v in values.items()}
        return Workspace(
            id=workspace_id,
            name=row.get("name", ""),
            queue_enabled=row.get("queue_enabled") == "1",
            credits=int(row.get("credits", "0")),
        )

    def list(self) -> list[Workspace]:
        ids = sorted(m.decode() for m in self.client.smembers(keys.workspaces()))
        return [ws for ws in (self.get(i) for i in ids) if ws is not None]

    def _require(self, workspace_id: str) -> None:
        if not self.client.exists(keys.workspace(workspace_id)):
            raise LookupError(f"no workspace {workspace_id!r}")

    def mint_key(self, workspace_id: str) -> str:
        """A new API key for the workspace; the only time the key is visible."""
        self._require(workspace_id)
        api_key = KEY_PREFIX + secrets.token_urlsafe(32)
        self.client.set(keys.api_key(hash_key(api_key)), workspace_id)
        return api_key

    def set_queue_enabled(self, workspace_id: str, enabled: bool) -> None:
        self._require(workspace_id)
        self.client.hset(keys.workspace(workspace_id), "queue_enabled", "1" if enabled else "0")

    def set_credits(self, workspace_id: str, credits: int) -> None:
        self._require(workspace_id)
        self.client.hset(keys.workspace(workspace_id), "credits", int(credits))

    def workspace_for_key(self, api_key: str) -> str | None:
        value = self.client.get(keys.api_key(hash_key(api_key)))
        return value.decode() if value is not None else None
