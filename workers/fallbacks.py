"""When a request runs on another model it named (X-Comfy-Fallback-Models).

Only a request that named fallback models pays for any of this: each time
its model could not run (its pool had no member to give, or a member
answered 429, refused our credential or failed), the worker tells the store
(:func:`wait_or_turn`, this module's one entry; ``store/model_fallback.py``),
which keeps the clock on the record and, past ``FALLBACK_AFTER_SECONDS`` (or
the start deadline), names the next model. The worker then delivers it again at once, on that model: the same
provider's pool and slot, its URL, its output. ``docs/POOLS.md``.
"""

from __future__ import annotations

import logging
from typing import Callable

from router_queue.catalog import ModelEntry
from router_queue.requests.record import RequestRecord
from router_queue.services import Services
from router_queue.store.model_fallback import Turn, next_model

log = logging.getLogger(__name__)

#: What ``tried`` names as a member's trouble, by its HTTP status (else the failure's error type).
MEMBER_TROUBLE = {429: "rate_limited", 401: "credential_refused", 403: "credential_refused"}


def wait_or_turn(services: Services, record: RequestRecord, entry: ModelEntry, wait: float,
                 later: Callable[[float, str], Exception], member: str = "", error_type: str = "") -> float:
    """``entry`` could not run ``record``: the trouble noted (:func:`_trouble`);
    when the request now runs on another model, ``later(0.0, …)`` is raised
    (delivered again at once, on that model); else ``wait``, cut short to
    when its turn is due. The one step each of the worker's waits takes."""
    turn = _trouble(services, record, entry, member, error_type)
    if turn is None:
        return wait
    if turn.model and turn.model != entry.id:
        raise later(0.0, f"{entry.id} could not run it ({error_type or 'its pool kept it waiting'}): "
                         f"it falls back to {turn.model}")
    return wait if turn.gone or turn.model else min(wait, turn.wait_s)


def _trouble(services: Services, record: RequestRecord, entry: ModelEntry, member: str,
             error_type: str) -> Turn | None:
    """Note that ``entry`` could not run ``record`` now; None when there is
    nothing to fall back to (no model named, or every one tried)."""
    upcoming = next_model(record, entry.id) if record.fallback_models else ""
    if not upcoming or services.model_fallback is None:
        return None
    following = services.catalog.by_id(upcoming)  # its price is what the request is charged once it turns
    turn = services.model_fallback.trouble(record, entry.id, upcoming, member, error_type,
                                           next_price=following.price_credits if following else None)
    if turn.model and turn.model != entry.id:
        log.warning("request %s: %s could not run it for %.0f s; it falls back to %s", record.id, entry.id,
                    services.model_fallback.after_s, turn.model, extra={"model_ran": turn.model})
    return turn
