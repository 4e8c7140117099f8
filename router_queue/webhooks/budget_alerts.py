"""A budget threshold crossed (``store/budgets.py``) told once: a signed
``budget.threshold_crossed`` webhook to the workspace's default webhook
(Standard Webhooks, the same signing and POST as a request's event, its
webhook-id fixed per threshold and period so a receiver dedupes a repeat),
tried once per sweep up to :data:`MAX_ATTEMPTS`; without a default webhook,
a line in the workspace's audit log (``router-queue key audit``) and a log
line. Each ends counted in ``router_queue_budget_alerts``.
"""

from __future__ import annotations

import http.client
import json
import logging
import time

from ..services import Services
from ..store.budgets import Crossing
from ..store.secret_box import SecretsKeyError
from . import event as webhook_event, safety
from .delivery import AttemptTimedOut, post

log = logging.getLogger(__name__)

EVENT_TYPE = "budget.threshold_crossed"
#: Attempts at one alert, one per sweep at most, before it is given up (and audited).
MAX_ATTEMPTS = 10
#: Workspaces with a budget read per sweep at most.
WORKSPACES_PER_SWEEP = 1000
ATTEMPT_FAILURES = (ValueError, safety.LookupsBusy, SecretsKeyError, AttemptTimedOut, OSError,
                    http.client.HTTPException)


def body_of(crossing: Crossing) -> bytes:
    return json.dumps(crossing.body(), sort_keys=True, separators=(",", ":")).encode()


def send_owed(services: Services) -> int:
    """One pass over the crossings owed: each alert attempted once; how many ended."""
    budgets = services.accounts.budgets
    ended = 0
    for crossing in budgets.owed(budgets.alerting()[:WORKSPACES_PER_SWEEP]):
        outcome = _attempt(services, crossing)
        if outcome == "failed":
            if budgets.sent(crossing, ended=False) < MAX_ATTEMPTS:
                continue
            outcome = "given_up"
            audit(services, crossing, outcome)
        if outcome != "failed":
            budgets.sent(crossing, ended=True)
            services.metrics.budget_alert(crossing.period, crossing.threshold, outcome)
            ended += 1
    return ended


def _attempt(services: Services, crossing: Crossing) -> str:
    """"delivered", "audited" (no default webhook) or "failed"."""
    settings = services.settings
    url = services.accounts.webhook_url(crossing.workspace)
    if not url:
        audit(services, crossing, "audited")
        return "audited"
    try:
        addresses = safety.check(url, allow_loopback_http=settings.webhook_allow_loopback_http,
                                 resolve_timeout_s=settings.webhook_resolve_timeout_s, holder=crossing.workspace)
        signing = services.accounts.signing_secrets(crossing.workspace)
        if not signing:
            raise ValueError("the workspace has no webhook signing secret")
        body = body_of(crossing)
        headers = webhook_event.signed_headers(crossing.webhook_id, body, signing, int(time.time()))
        status = post(url, str(addresses[0]), body, headers, settings.webhook_timeout_s)
        return "delivered" if 200 <= status < 300 or status == 410 else "failed"
    except ATTEMPT_FAILURES as exc:  # this attempt's; the next sweep tries again
        log.warning("budget alert %s: attempt failed (%s)", crossing.webhook_id, type(exc).__name__,
                    extra={"workspace": crossing.workspace})
        return "failed"


def audit(services: Services, crossing: Crossing, outcome: str) -> None:
    """The crossing in the workspace's audit log (``key audit``: newest first) and the log."""
    line = {"at": time.time(), "action": EVENT_TYPE, "key_id": crossing.scope if crossing.scope != "ws" else "-",
            "workspace": crossing.workspace, "by": "budget", "outcome": outcome, **crossing.body()}
    services.accounts.budgets.audit(crossing, line)
    log.warning("budget %s: %s%% of its %s budget (%d credits) crossed, %d spent; %s", crossing.webhook_id,
                crossing.threshold, crossing.period, crossing.budget, crossing.spent, outcome,
                extra={"audit": "budget", "workspace": crossing.workspace})
