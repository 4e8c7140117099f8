"""When a request runs on another model it named (X-Comfy-Fallback-Models).

Only a request that named fallback models pays for any of this: each time
its model could not run (its pool had no member to give, or a member
answered 429, refused our credential or failed), the worker tells the
store (``store/model_fallback.py``), which keeps the clock on the record
and, past ``FALLBACK_AFTER_SECONDS`` (or the start deadline), names the next
model. The worker then delivers it again at once, on that model: the same
provider's pool and slot, its URL, its output. ``docs/POOLS.md``.
"""

from __future__ import annotations

import logging

from router_queue.catalog import ModelEntry
from router_queue.requests.record import RequestRecord
from router_queue.services import Services
from router_queue.store.model_fallback import Turn, next_model

log = logging.getLogger(__name__)

#: What ``tried`` names as a member's trouble, by its HTTP status (else the failure's error type).
MEMBER_TROUBLE = {429: "rate_limited", 401: "credential_refused", 403: "credential_refused"}


def trouble(services: Services, record: RequestRecord, entry: ModelEntry, member: str = "",
            error_type: str = "") -> Turn | None:
    """Note that ``entry`` could not run ``record`` now; None when there is
    nothing to fall back to (no model named, or every one tried)."""
    upcoming = next_model(record, entry.id) if record.fallback_models else ""
    if not upcoming or services.model_fallback is None:
        return None
    following = services.catalog.by_id(upcoming)  # its price is what the request is charged once it turns
    turn = services.model_fallback.trouble(record, entry.id, member, error_type,
                                           next_price=following.price_credits if following else None)
    if turn.model and turn.model != entry.id:
        log.warning("request %s: %s could not run it for %.0f s; it falls back to %s", record.id, entry.id,
                    services.model_fallback.after_s, turn.model, extra={"model_ran": turn.model})
    return turn


def turned(turn: Turn | None, entry: ModelEntry) -> str:
    """The model the request now runs on, when it is no longer ``entry``'s ("" otherwise)."""
    if turn is None or not turn.model or turn.model == entry.id:
        return ""
    return turn.model


def wait_s(turn: Turn | None, wait: float) -> float:
    """``wait``, cut short to when a turn is due."""
    if turn is None or turn.gone or turn.model:
        return wait
    return min(wait, turn.wait_s)
