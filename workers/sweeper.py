"""Housekeeping, run by Celery beat every ``SWEEP_INTERVAL_SECONDS``.

Each run: grants whose message was lost and running requests whose lease ran
out are published again; requests past their queue timeout or the caller's
start deadline end ``queue_timeout``, those past ``X-Comfy-Deadline`` are
cancelled (``cancel.lua``); free slots are granted; on a split store, owed
workspace effects are given and abandoned admissions undone; webhook events
due, batches' and budget alerts' included, are published to ``router.webhooks``; results in the object store whose
records expired are deleted (``object_expiry.py``), those kept in Redis while it
was away moved to it (``result_moves.py``). Every action is safe to repeat: the
claim lets one delivery run a request. Each in full: ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from router_queue import states
from router_queue.batches.sweep import sweep_batches
from router_queue.requests.outcomes import Cancel
from router_queue.webhooks.budget_alerts import publish_owed as publish_budget_alerts

from .bulk import resume_overdue
from .context import WorkerContext
from .object_expiry import expire_objects
from .result_moves import move_fallback_results

log = logging.getLogger(__name__)

#: How many requests at the head of each queue are checked for queue timeout.
QUEUE_HEAD = 100
#: Most caller deadlines of one provider acted on per sweep (the rest: next sweep).
DEADLINES_PER_SWEEP = 500


@dataclass(frozen=True)
class SweepReport:
    republished: int
    reaped: int
    timed_out: int
    webhooks: int = 0
    #: Requests cancelled (or flagged, while running) at their caller's deadline.
    deadline_cancels: int = 0
    #: Workspace effects applied for a caller that died between the steps.
    effects_reconciled: int = 0
    #: Admissions given up between their steps, their workspace's part undone.
    admissions_abandoned: int = 0
    #: Object-store results deleted: their records expired; orphans (the hourly pass).
    objects_deleted: int = 0
    orphans_deleted: int = 0
    #: Results kept in Redis while the object store was away, moved to it.
    results_moved: int = 0
    #: Batches whose drain was published again, or that were finished (``batches/sweep.py``).
    batches: int = 0


def sweep(context: WorkerContext, now: float | None = None) -> SweepReport:
    now = time.time() if now is None else now
    services, store = context.services, context.services.store
    services.accounts.epoch.check()  # an emptied store: the sweep fails loudly, every interval
    republished = reaped = 0
    for provider in services.catalog.providers():
        for request_id, started in store.reap(provider, now, again_at=now + services.settings.lease_s):
            context.dispatcher.publish(request_id, provider)
            if started:
                reaped += 1
            else:
                republished += 1
    timed_out = sum(_time_out_queue_head(context, provider, now) for provider in services.catalog.providers())
    deadline_cancels = 0
    for provider in services.catalog.providers():
        expired, cancels = _enforce_deadlines(context, provider, now)
        timed_out += expired
        deadline_cancels += cancels
    for provider in services.catalog.providers():
        store.grant(provider, now)
    reconciled = sum(store.effects.reconcile(provider, now) for provider in services.catalog.providers())
    abandoned = sum(store.admission.abandon(provider, now) for provider in services.catalog.providers())
    if reconciled or abandoned:
        log.warning("sweeper: %d workspace effect(s) given and %d admission(s) undone for callers that died "
                    "between the steps", reconciled, abandoned)
    webhooks = services.webhooks.due(now=now, again_at=now + services.settings.webhook_lease_s)
    for request_id in webhooks:
        context.dispatcher.publish_webhook(request_id)
    resume_overdue(context, now)  # bulk actions whose step was lost with its worker
    objects_deleted, orphans_deleted = expire_objects(context, now)
    batches = _sweep_batches(context)
    _publish_budget_alerts(context, now)
    results_moved = move_fallback_results(context, now)  # last: a stalled store delays nothing else
    services.metrics.swept(republished=republished, reaped=reaped, timed_out=timed_out,
                           deadline_cancels=deadline_cancels)
    if republished or reaped or timed_out or deadline_cancels:
        log.warning("sweeper: %d re-published, %d taken from dead workers, %d queue timeouts, "
                    "%d cancels at the caller's deadline", republished, reaped, timed_out, deadline_cancels)
    return SweepReport(republished, reaped, timed_out, len(webhooks), deadline_cancels, reconciled, abandoned,
                       objects_deleted, orphans_deleted, results_moved, batches)


def _sweep_batches(context: WorkerContext) -> int:
    """Batches' drains resumed, finished batches announced; a failure here
    is logged, never the sweep's."""
    try:
        return sweep_batches(context.services, context.dispatcher.publish_batch,
                             context.dispatcher.publish_batch_webhook)
    except Exception:
        log.exception("sweeper: the batches' pass failed; the next sweep tries again")
        return 0


def _publish_budget_alerts(context: WorkerContext, now: float) -> None:
    """Budget thresholds crossed, published to the webhooks worker to tell
    (``webhooks/budget_alerts.py``); a failure here is logged, never the sweep's."""
    try:
        publish_budget_alerts(context.services, context.dispatcher.publish_budget_alert, now)
    except Exception:
        log.exception("sweeper: the budget alerts' pass failed; the next sweep tries again")


def _enforce_deadlines(context: WorkerContext, provider: str, now: float) -> tuple[int, int]:
    """Act on the caller deadlines of ``provider`` that have passed: (queue
    timeouts, cancels). Each script drops the deadline it acted on."""
    store, catalog, metrics = context.services.store, context.services.catalog, context.services.metrics
    timed_out = cancels = 0
    for due in store.deadlines_due(provider, now, DEADLINES_PER_SWEEP):
        entry = catalog.by_id(due.model) if due.model else None
        if due.workspace is None or entry is None:
            store.forget_deadline(provider, due)
        elif due.kind == "start":
            if store.expire_queued(due.request_id, provider, due.workspace, entry.policy.queue_timeout_s, now):
                metrics.completed(provider, entry.id, states.QUEUE_TIMEOUT)
                timed_out += 1
        else:
            outcome = store.cancel(request_id=due.request_id, workspace=due.workspace, model=entry.id,
                                   provider=provider, by_deadline=True)
            if outcome is Cancel.CANCELLED:
                metrics.completed(provider, entry.id, states.CANCELLED)
            if outcome in (Cancel.CANCELLED, Cancel.REQUESTED):
                cancels += 1
    return timed_out, cancels


def _time_out_queue_head(context: WorkerContext, provider: str, now: float) -> int:
    store, catalog = context.services.store, context.services.catalog
    timed_out = 0
    for waiting in store.queue_head(provider, QUEUE_HEAD):
        entry = catalog.by_id(waiting.model)
        if entry is None:
            continue
        if now - waiting.created_at > entry.policy.queue_timeout_s and store.expire_queued(
                waiting.id, provider, waiting.workspace, entry.policy.queue_timeout_s, now):
            context.services.metrics.completed(provider, entry.id, "queue_timeout")
            timed_out += 1
    return timed_out
