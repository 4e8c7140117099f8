"""A batch's end: marked COMPLETED once every line has ended (once, by
whichever reader sees it first: a status read or the sweeper), then its one
``batch.completed`` webhook, signed as a request's events are (Standard
Webhooks, ``webhooks/event.py``), with webhook-id ``batch_<batch_id>`` on
every attempt. The sweeper publishes an attempt a run to the webhooks
worker (``router.webhooks``), up to :data:`MAX_ATTEMPTS`, each in its
workspace's turn and past its endpoint's circuit, as a request's event is
(``webhooks/workspace_events.py``), and through the same URL checks and POST.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from ..services import Services
from ..states import COMPLETED
from ..webhooks.workspace_events import attempt_in_turn
from .reading import CHUNK, Summary, kept_counts, line_views, summary

log = logging.getLogger(__name__)

EVENT_TYPE = "batch.completed"
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


def send_webhook(services: Services, workspace: str, batch_id: str) -> str:
    """One attempt at the batch's webhook (the webhooks worker's task):
    "delivered", "failed" (tried again by a later sweep) or "given_up", its
    state kept on the batch; or, nothing sent, "busy" (another attempt holds
    it), "not_owed", or "waiting" (its workspace's turn full, or the
    endpoint's circuit open: still owed, and no attempt counted). A failed
    attempt keeps its lease (WEBHOOK_LEASE_SECONDS), so the next is that far off."""
    token = uuid.uuid4().hex
    if not services.batches.take_webhook(workspace, batch_id, token, services.settings.webhook_lease_s):
        return "busy"
    outcome = "failed"  # until the attempt says otherwise: a failure keeps the lease, spacing the next
    try:
        outcome = _attempt(services, workspace, batch_id, token)
        return outcome
    finally:
        if outcome != "failed":
            services.batches.release_webhook(workspace, batch_id)


def _attempt(services: Services, workspace: str, batch_id: str, token: str) -> str:
    batch = services.batches.get(workspace, batch_id) or {}
    if batch.get("webhook") != "owed":
        return "not_owed"
    url = batch.get("webhook_url") or services.accounts.webhook_url(workspace) or ""
    attempts = int(batch.get("webhook_attempts", 0)) + 1

    def body() -> bytes:
        found = summary(services, workspace, batch_id, batch)
        return webhook_body(batch_id, found, f"{batch.get('base_url', '')}/v2/batches/{batch_id}/results")
    outcome = attempt_in_turn(services, workspace=workspace, url=url, webhook_id=webhook_id(batch_id),
                              event=EVENT_TYPE, attempt=attempts, token=token, body=body)
    if outcome == "waiting":
        return outcome
    if outcome == "failed" and attempts >= MAX_ATTEMPTS:
        outcome = "given_up"
    services.batches.mark_webhook(workspace, batch_id, outcome if outcome != "failed" else "owed", attempts)
    return outcome
