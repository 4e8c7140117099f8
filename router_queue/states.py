"""Request statuses and the failure buckets a completed request can carry.

A status only moves forward along ``ORDER``; the Lua scripts enforce it.
"""

from __future__ import annotations

IN_QUEUE = "IN_QUEUE"
IN_PROGRESS = "IN_PROGRESS"
COMPLETED = "COMPLETED"

#: The forward order of statuses; a write that would go backwards is refused.
ORDER = (IN_QUEUE, IN_PROGRESS, COMPLETED)

# Buckets a COMPLETED request may carry in ``error_type`` (absent on success).
CANCELLED = "cancelled"
QUEUE_TIMEOUT = "queue_timeout"
CONTENT_POLICY_VIOLATION = "content_policy_violation"
INVALID_INPUT = "invalid_input"
PROVIDER_ERROR = "provider_error"
PROVIDER_TIMEOUT = "provider_timeout"
INTERNAL_ERROR = "internal_error"

#: HTTP status the result route answers for a request that completed with
#: each bucket (the contract's error table).
RESULT_STATUS = {
    CANCELLED: 409,
    QUEUE_TIMEOUT: 504,
    CONTENT_POLICY_VIOLATION: 400,
    INVALID_INPUT: 422,
    PROVIDER_ERROR: 502,
    PROVIDER_TIMEOUT: 504,
    INTERNAL_ERROR: 500,
}
