"""The request store: every read and write of request state in Redis.

Writes that depend on what is already there run as the Lua scripts in
``lua/`` (one atomic step each); plain reads are pipelined into one round
trip. The key layout is in ``keys.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from . import keys
from .states import COMPLETED, IN_PROGRESS, IN_QUEUE

_FIELDS = (
    "id", "workspace", "model", "provider", "status", "created_at", "started_at",
    "completed_at", "error_type", "detail", "content_type", "cancel_requested",
)


def _load_script(client: redis.Redis, name: str):
    source = resources.files("router_queue").joinpath("lua", f"{name}.lua").read_text()
    return client.register_script(source)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _seconds(value: Any) -> float | None:
    text = _text(value)
    return float(text) if text else None


@dataclass(frozen=True)
class RequestRecord:
    """What the front door and workers read about one request."""

    id: str
    workspace: str
    model: str
    provider: str
    status: str
    created_at: float
    started_at: float | None = None
    completed_at: float | None = None
    error_type: str | None = None
    detail: str | None = None
    content_type: str | None = None
    cancel_requested: bool = False
    #: Seconds until Redis drops the record (set once COMPLETED), else None.
    ttl_s: int | None = None

    @classmethod
    def from_values(cls, values: list[Any], ttl: int | None = None) -> "RequestRecord | None":
        row = dict(zip(_FIELDS, (_text(v) for v in values)))
        if row["status"] is None:
            return None
        return cls(
            id=row["id"] or "",
            workspace=row["workspace"] or "",
            model=row["model"] or "",
            provider=row["provider"] or "",
            status=row["status"],
            created_at=_seconds(row["created_at"]) or 0.0,
            started_at=_seconds(row["started_at"]),
            completed_at=_seconds(row["completed_at"]),
            error_type=row["error_type"] or None,
            detail=row["detail"],
            content_type=row["content_type"],
            cancel_requested=bool(row["cancel_requested"]),
            ttl_s=ttl if ttl is not None and ttl >= 0 else None,
        )


@dataclass(frozen=True)
class Pace:
    """A provider's recent pace, for Retry-After: moving averages in seconds."""

    avg_run_s: float | None
    avg_gap_s: float | None


@dataclass(frozen=True)
class StatusView:
    record: RequestRecord | None
    #: Requests ahead in the provider's queue; None once the request left it.
    position: int | None
    pace: Pace


@dataclass(frozen=True)
class Admission:
    """The outcome of ``admit``: ``outcome`` is one of the admit.lua codes."""

    outcome: str
    request_id: str | None = None
    position: int | None = None


class RequestStore:
    def __init__(self, client: redis.Redis, *, retention_s: int, idempotency_ttl_s: int):
        self.client = client
        self.retention_s = retention_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self._admit = _load_script(client, "admit")
        self._claim = _load_script(client, "claim")
        self._complete = _load_script(client, "complete")
        self._cancel = _load_script(client, "cancel")

    # -- front door --------------------------------------------------------
    def admit(
        self,
        *,
        request_id: str,
        workspace: str,
        model: str,
        provider: str,
        body: str,
        fingerprint: str = "",
        idempotency_key_hash: str = "",
        require_enabled: bool = True,
        now: float | None = None,
    ) -> Admission:
        idem_key = keys.idempotency(workspace, idempotency_key_hash or "-")
        reply = self._admit(
            keys=[
                keys.request(request_id), keys.queue(provider), keys.sequence(provider),
                keys.unpublished(), keys.workspace(workspace), idem_key,
            ],
            args=[
                request_id, workspace, model, provider, body, repr(now or time.time()),
                fingerprint if idempotency_key_hash else "", self.idempotency_ttl_s,
                "1" if require_enabled else "0",
            ],
        )
        code = _text(reply[0])
        if code == "ADMITTED":
            return Admission(code, _text(reply[1]), int(reply[2]))
        if code == "REPLAY":
            return Admission(code, _text(reply[1]))
        return Admission(code)

    def mark_published(self, request_id: str) -> None:
        """Forget that ``request_id`` awaits its first publish."""
        self.client.zrem(keys.unpublished(), request_id)

    def status_view(self, request_id: str, provider: str) -> StatusView:
        """Record, queue position and provider pace, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.request(request_id), _FIELDS)
        pipe.ttl(keys.request(request_id))
        pipe.zrank(keys.queue(provider), request_id)
        pipe.hmget(keys.stats(provider), ("avg_run_s", "avg_gap_s"))
        values, ttl, rank, pace = pipe.execute()
        return StatusView(
            record=RequestRecord.from_values(values, ttl),
            position=rank,
            pace=Pace(_seconds(pace[0]), _seconds(pace[1])),
        )

    def result(self, request_id: str) -> bytes | None:
        return self.client.get(keys.result(request_id))

    def cancel(self, *, request_id: str, workspace: str, model: str, provider: str) -> str:
        reply = self._cancel(
            keys=[keys.request(request_id), keys.queue(provider), keys.unpublished()],
            args=[request_id, workspace, model, repr(time.time()), self.retention_s],
        )
        return _text(reply) or ""

    # -- workers -----------------------------------------------------------
    def load(self, request_id: str) -> tuple[RequestRecord | None, bytes | None]:
        """A request's record and its native body."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.request(request_id), _FIELDS)
        pipe.hget(keys.request(request_id), "body")
        values, body = pipe.execute()
        return RequestRecord.from_values(values), body

    def claim(self, request_id: str, provider: str) -> str:
        """IN_QUEUE -> IN_PROGRESS; returns "CLAIMED" or the status found instead."""
        reply = self._claim(
            keys=[keys.request(request_id), keys.queue(provider), keys.unpublished()],
            args=[request_id, repr(time.time())],
        )
        return _text(reply) or ""

    def cancel_requested(self, request_id: str) -> bool:
        return bool(self.client.hexists(keys.request(request_id), "cancel_requested"))

    def complete(
        self,
        request_id: str,
        provider: str,
        *,
        output: bytes = b"",
        content_type: str = "",
        error_type: str = "",
        detail: str = "",
    ) -> str:
        """Finish the request; a request already COMPLETED keeps its first outcome."""
        reply = self._complete(
            keys=[
                keys.request(request_id), keys.result(request_id), keys.queue(provider),
                keys.stats(provider), keys.unpublished(),
            ],
            args=[
                request_id, repr(time.time()), self.retention_s, error_type, detail,
                content_type, output,
            ],
        )
        return _text(reply) or ""

    # -- sweeper -----------------------------------------------------------
    def unpublished_before(self, cutoff: float, limit: int = 500) -> list[tuple[str, str]]:
        """(id, provider) of requests admitted before ``cutoff`` and never published."""
        ids = [_text(i) for i in self.client.zrangebyscore(keys.unpublished(), "-inf", cutoff, 0, limit)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hmget(keys.request(request_id), ("status", "provider"))
        found = []
        for request_id, (status, provider) in zip(ids, pipe.execute()):
            if _text(status) == IN_QUEUE:
                found.append((request_id, _text(provider)))
            else:
                self.client.zrem(keys.unpublished(), request_id)
        return found

    def queue_depth(self, provider: str) -> int:
        return int(self.client.zcard(keys.queue(provider)))


__all__ = ["COMPLETED", "IN_PROGRESS", "IN_QUEUE", "Admission", "RequestRecord", "RequestStore", "StatusView"]
