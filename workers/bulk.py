"""One step of a bulk action (``router_queue/web/bulk.py``): walk on through
the workspace's history from the action's cursor, and cancel or retry each
request its filter matches, exactly as the cancel and retry routes do.

A step acts on at most :data:`STEP_REQUESTS` requests, then publishes the
next; a refusal that passes (a full backlog, a busy store) stops the step and
the next one comes after its ``Retry-After``. Each request is counted once
(``bulk_note.lua``), and each retry carries an Idempotency-Key of its action
and original, so a step run again after its worker died admits nothing twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from router_queue.broker.celery_app import BULK_TASK, MAINTENANCE_QUEUE
from router_queue.errors import Gone, NotRetryable, RouterError
from router_queue.requests.outcomes import Cancel
from router_queue.states import COMPLETED
from router_queue.store.bulk import DONE, FAILED, SKIPPED, Matched, Progress
from router_queue.web import admission

from .context import WorkerContext

log = logging.getLogger(__name__)

#: Matched requests one step acts on, and history entries it reads at most.
STEP_REQUESTS = 100
STEP_EXAMINE = 500
#: Refusals that pass with time: the step stops and the request is tried again.
WAIT_REASONS = frozenset({"queue_backlog_full", "queued_bytes_full", "pending_webhooks_full", "service_unavailable",
                          "concurrency_limit_exceeded", "rate_limited", "outcome_unknown"})
#: Seconds a step waits on such a refusal that names no Retry-After.
DEFAULT_WAIT_S = 5.0


@dataclass(frozen=True)
class Wait:
    reason: str
    seconds: float


def _reason(exc: RouterError) -> str:
    if isinstance(exc, NotRetryable):
        return "not_retryable"
    if isinstance(exc, Gone):
        return "gone"
    return exc.error_type


def _cancel(context: WorkerContext, workspace: str, matched: Matched) -> tuple[str, str] | Wait:
    """As ``PUT …/cancel`` (``store.cancel``)."""
    record = matched.record
    if record.status == COMPLETED:
        return SKIPPED, "already_completed"
    outcome = context.services.store.cancel(request_id=record.id, workspace=workspace, model=record.model,
                                            provider=record.provider)
    if outcome is Cancel.EXPIRED:
        return Wait("service_unavailable", 1.0)
    if outcome is Cancel.CANCELLED:
        context.services.metrics.completed(record.provider, record.model, "cancelled")
        return DONE, "cancelled"
    if outcome is Cancel.REQUESTED:
        return DONE, "cancellation_requested"
    return SKIPPED, "already_completed" if outcome is Cancel.ALREADY_COMPLETED else "gone"


def _retry(context: WorkerContext, workspace: str, progress: Progress, matched: Matched) -> tuple[str, str] | Wait:
    """As ``POST …/retry`` (its admission, with ``retry_of``), at ``low`` priority,
    under an Idempotency-Key of this action and the original."""
    record = matched.record
    if record.status != COMPLETED or not record.error_type:
        return SKIPPED, "not_failed"
    entry = context.services.catalog.by_id(record.model)
    if entry is None:
        return FAILED, "model_not_found"
    try:
        admission.admit(context.services, workspace=workspace, entry=entry, raw_body=b"",
                        raw_idempotency_key=f"bulk:{progress.bulk_id}:{record.id}", raw_priority="low",
                        base_url=progress.base_url, retry_of=record.id, bulk_id=progress.bulk_id)
    except RouterError as exc:
        reason = _reason(exc)
        if reason in WAIT_REASONS:
            return Wait(reason, float(exc.retry_after or DEFAULT_WAIT_S))
        return FAILED, reason
    return DONE, "retried"  # or replayed: this action admitted it before its worker died


def step(context: WorkerContext, workspace: str, bulk_id: str) -> float | None:
    """Run one step; the seconds until the next one, or None when the action ended (or another step runs)."""
    bulk = context.services.bulk
    assert bulk is not None
    token = uuid.uuid4().hex
    if not bulk.take(workspace, bulk_id, token):
        return None  # a step runs: it publishes the next
    try:
        progress = bulk.progress(workspace, bulk_id)
        if progress is None or progress.status == COMPLETED:
            bulk.forget(workspace, bulk_id)
            return None
        return _walk_on(context, workspace, progress)
    finally:
        bulk.give(workspace, bulk_id, token)


def _walk_on(context: WorkerContext, workspace: str, progress: Progress) -> float | None:
    bulk, settings = context.services.bulk, context.services.settings
    assert bulk is not None
    bulk_id, flt = progress.bulk_id, progress.filter
    since = max(progress.created_at - settings.result_retention_s, flt.since or 0.0)
    walk = bulk.walk(workspace, flt, upper_ms=progress.upper_ms, since=since, after=progress.cursor,
                     examine=STEP_EXAMINE)
    matched = progress.matched
    for found in walk.matched[:STEP_REQUESTS]:
        if matched >= settings.max_bulk_requests:
            bulk.finish(workspace, bulk_id, limited=True)
            return None
        done = _cancel(context, workspace, found) if progress.action == "cancel" else \
            _retry(context, workspace, progress, found)
        if isinstance(done, Wait):
            bulk.waiting(workspace, bulk_id, done.reason)
            bulk.due(workspace, bulk_id, time.time() + done.seconds)
            log.info("bulk %s: waiting %.0f s (%s)", bulk_id, done.seconds, done.reason)
            return done.seconds
        noted = bulk.note(workspace, bulk_id, found.entry, *done)
        if noted < 0:
            return None
        matched += noted
    if len(walk.matched) > STEP_REQUESTS:
        bulk.due(workspace, bulk_id, time.time())
        return 0.0
    if walk.last is not None:
        bulk.pass_to(workspace, bulk_id, walk.last)
    if walk.ended:
        bulk.finish(workspace, bulk_id)
        log.info("bulk %s: ended, %d matched", bulk_id, matched)
        return None
    bulk.due(workspace, bulk_id, time.time())
    return 0.0


def resume_overdue(context: WorkerContext, now: float) -> int:
    """The sweeper's part: publish again each unfinished action whose step did not report in time."""
    bulk = context.services.bulk
    if bulk is None:
        return 0
    overdue = bulk.overdue(now)
    for workspace, bulk_id in overdue:
        try:
            publish_next(context, workspace, bulk_id, 0.0)
        except Exception:
            log.warning("bulk %s: its step could not be published again", bulk_id, exc_info=True)
    return len(overdue)


def publish_next(context: WorkerContext, workspace: str, bulk_id: str, countdown: float) -> None:
    """Publish the action's next step, ``countdown`` seconds from now."""
    context.dispatcher.celery.send_task(BULK_TASK, args=[workspace, bulk_id], queue=MAINTENANCE_QUEUE,
                                        countdown=countdown)
