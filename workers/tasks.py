"""Celery tasks. Thin: each takes a request id (or nothing) and calls a plain
function. The delivery semantics they run under are written down once, in
``router_queue/broker/celery_app.py``.
"""

from __future__ import annotations

import logging
import uuid

from celery import shared_task
from celery.signals import worker_ready, worker_shutting_down

from router_queue.batches.drain import drain as drain_lines
from router_queue.batches.finish import send_webhook as send_batch_webhook
from router_queue.broker.celery_app import (
    BATCH_WEBHOOK_TASK,
    BUDGET_ALERT_TASK,
    BULK_TASK,
    DELIVER_TASK,
    DRAIN_BATCH_TASK,
    SWEEP_TASK,
    WEBHOOK_TASK,
    queue_name,
)
from router_queue.catalog import Catalog
from router_queue.webhooks import budget_alerts, delivery as webhook_delivery

from . import bulk as bulk_actions
from .context import begin_shutdown, context_for
from .credentials import Credentials
from .delivery import Execution, Later, deliver as deliver_request
from .sweeper import sweep as sweep_once


@shared_task(
    bind=True,
    name=DELIVER_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    # Retries are how a delivery waits for a provider slot or backs off a
    # failed provider call; the call policy bounds provider attempts, so
    # Celery's own count is unbounded here.
    max_retries=None,
)
def deliver(self, request_id: str) -> str:
    context = context_for(self.app)
    retries = self.request.retries or 0
    execution = Execution(token=uuid.uuid4().hex, resume_key=f"{self.request.id}:{retries}",
                          next_resume_key=f"{self.request.id}:{retries + 1}")
    try:
        return deliver_request(context, request_id, execution)
    except Later as later:
        raise self.retry(countdown=later.countdown, max_retries=None) from None


@shared_task(bind=True, name=WEBHOOK_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             max_retries=0)
def deliver_webhook(self, request_id: str) -> str:
    """One attempt at a request's webhook event (router.webhooks). Retries are
    not Celery's: the event's next attempt is due in Redis, and the sweeper
    publishes it then."""
    context = context_for(self.app)
    return webhook_delivery.deliver(context.services, context.dispatcher, request_id)


@shared_task(bind=True, name=BATCH_WEBHOOK_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             max_retries=0)
def deliver_batch_webhook(self, workspace: str, batch_id: str) -> str:
    """One attempt at a batch's batch.completed webhook (router.webhooks).
    Safe to run twice: one attempt holds it; the next, if owed, is the
    sweeper's to publish."""
    context = context_for(self.app)
    return send_batch_webhook(context.services, workspace, batch_id)


@shared_task(bind=True, name=BUDGET_ALERT_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             max_retries=0)
def deliver_budget_alert(self, workspace: str, crossing: str) -> str:
    """One attempt at a budget crossing's alert (router.webhooks). Safe to
    run twice: a lease on the crossing lets one attempt hold it; the next,
    if owed, is the sweeper's to publish once its backoff ends."""
    context = context_for(self.app)
    return budget_alerts.send(context.services, workspace, crossing)


@shared_task(bind=True, name=DRAIN_BATCH_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             max_retries=0)
def drain_batch(self, workspace: str, batch_id: str) -> str:
    """Admit a batch's lines for up to its budget (``batches/drain.py``).
    Safe to run twice: one drain holds the batch, each line has its
    Idempotency-Key. More left: published again at once; a line waiting for
    room: the sweeper publishes it again."""
    context = context_for(self.app)
    drained = drain_lines(context.services, workspace, batch_id)
    if drained.stopped == "budget":
        context.dispatcher.publish_batch(workspace, batch_id)
    return drained.stopped


@shared_task(bind=True, name=SWEEP_TASK, acks_late=True, ignore_result=True, max_retries=0)
def sweep(self) -> dict[str, int]:
    report = sweep_once(context_for(self.app))
    return {"republished": report.republished, "reaped": report.reaped, "timed_out": report.timed_out,
            "webhooks": report.webhooks, "deadline_cancels": report.deadline_cancels}


@shared_task(bind=True, name=BULK_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             max_retries=0)
def bulk_step(self, workspace: str, bulk_id: str) -> None:
    """One step of a bulk action (``workers/bulk.py``), then its next published.
    Safe to run twice: its lease runs one step at a time, and each request is
    counted once; a step lost with its worker is published again by the sweeper."""
    context = context_for(self.app)
    countdown = bulk_actions.step(context, workspace, bulk_id)
    if countdown is not None:
        bulk_actions.publish_next(context, workspace, bulk_id, countdown)


log = logging.getLogger(__name__)


@worker_ready.connect
def _name_missing_credentials(sender=None, **_: object) -> None:
    """Say at start, not at the first request, which provider this worker
    consumes for has no credential, and which variable to set. The worker
    still starts: another one may hold the credential, and each request that
    finds none here ends in a retryable provider_error."""
    app = sender.app
    settings = app.router_settings
    catalog = Catalog.load(settings.catalog_path)
    consumed = set(app.amqp.queues.consume_from or {})
    providers = [p for p in catalog.providers() if queue_name(p) in consumed]
    for problem in Credentials(catalog, settings.provider_credentials).problems(providers):
        log.error("no credential: %s", problem)


@worker_shutting_down.connect
def _hand_back_on_shutdown(sender=None, **_: object) -> None:
    """Warm shutdown: polling generations hand their request back at their
    next step (another worker resumes them); synchronous calls finish."""
    begin_shutdown()
