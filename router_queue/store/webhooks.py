"""The webhook events requests owe, and their deliveries, in Redis.

An event is written by the script that completes its request (``lib.lua``'s
``owe_webhook``), so a completed request with a webhook URL always has its
event: no crash can fall between the two. From there every change is one
script: an attempt takes the event under a lease (``webhook_take.lua``), its
outcome is recorded with the next attempt's time (``webhook_record.lua``),
and the sweeper picks what is due (``webhook_due.lua``). The key layout is in
``keys.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from . import keys
from .requests import load_script

#: Attempts kept per workspace for ``router-queue ops webhooks``.
LOG_LENGTH = 200


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _float(value: str | None) -> float | None:
    return float(value) if value else None


@dataclass(frozen=True)
class WebhookEvent:
    """The event as the completion snapshotted it, and the attempt taking it."""

    request_id: str
    url: str
    workspace: str
    model: str
    status: str
    error_type: str | None
    response_url: str
    created_at: float
    started_at: float | None
    completed_at: float
    attempt: int
    first_attempt_at: float
    owed_at: float

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> "WebhookEvent":
        return cls(
            request_id=fields["request_id"], url=fields["url"], workspace=fields.get("workspace", ""),
            model=fields.get("model", ""), status=fields.get("status", "COMPLETED"),
            error_type=fields.get("error_type") or None, response_url=fields.get("response_url", ""),
            created_at=float(fields["created_at"]), started_at=_float(fields.get("started_at")),
            completed_at=float(fields["completed_at"]), attempt=int(fields.get("attempts") or 1),
            first_attempt_at=float(fields.get("first_attempt_at") or fields["completed_at"]),
            owed_at=float(fields.get("owed_at") or fields["completed_at"]),
        )


@dataclass(frozen=True)
class Taken:
    """What ``take`` came to: "TAKEN" with the event, or why not."""

    outcome: str
    event: WebhookEvent | None = None


@dataclass(frozen=True)
class Attempt:
    """One line of a workspace's attempt log."""

    at: float
    request_id: str
    url: str
    attempt: int
    outcome: str
    status: int | None
    error: str
    seconds: float


class WebhookStore:
    def __init__(self, client: redis.Redis, *, keep_s: int):
        self.client = client
        #: Seconds an event is kept once delivered or given up.
        self.keep_s = keep_s
        self._take = load_script(client, "webhook_take")
        self._record = load_script(client, "webhook_record")
        self._due = load_script(client, "webhook_due")

    def take(self, request_id: str, *, now: float, lease_s: float, token: str) -> Taken:
        reply = self._take(keys=[keys.webhook_event(request_id), keys.webhooks_due()],
                           args=[request_id, repr(now), lease_s, token])
        outcome = _text(reply[0])
        if outcome != "TAKEN":
            return Taken(outcome)
        flat = [_text(v) for v in reply[1:]]
        return Taken(outcome, WebhookEvent.from_fields(dict(zip(flat[::2], flat[1::2]))))

    def record(self, event: WebhookEvent, *, token: str, now: float, outcome: str, status: int | None,
               error: str, seconds: float, next_at: float | None) -> str:
        """Record an attempt's ``outcome`` ("delivered", "gone", "failed");
        ``next_at`` None after a failure gives the event up. Returns what
        ``webhook_record.lua`` answered."""
        entry = json.dumps({"at": now, "request_id": event.request_id, "url": event.url, "attempt": event.attempt,
                            "outcome": outcome, "status": status, "error": error[:300], "seconds": round(seconds, 3)},
                           separators=(",", ":"))
        reply = self._record(
            keys=[keys.webhook_event(event.request_id), keys.webhooks_due(), keys.webhook_log(event.workspace),
                  keys.webhooks_failing(), keys.workspace(event.workspace)],
            args=[event.request_id, token, repr(now), outcome, "" if status is None else status, error[:300],
                  "" if next_at is None else repr(next_at), self.keep_s, entry, LOG_LENGTH],
        )
        return _text(reply[0])

    def due(self, *, now: float, again_at: float, limit: int = 500) -> list[str]:
        """The events to publish now, each pushed back to ``again_at`` (``webhook_due.lua``)."""
        return [_text(i) for i in self._due(keys=[keys.webhooks_due()], args=[repr(now), repr(again_at), limit])]

    def owed(self, request_id: str) -> bool:
        """Whether the request has a webhook event pending (a hint for the fast path)."""
        return self.client.zscore(keys.webhooks_due(), request_id) is not None

    def event(self, request_id: str) -> dict[str, str]:
        """Every field of a request's event (the operator's and the tests' view)."""
        return {_text(k): _text(v) for k, v in self.client.hgetall(keys.webhook_event(request_id)).items()}

    def pending(self) -> int:
        return int(self.client.zcard(keys.webhooks_due()))

    def attempts(self, workspace: str, count: int = 50) -> list[Attempt]:
        """The workspace's last ``count`` attempts, newest first."""
        rows = [json.loads(raw) for raw in self.client.lrange(keys.webhook_log(workspace), 0, count - 1)]
        return [Attempt(r["at"], r["request_id"], r["url"], r["attempt"], r["outcome"], r["status"], r["error"],
                        r["seconds"]) for r in rows]

    def failing(self, workspace: str | None = None) -> list[tuple[str, str, int]]:
        """Endpoints whose last attempts failed: (workspace, url, failures in a
        row), most failures first; one workspace's, or every one's."""
        rows = []
        for field, count in self.client.hgetall(keys.webhooks_failing()).items():
            ws, _, url = _text(field).partition("|")
            if workspace is None or ws == workspace:
                rows.append((ws, url, int(count)))
        return sorted(rows, key=lambda row: (-row[2], row[0], row[1]))
