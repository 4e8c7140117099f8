"""One error tree for the front door; ``app.py`` renders every member the same way.

Each class is one bucket of the contract's error table: it carries the HTTP
status and the bucket that goes on ``X-Comfy-Error-Type`` and in the body.
"""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    """Base of every error the API answers with. Never raised bare."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, detail: str | list[dict[str, Any]], *, retry_after: int | None = None):
        super().__init__(detail if isinstance(detail, str) else "per-field errors")
        self.detail = detail
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error_type": self.error_type, "detail": self.detail}

    def headers(self) -> dict[str, str]:
        headers = {"X-Comfy-Error-Type": self.error_type}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(self.retry_after)))
        return headers


class InvalidInput(RouterError):
    """Body is not JSON or not an object (400)."""

    status = 400
    error_type = "invalid_input"


class ValidationFailed(InvalidInput):
    """The model's schema rejected the input; ``detail`` is the per-field array (422)."""

    status = 422


class PayloadTooLarge(InvalidInput):
    status = 413


class UnsupportedMediaType(InvalidInput):
    """A body of a Content-Type the route does not take (415): a batch is NDJSON."""

    status = 415


class RangeNotSatisfiable(InvalidInput):
    """A ``Range`` that selects nothing of the result (416); ``Content-Range`` names its size."""

    status = 416

    def __init__(self, detail: str, *, size: int):
        super().__init__(detail)
        self.size = size

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Content-Range": f"bytes */{self.size}"}


class IdempotencyKeyConflict(InvalidInput):
    """The ``Idempotency-Key`` is bound to a different request (409)."""

    status = 409


class NotRetryable(InvalidInput):
    """A retry of a request that has not failed, or whose body is gone (409)."""

    status = 409


class RetryLimitReached(RouterError):
    """A retry past its chain's cap, ``RETRY_MAX_PER_REQUEST`` retries all told (409)."""

    status = 409
    error_type = "retry_limit_reached"


class Unauthorized(RouterError):
    status = 401
    error_type = "unauthorized"


class InsufficientCredits(RouterError):
    status = 402
    error_type = "insufficient_credits"


class BudgetExceeded(RouterError):
    """A submit whose hold would take a budget (the workspace's or its key's,
    per day, week or month) over its limit: nothing queued or held (402)."""

    status = 402
    error_type = "budget_exceeded"


class NotEnabled(RouterError):
    status = 403
    error_type = "not_enabled"


class ModelNotFound(RouterError):
    status = 404
    error_type = "model_not_found"


class RequestNotFound(RouterError):
    status = 404
    error_type = "request_not_found"


class BulkNotFound(RouterError):
    """No such bulk action for this caller (another workspace's looks the same)."""

    status = 404
    error_type = "bulk_not_found"


class BatchNotFound(RouterError):
    """No batch of this workspace has this id (404): never one, or another workspace's."""

    status = 404
    error_type = "batch_not_found"


class ConcurrencyLimitExceeded(RouterError):
    """The same ``Idempotency-Key`` is still being admitted (409 + Retry-After)."""

    status = 409
    error_type = "concurrency_limit_exceeded"


class Gone(RouterError):
    """The request existed and is past its retention window (410, no bucket)."""

    status = 410
    error_type = ""

    def body(self) -> dict[str, Any]:
        return {"detail": self.detail}

    def headers(self) -> dict[str, str]:
        return {}


class MethodNotAllowed(RouterError):
    status = 405
    error_type = "invalid_input"


class QueueBacklogFull(RouterError):
    status = 429
    error_type = "queue_backlog_full"


class RateLimited(RouterError):
    """The caller's request rate is spent (429): with Retry-After, and the
    RateLimit header fields of the window that refused (``web/ratelimit.py``)."""

    status = 429
    error_type = "rate_limited"

    def __init__(self, detail: str, *, retry_after: int | None = None, fields: dict[str, str] | None = None):
        super().__init__(detail, retry_after=retry_after)
        self.fields = fields or {}

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.fields}


class QueuedBytesFull(RouterError):
    """The body would put the workspace's stored bodies over its byte quota (429)."""

    status = 429
    error_type = "queued_bytes_full"


class StoredBytesFull(RouterError):
    """The workspace keeps as many bytes past its requests' ends as it may (429)."""

    status = 429
    error_type = "stored_bytes_full"


class PendingWebhooksFull(RouterError):
    """A webhook named while the workspace has as many events pending as it may (429)."""

    status = 429
    error_type = "pending_webhooks_full"


class HeldCallsFull(RouterError):
    """The workspace holds as many synchronous calls and event streams open as it may (429)."""

    status = 429
    error_type = "held_calls_full"


class DeadlineExceeded(RouterError):
    """The synchronous route's connection bound ran out (504 + Retry-After while it runs)."""

    status = 504
    error_type = "deadline_exceeded"


class OutcomeUnknown(RouterError):
    """A submit without an ``Idempotency-Key`` whose admission's reply was lost
    and whose outcome the store did not tell in time (504). It names the id
    the request has if it was admitted, and where to read whether it was."""

    status = 504
    error_type = "outcome_unknown"

    def __init__(self, detail: str, *, request_id: str, status_url: str):
        super().__init__(detail, retry_after=1)
        self.request_id = request_id
        self.status_url = status_url

    def body(self) -> dict[str, Any]:
        return {**super().body(), "request_id": self.request_id, "status_url": self.status_url}


class InternalError(RouterError):
    status = 500
    error_type = "internal_error"


class ServiceUnavailable(RouterError):
    status = 503
    error_type = "service_unavailable"


class StoreLost(ServiceUnavailable):
    """The store no longer holds the data this process served (``store/epoch.py``)."""


class CompletedWithError(RouterError):
    """The result read of a request that completed with ``error_type``."""

    def __init__(self, status: int, error_type: str, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.error_type = error_type
        self.extra_headers = headers or {}

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.extra_headers}
