"""A batch's end: marked COMPLETED once every line has ended (once, by
whichever reader sees it first: a status read or the sweeper), then its one
``batch.completed`` webhook, signed as a request's events are (Standard
Webhooks, ``webhooks/event.py``), with webhook-id ``batch_<batch_id>`` on
every attempt. The sweeper makes one attempt a run, up to
:data:`MAX_ATTEMPTS`, each through the same URL checks and POST as a
request's event (``webhooks/safety.py``, ``webhooks/delivery.post``).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any

from ..services import Services
from ..states import COMPLETED
from ..store.secret_box import SecretsKeyError
from ..webhooks import event as webhook_event, safety
from ..webhooks.delivery import AttemptTimedOut, post
from .reading import CHUNK, Summary, kept_counts, line_views, summary

log = logging.getLogger(__name__)

EVENT_TYPE = "batch.completed"
#: What ends one attempt: the URL refused or unresolved, no secret, the POST's faults.
ATTEMPT_FAILURES = (ValueError, safety.LookupsBusy, SecretsKeyError, AttemptTimedOut, OSError,
                    http.client.HTTPException)
#: Attempts at a batch's webhook, one per sweep at most, before it is given up.
MAX_ATTEMPTS = 10


def webhook_id(batch_id: str) -> str:
    return f"batch_{batch_id}"


def all_ended(services: Services, workspace: str, batch_id: str, batch: dict[str, str]) -> bool:
    """Whether every line has ended, read from the first line not known to
    have (the batch's ``ended`` hint, moved on here): a sweep of a batch whose
    lines run reads only those still running, not the whole batch."""
    total, first = int(batch.get("total", 0)), int(batch.get("ended", 0)) + 1
    while first <= total:
        count = min(CHUNK, total - first + 1)
        for view in line_views(services, workspace, batch_id, batch, first, count):
            if view.status != COMPLETED:
                services.batches.note_ended(workspace, batch_id, view.line - 1)
                return False
        first += count
    return True


def finish_if_done(services: Services, workspace: str, batch_id: str, batch: dict[str, str]) -> Summary | None:
    """When every line has ended, the batch marked COMPLETED (its counts
    kept, its webhook owed if it has one) and its summary; else None."""
    if batch.get("status") != COMPLETED and not all_ended(services, workspace, batch_id, batch):
        return None
    found = summary(services, workspace, batch_id, batch)
    if found.status == COMPLETED and batch.get("status") != COMPLETED:
        webhook = bool(batch.get("webhook_url") or services.accounts.webhook_url(workspace))
        if services.batches.finish(workspace, batch_id, kept_counts(found), time.time(), webhook=webhook):
            log.info("batch %s completed", batch_id, extra={"workspace": workspace})
    return found


def webhook_body(batch_id: str, found: Summary, results_url: str) -> bytes:
    body: dict[str, Any] = {"type": EVENT_TYPE, "batch_id": batch_id,
                            "counts": found.as_json()["counts"], "results_url": results_url}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def send_webhook(services: Services, workspace: str, batch_id: str, batch: dict[str, str]) -> str:
    """One attempt at the batch's webhook: "delivered", "failed" (tried
    again next sweep) or "given_up"; its state is kept on the batch."""
    settings = services.settings
    attempts = int(batch.get("webhook_attempts", 0)) + 1
    url = batch.get("webhook_url") or services.accounts.webhook_url(workspace) or ""
    outcome = "failed"
    try:
        addresses = safety.check(url, allow_loopback_http=settings.webhook_allow_loopback_http,
                                 resolve_timeout_s=settings.webhook_resolve_timeout_s, holder=workspace)
        signing = services.accounts.signing_secrets(workspace)
        if not signing:
            raise ValueError("the workspace has no webhook signing secret")
        found = summary(services, workspace, batch_id, batch)
        body = webhook_body(batch_id, found, f"{batch.get('base_url', '')}/v2/batches/{batch_id}/results")
        headers = webhook_event.signed_headers(webhook_id(batch_id), body, signing, int(time.time()))
        status = post(url, str(addresses[0]), body, headers, settings.webhook_timeout_s)
        outcome = "delivered" if 200 <= status < 300 or status == 410 else "failed"
    except ATTEMPT_FAILURES as exc:  # this attempt's; the next sweep tries again
        log.warning("batch %s: its webhook attempt %d failed (%s)", batch_id, attempts, type(exc).__name__)
    if outcome == "failed" and attempts >= MAX_ATTEMPTS:
        outcome = "given_up"
    services.batches.mark_webhook(workspace, batch_id, outcome if outcome != "failed" else "owed", attempts)
    return outcome
