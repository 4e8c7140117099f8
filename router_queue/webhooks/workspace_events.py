"""One attempt at a workspace's own event, not a request's
(``batch.completed``, ``budget.threshold_crossed``), as the webhooks worker
makes it: in the workspace's turn and past the endpoint's circuit
(``webhook_turn.lua``), signed and POSTed as every event is
(``delivery.send_signed``), then the turn ended, the circuit told and the
attempt logged beside the workspace's request events (``webhook_turn_end.lua``,
``router-queue ops webhooks``). What an event owes between attempts (its lease,
its count, its backoff) stays with its owner.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Callable

from ..store.webhooks import HELD
from ..urls import origin
from .delivery import SEND_FAILURES, send_signed

if TYPE_CHECKING:
    from ..services import Services

log = logging.getLogger(__name__)


def attempt_in_turn(services: Services, *, workspace: str, url: str, webhook_id: str, event: str, attempt: int,
                    token: str, body: Callable[[], bytes]) -> str:
    """"delivered" (a 2xx, or 410: the receiver wants no more), "failed", or
    "waiting": the workspace's turn is full or the endpoint's circuit open,
    nothing sent and nothing counted. ``body`` is built only once the turn
    is held; ``token`` names the attempt's slot in the turn."""
    settings, now = services.settings, time.time()
    endpoint = origin(url)
    turn, _ = services.webhooks.turn(workspace, endpoint, now=now, lease_s=settings.webhook_lease_s, token=token)
    if turn not in HELD:
        return "waiting"
    outcome, status, error, began = "failed", None, "", time.monotonic()
    try:
        status = send_signed(services, url=url, workspace=workspace, webhook_id=webhook_id, body=body())
        outcome = "delivered" if 200 <= status < 300 or status == 410 else "failed"
    except SEND_FAILURES as exc:  # this attempt's; its owner says when the next is
        error = type(exc).__name__
        log.warning("%s %s: attempt %d failed (%s)", event, webhook_id, attempt, error,
                    extra={"workspace": workspace})
    entry = json.dumps({"at": now, "request_id": webhook_id, "event": event, "origin": endpoint,
                        "attempt": attempt, "outcome": outcome, "status": status, "error": error,
                        "seconds": round(time.monotonic() - began, 3)}, separators=(",", ":"))
    services.webhooks.end_turn(workspace, endpoint, token=token, now=time.time(), outcome=outcome,
                               endpoint_failed=outcome == "failed", entry=entry, probe=turn == "PROBE")
    return outcome
