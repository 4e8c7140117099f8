"""What a webhook attempt is handed: the event as the step that owed it
snapshotted it (``lib/webhooks.lua``), read by the store's take
(``store/webhooks.py``) and delivered by ``delivery.py``. Plain data that
never reads Redis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..requests.record import snapshot_listed
from .ids import webhook_id


def _float(value: str | None) -> float | None:
    return float(value) if value else None


@dataclass(frozen=True)
class WebhookEvent:
    """The event as the step that owed it snapshotted it, and the attempt taking it."""

    request_id: str
    url: str
    workspace: str
    model: str
    status: str
    error_type: str | None
    response_url: str
    created_at: float
    started_at: float | None
    completed_at: float | None
    attempt: int
    first_attempt_at: float
    owed_at: float
    #: The request's cost at this step: {"credits", "state"} (held, or as its
    #: completion settled it).
    cost: dict[str, Any]
    #: The request's provider, whose due set holds the event.
    provider: str
    #: "started", "progress" or "completed" (an event owed before there were others).
    event: str = "completed"
    #: Its ``webhook-id``: stable across its attempts, its own among the request's events.
    msg_id: str = ""
    #: How far the generation was, on a progress event.
    progress: float | None = None
    #: The fields ``record.py`` lists on webhook events, as the event shows them.
    listed: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> "WebhookEvent":
        owed_at = float(fields.get("owed_at") or fields.get("completed_at") or fields["created_at"])
        return cls(
            request_id=fields["request_id"], url=fields["url"], workspace=fields.get("workspace", ""),
            model=fields.get("model", ""), status=fields.get("status", "COMPLETED"),
            error_type=fields.get("error_type") or None, response_url=fields.get("response_url", ""),
            created_at=float(fields["created_at"]), started_at=_float(fields.get("started_at")),
            completed_at=_float(fields.get("completed_at")), attempt=int(fields.get("attempts") or 1),
            first_attempt_at=float(fields.get("first_attempt_at") or owed_at), owed_at=owed_at,
            event=fields.get("type") or "completed", msg_id=fields.get("msg_id") or webhook_id(fields["request_id"]),
            progress=_float(fields.get("progress")),
            cost={"credits": int(float(fields.get("cost_credits") or 0)), "state": fields["cost_state"]},
            provider=fields["provider"], listed=snapshot_listed(fields),
        )
