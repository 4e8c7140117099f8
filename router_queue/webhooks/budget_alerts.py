"""A budget threshold crossed (``store/budgets.py``) told once: a signed
``budget.threshold_crossed`` webhook to the workspace's default webhook
(Standard Webhooks, its webhook-id fixed per threshold and period so a
receiver dedupes a repeat); without a default webhook, a line in the
workspace's audit log (``router-queue key audit``) and a log line.
The sweeper only publishes the crossings due (:func:`publish_owed`, bounded
per sweep); the webhooks worker sends each (:func:`send`), as a batch's
``batch.completed`` is: under a lease on the crossing (two workers never send
it at once), in the workspace's turn and past the endpoint's circuit
(``workspace_events.py``), a failure due again after the webhook retry delays,
given up (and audited) at :data:`MAX_ATTEMPTS`. Each ends counted in ``router_queue_budget_alerts``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Callable

from ..services import Services
from ..store.budgets import Crossing
from . import retry_policy
from .workspace_events import attempt_in_turn

log = logging.getLogger(__name__)

EVENT_TYPE = "budget.threshold_crossed"
#: Attempts at one alert before it is given up (and audited).
MAX_ATTEMPTS = 10
#: Workspaces with a budget read per sweep at most.
WORKSPACES_PER_SWEEP = 1000
#: Crossings published per sweep at most (the rest: the next sweep).
CROSSINGS_PER_SWEEP = 500


def body_of(crossing: Crossing) -> bytes:
    return json.dumps(crossing.body(), sort_keys=True, separators=(",", ":")).encode()


def publish_owed(services: Services, publish: Callable[[str, str], None], now: float | None = None) -> int:
    """The sweeper's part: each crossing owed and due (not held by an
    attempt, its backoff over) published as (workspace, crossing) to the
    webhooks worker; nothing is sent here, so no receiver holds a sweep.
    Each is marked in flight for WEBHOOK_LEASE_SECONDS as it is found due, in
    one step (``Budgets.publishing``): a message still queued is not
    published again by the next sweeps, and one lost is once that time
    passes untaken. How many were published."""
    now = time.time() if now is None else now
    budgets = services.accounts.budgets
    due: dict[str, list[str]] = {}
    found = 0
    for crossing in budgets.owed(budgets.alerting()[:WORKSPACES_PER_SWEEP]):
        if found >= CROSSINGS_PER_SWEEP:
            break
        if crossing.due <= now and crossing.in_flight_until <= now:
            due.setdefault(crossing.workspace, []).append(crossing.ident)
            found += 1
    published = 0
    for workspace, idents in due.items():
        for ident in budgets.publishing(workspace, idents, now=now, until=now + services.settings.webhook_lease_s):
            publish(workspace, ident)
            published += 1
    return published


def send(services: Services, workspace: str, ident: str) -> str:
    """One attempt at the crossing ``ident`` (the webhooks worker's task):
    "delivered", "audited" (no default webhook), "failed" (due again after
    the retry delay) or "given_up" (audited); or, nothing sent, "busy"
    (another attempt holds it, or its backoff runs), "not_owed", or
    "waiting" (the workspace's turn full, the endpoint's circuit open: due
    at the next sweep, no attempt counted). A worker that dies mid-attempt
    leaves it held until WEBHOOK_LEASE_SECONDS pass."""
    settings, token = services.settings, uuid.uuid4().hex
    budgets = services.accounts.budgets
    taken = budgets.take(workspace, ident, token=token, now=time.time(), lease_s=settings.webhook_lease_s)
    if isinstance(taken, str):
        return taken
    crossing, attempt = taken, taken.attempts + 1
    url = services.accounts.webhook_url(workspace)
    if not url:
        outcome = "audited"
        audit(services, crossing, outcome)
    else:
        outcome = attempt_in_turn(services, workspace=workspace, url=url, webhook_id=crossing.webhook_id,
                                  event=EVENT_TYPE, attempt=attempt, token=token, body=lambda: body_of(crossing))
    if outcome == "waiting":
        budgets.sent(crossing, token=token, outcome="released")
        return outcome
    if outcome == "failed" and attempt < MAX_ATTEMPTS:
        delay = retry_policy.delay_after(attempt, settings.webhook_retry_schedule_s)
        budgets.sent(crossing, token=token, outcome="failed", again_at=time.time() + delay)
        return outcome
    if outcome == "failed":
        outcome = "given_up"
        audit(services, crossing, outcome)
    budgets.sent(crossing, token=token, outcome="ended")
    services.metrics.budget_alert(crossing.period, crossing.threshold, outcome)
    return outcome


def audit(services: Services, crossing: Crossing, outcome: str) -> None:
    """The crossing in the workspace's audit log (``key audit``: newest first) and the log."""
    line = {"at": time.time(), "action": EVENT_TYPE, "key_id": crossing.scope if crossing.scope != "ws" else "-",
            "workspace": crossing.workspace, "by": "budget", "outcome": outcome, **crossing.body()}
    services.accounts.budgets.audit(crossing, line)
    log.warning("budget %s: %s%% of its %s budget (%d credits) crossed, %d spent; %s", crossing.webhook_id,
                crossing.threshold, crossing.period, crossing.budget, crossing.spent, outcome,
                extra={"audit": "budget", "workspace": crossing.workspace})
