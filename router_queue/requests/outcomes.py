"""What the store's Lua scripts answer, by name.

Each script replies with a code first (see the ``returns`` comment at the top
of its file in ``lua/``); the store turns it into one of these, and callers
compare against members, never against spelled-out strings. A member is a
``str``, so it logs and compares as the code itself.
"""

from __future__ import annotations

from enum import StrEnum


class Admit(StrEnum):
    """admit.lua"""

    ADMITTED = "ADMITTED"  #: in the schedule, with a slot and its message when one was free
    REPLAY = "REPLAY"  #: the Idempotency-Key's earlier request, with the same body
    IDEM_CONFLICT = "IDEM_CONFLICT"  #: the key is held by a different request
    NOT_ENABLED = "NOT_ENABLED"  #: queued delivery is off for the workspace
    BACKLOG_FULL = "BACKLOG_FULL"  #: the workspace has as many waiting as it may
    QUEUED_BYTES_FULL = "QUEUED_BYTES_FULL"  #: the body would put the workspace over its byte quota
    #: its kept bodies and this one would pass its stored-bytes quota (``retry_after``: until enough expire)
    STORED_BYTES_FULL = "STORED_BYTES_FULL"
    PENDING_WEBHOOKS_FULL = "PENDING_WEBHOOKS_FULL"  #: the workspace has as many webhook events pending as it may
    INSUFFICIENT_CREDITS = "INSUFFICIENT_CREDITS"
    #: its hold would take a budget of the workspace or of the caller's key over its limit this period
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"
    DRAINING = "DRAINING"  #: the provider admits nothing new
    #: a batch's line whose batch was cancelled first (batch_cancel.lua): changed nothing
    BATCH_CANCELLED = "BATCH_CANCELLED"
    #: a webhook is named (``source``: "header" or the workspace's "default")
    #: and the workspace has no signing secret to sign its event with
    NO_WEBHOOK_SECRET = "NO_WEBHOOK_SECRET"
    #: webhook events are chosen and there is no webhook (no URL of the
    #: request's own, no workspace default) to send them to
    NO_WEBHOOK = "NO_WEBHOOK"
    RATE_LIMITED = "RATE_LIMITED"  #: the caller's rate window is spent
    EXPIRED = "EXPIRED"  #: reached Redis past its deadline; changed nothing
    #: the Idempotency-Key's first request is still being admitted (a split
    #: store's two steps: ``admission.py``); changed nothing
    ADMITTING = "ADMITTING"
    #: its reply was lost and Redis did not say in time whether it ran
    #: (``admission.LostReplies``): it may have been admitted, or not
    IN_DOUBT = "IN_DOUBT"
    RETRY_MISSING = "RETRY_MISSING"  #: a retry of no request of this caller and model (or past retention)
    NOT_RETRYABLE = "NOT_RETRYABLE"  #: a retry of a request not COMPLETED with an error_type
    RETRY_BODY_GONE = "RETRY_BODY_GONE"  #: a retry of a failed request whose body is no longer kept
    RETRY_LIMIT = "RETRY_LIMIT"  #: a retry past its chain's cap (``RETRY_MAX_PER_REQUEST`` retries all told)


class Cancel(StrEnum):
    """cancel.lua"""

    CANCELLED = "CANCELLED"  #: it was waiting; it is COMPLETED, cancelled
    REQUESTED = "REQUESTED"  #: it runs; its worker stops it where the provider allows
    ALREADY_COMPLETED = "ALREADY_COMPLETED"
    MISSING = "MISSING"  #: no such request of this caller (or past retention)
    EXPIRED = "EXPIRED"  #: reached Redis past its deadline; changed nothing
    #: the Idempotency-Key's first request is still being admitted (a split
    #: store's two steps: ``admission.py``); changed nothing
    ADMITTING = "ADMITTING"


class Claim(StrEnum):
    """claim.lua"""

    CLAIMED = "CLAIMED"  #: this delivery runs it
    RESUMED = "RESUMED"  #: this delivery resumes a lease its holder kept for it
    WAITING = "WAITING"  #: not granted a slot: a stray message; nothing starts
    LEASED = "LEASED"  #: another execution holds a live lease
    QUEUE_TIMEOUT = "QUEUE_TIMEOUT"  #: waited past its queue timeout or start deadline; ended
    DEADLINE = "DEADLINE"  #: claimed past its caller's deadline; ended cancelled, never run
    EXHAUSTED = "EXHAUSTED"  #: taken over too often; ended provider_error
    COMPLETED = "COMPLETED"  #: already finished
    MISSING = "MISSING"  #: gone (past retention)


class Complete(StrEnum):
    """complete.lua"""

    COMPLETED = "COMPLETED"  #: this call wrote the outcome and settled it
    ALREADY_COMPLETED = "ALREADY_COMPLETED"  #: the first outcome written stands
    MISSING = "MISSING"
    #: An output for the Redis fallback did not fit its budget: nothing written,
    #: the request is still IN_PROGRESS (``workers/outputs.py`` tries again).
    FALLBACK_FULL = "FALLBACK_FULL"


class Status(StrEnum):
    """status.lua"""

    OK = "OK"
    RATE_LIMITED = "RATE_LIMITED"  #: the caller's rate window is spent


class ExpireQueued(StrEnum):
    """expire_queued.lua"""

    TIMED_OUT = "TIMED_OUT"
    KEPT = "KEPT"
