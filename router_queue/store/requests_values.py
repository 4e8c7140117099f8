"""What the request store's calls take and answer: the request's values
outside its record (``record.py``), plain data that never reads Redis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .outcomes import Admit
from .record import RequestRecord

#: A request's priority within its workspace (``X-Comfy-Priority``).
PRIORITIES = ("high", "normal", "low")


@dataclass(frozen=True)
class Pace:
    """A provider's recent pace, for Retry-After: moving averages in seconds."""

    avg_run_s: float | None
    avg_gap_s: float | None


@dataclass(frozen=True)
class DeliveryTotals:
    """A provider's completions, fleet-wide, for the operations page: those
    complete.lua wrote (a delivery's outcome, or a cancel of one running)."""

    completed: int
    #: Completed in the last minute (the current window and the five before it: 50 to 60 s).
    last_minute: int
    #: Mean seconds the completed requests that ran had waited IN_QUEUE.
    avg_wait_s: float


@dataclass(frozen=True)
class StatusView:
    record: RequestRecord | None
    #: Requests ahead in the provider's queue; None once the request left it.
    position: int | None
    #: The provider's pace, for Retry-After: not read (all None) for a
    #: COMPLETED request, which is sent none (web/pacing.py).
    pace: Pace


@dataclass(frozen=True)
class HistoryPage:
    """One page of a workspace's requests, newest first (``history.lua``)."""

    #: Each listed request's record and its queue position (None unless IN_QUEUE).
    entries: list[tuple[RequestRecord, int | None]]
    #: The last history entry examined (its stream id, "{ms}-{seq}"), where
    #: the next page starts; None when the history (within the bounds) ends here.
    next_after: str | None


@dataclass(frozen=True)
class Admission:
    """The outcome of ``admit``."""

    outcome: Admit
    request_id: str | None = None
    position: int | None = None
    #: Credits the workspace had free, when it could not fund the request.
    available: int | None = None
    #: Which webhook lacked a signing secret: "header" (the request's own) or
    #: "default" (the workspace's), on NO_WEBHOOK_SECRET.
    webhook_source: str | None = None
    #: The retried request's status, on NOT_RETRYABLE: IN_QUEUE, IN_PROGRESS or SUCCEEDED.
    original_status: str | None = None
    #: Seconds until enough kept bodies expire, on STORED_BYTES_FULL.
    retry_after: int | None = None
    #: The budget that refused it, on BUDGET_EXCEEDED (``budgets.Refusal``).
    budget: Any = None


@dataclass(frozen=True)
class Lease:
    """How a delivery claims a request: who holds it and under what limits."""

    #: Unique to this execution, so a broker's redelivery of the same message
    #: while the first execution still runs is told apart from it.
    token: str
    lease_s: float
    queue_timeout_s: float
    max_takeovers: int
    #: "{task id}:{retry number}": resumes a lease its holder kept for this retry.
    resume_key: str = ""


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting IN_QUEUE, as the sweeper and the ops page see it."""

    id: str
    model: str
    workspace: str
    created_at: float


@dataclass(frozen=True)
class DeadlineDue:
    """A caller's deadline that has passed (``rq:deadlines:{provider}``)."""

    #: "start" (X-Comfy-Start-Deadline) or "run" (X-Comfy-Deadline).
    kind: str
    request_id: str
    #: None when the request's record has expired.
    workspace: str | None
    model: str | None


#: What ``record_progress`` answers when the request's webhook has an event due now.
WEBHOOK_DUE = 2
