"""Bulk actions: ``POST /v2/requests/bulk`` cancels or retries the caller's
requests a filter matches (the history list's filters, ``history.py``, and
``batch_id``), and ``GET /v2/requests/bulk/{bulk_id}`` shows its progress.

A dry run counts here, at once; an action is written (``store/bulk.py``),
answered ``202``, and run in steps by the workers (``workers/bulk.py``), the
sweeper resuming one whose step was lost. Idempotent by ``Idempotency-Key``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

from apispec import APISpec
from flask import Blueprint, Response, request
from marshmallow import Schema, fields
from marshmallow.validate import Length, OneOf
from werkzeug.datastructures import MultiDict

from ..broker.celery_app import BULK_TASK, MAINTENANCE_QUEUE
from ..catalog import Catalog
from ..errors import BulkNotFound, ConcurrencyLimitExceeded, IdempotencyKeyConflict, InvalidInput, ValidationFailed
from ..services import Publisher, Services
from ..states import COMPLETED
from ..store.bulk import DONE, FAILED, SKIPPED, BulkFilter, Progress
from ..store.record import iso
from ..store.requests_front import HISTORY_EXAMINED_PER_ENTRY
from ..validation import StrictSchema, validate
from . import admission, paths
from .bodies import json_response
from .front import front_door
from .history import WORKSPACE_FILTERS, parse_filters
from .routes import base_url, read_body

log = logging.getLogger(__name__)
bulk = Blueprint("bulk", __name__)

ACTIONS = ("cancel", "retry")
#: The history list's filters a bulk action takes (no paging), and its own.
HISTORY_FILTERS = WORKSPACE_FILTERS - {"limit", "cursor"}
#: A batch id as the batches route mints it: letters, digits, "_" and "-".
_BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: A bulk id as :func:`create` mints it.
_BULK_ID = re.compile(r"[0-9a-f]{24}")
#: Seconds a caller at its cap on unfinished bulk actions is told to wait.
BULK_FULL_RETRY_S = 10
#: History entries a dry run reads per round trip.
DRY_RUN_EXAMINE = 1000


class BulkFilterSchema(StrictSchema):
    """The history list's filters (``history.py``), and ``batch_id``."""

    model = fields.String()
    status = fields.String()
    error_type = fields.String()
    since = fields.String()
    until = fields.String()
    batch_id = fields.String(validate=Length(min=1, max=64))


class BulkBody(StrictSchema):
    """``POST /v2/requests/bulk``'s body."""

    action = fields.String(required=True, validate=OneOf(ACTIONS))
    filter = fields.Nested(BulkFilterSchema)
    dry_run = fields.Boolean(truthy={True}, falsy={False})


def bulk_filter(raw: dict[str, Any], catalog: Catalog) -> BulkFilter:
    """The filter, checked as the history list checks its query (``400 invalid_input``)."""
    checked = parse_filters(MultiDict({k: v for k, v in raw.items() if k != "batch_id"}), HISTORY_FILTERS, catalog)
    batch_id = raw.get("batch_id")
    if batch_id is not None and not _BATCH_ID.fullmatch(batch_id):
        raise InvalidInput(f"filter.batch_id must be a batch id (letters, digits, _ and -), got {batch_id[:40]!r}")
    return BulkFilter(checked.model, checked.status, checked.error_type, checked.since, checked.until, batch_id)


@dataclass(frozen=True)
class DryRun:
    """What an action would match now, and what a retry of them would hold."""

    matched: int
    #: Unfinished (cancel) or retryable (retry) among them.
    would_act: int
    credits: int
    limited: bool


def dry_run(services: Services, workspace: str, action: str, flt: BulkFilter, now: float | None = None) -> DryRun:
    """Counts as an action would walk: newest first, at most ``MAX_BULK_REQUESTS``
    matched and that many times HISTORY_EXAMINED_PER_ENTRY entries read."""
    assert services.bulk is not None
    now = time.time() if now is None else now
    settings = services.settings
    most = settings.max_bulk_requests
    budget = most * HISTORY_EXAMINED_PER_ENTRY
    since = max(now - settings.result_retention_s, flt.since or 0.0)
    upper_ms = math.floor(min(now, flt.until if flt.until is not None else now) * 1000)
    matched = acting = credits = examined = 0
    after, limited = "", False
    while True:
        walk = services.bulk.walk(workspace, flt, upper_ms=upper_ms, since=since, after=after,
                                  examine=min(DRY_RUN_EXAMINE, budget - examined))
        taken = walk.matched[:most - matched]
        matched += len(taken)
        records = [m.record for m in taken]
        if action == "cancel":
            acting += sum(1 for r in records if r.status != COMPLETED)
        else:
            for record, ok in zip(records, services.bulk.retry_standing(records, settings.retry_max_per_request)):
                entry = services.catalog.by_id(record.model)
                if ok and entry is not None and entry.queueable:
                    acting += 1
                    credits += entry.price_credits
        examined += walk.examined
        if len(taken) < len(walk.matched) or (not walk.ended and (matched >= most or examined >= budget)):
            limited = True
            break
        if walk.ended or walk.last is None:
            break
        after = walk.last
    return DryRun(matched, acting, credits, limited)


def status_url(base: str, bulk_id: str) -> str:
    return f"{base}/v2/requests/bulk/{bulk_id}"


def progress_body(progress: Progress, base: str) -> dict[str, Any]:
    """The action as ``GET /v2/requests/bulk/{id}`` (and the ``202``) shows it."""
    return {
        "bulk_id": progress.bulk_id,
        "action": progress.action,
        "status": progress.status,
        "filter": progress.filter.as_json_wire(),
        "matched": progress.matched,
        "done": progress.counts[DONE],
        "skipped": progress.counts[SKIPPED],
        "failed": progress.counts[FAILED],
        "outcomes": {**progress.outcomes[DONE], **progress.outcomes[SKIPPED]},
        "failures": progress.outcomes[FAILED],
        "waiting": progress.waiting or None,
        "limited": progress.limited,
        "created_at": iso(progress.created_at),
        "completed_at": iso(progress.completed_at),
        "status_url": status_url(base, progress.bulk_id),
    }


def publish_step(dispatcher: Publisher | None, workspace: str, bulk_id: str) -> None:
    """Publish the action's first step; a failed publish is left to the sweeper (``store/bulk.py``, overdue)."""
    try:
        if dispatcher is not None and dispatcher.celery is not None:
            dispatcher.celery.send_task(BULK_TASK, args=[workspace, bulk_id], queue=MAINTENANCE_QUEUE)
    except Exception:
        log.warning("bulk %s: its first step could not be published; the sweeper will", bulk_id, exc_info=True)


@paths.BULK.view(bulk)
def create() -> Response:
    front = front_door()
    services = front.services
    assert services.bulk is not None
    workspace = front.keys.workspace(request)
    base = base_url(front, request)
    body = admission.parse_body(read_body(request))
    detail = validate(BulkBody(), body)
    if detail:
        raise ValidationFailed(detail)
    action = body["action"]
    flt = bulk_filter(body.get("filter") or {}, services.catalog)
    if body.get("dry_run"):
        counted = dry_run(services, workspace, action, flt)
        answer: dict[str, Any] = {"action": action, "dry_run": True, "matched": counted.matched,
                                  "limited": counted.limited}
        if action == "cancel":
            answer["cancellable"] = counted.would_act
        else:
            answer.update(retryable=counted.would_act, credits=counted.credits)
        return json_response(answer)
    key = admission.idempotency_key(request.headers.get("Idempotency-Key"))
    fingerprint = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    outcome, bulk_id = services.bulk.create(
        workspace, secrets.token_hex(12), action=action, filter=flt, base_url=base,
        key_hash=hashlib.sha256(key.encode()).hexdigest() if key else "", fingerprint=fingerprint)
    if outcome == "CONFLICT":
        raise IdempotencyKeyConflict("this Idempotency-Key is held by a different bulk action; "
                                     "send this one under a new key")
    if outcome == "FULL":
        raise ConcurrencyLimitExceeded(
            f"this workspace has {services.bulk.max_running} bulk actions unfinished, as many as it may; "
            "send this one again once one has completed (GET its status_url)", retry_after=BULK_FULL_RETRY_S)
    if outcome == "CREATED":
        publish_step(front.dispatcher, workspace, bulk_id)
    log.info("bulk %s: %s", action, outcome.lower(), extra={"workspace": workspace, "outcome": outcome.lower()})
    progress = services.bulk.progress(workspace, bulk_id)
    if progress is None:  # a replayed key whose action expired: the key outlived it
        raise BulkNotFound(f"bulk action {bulk_id} has expired")
    headers = {"Idempotent-Replayed": "true"} if outcome == "REPLAY" else {}
    return json_response(progress_body(progress, base), 202, headers)


@paths.BULK_PROGRESS.view(bulk)
def progress(bulk_id: str) -> Response:
    front = front_door()
    services = front.services
    assert services.bulk is not None
    workspace = front.keys.workspace(request)
    found = services.bulk.progress(workspace, bulk_id) if _BULK_ID.fullmatch(bulk_id) else None
    if found is None:
        raise BulkNotFound("no such bulk action for this workspace (or it has expired)")
    return json_response(progress_body(found, base_url(front, request)))


# -- OpenAPI (``openapi.py`` calls :func:`openapi_paths`) ---------------------------------


class DryRunSchema(Schema):
    action = fields.String(required=True, metadata={"enum": list(ACTIONS)})
    dry_run = fields.Boolean(required=True)
    matched = fields.Integer(required=True, metadata={"description": "requests the filter matches, newest first, "
                                                      "at most MAX_BULK_REQUESTS"})
    limited = fields.Boolean(required=True, metadata={"description": "more may match than were counted"})
    cancellable = fields.Integer(metadata={"description": "cancel: those not yet COMPLETED"})
    retryable = fields.Integer(metadata={"description": "retry: failed, body kept, chain under its retry cap"})
    credits = fields.Integer(metadata={"description": "retry: what retrying the retryable ones would hold"})


class BulkProgressSchema(Schema):
    bulk_id = fields.String(required=True)
    action = fields.String(required=True, metadata={"enum": list(ACTIONS)})
    status = fields.String(required=True, metadata={"enum": ["IN_PROGRESS", COMPLETED]})
    filter = fields.Dict(required=True)
    matched = fields.Integer(required=True, metadata={"description": "matched so far (all, once COMPLETED)"})
    done = fields.Integer(required=True, metadata={"description": "cancelled, cancellation requested or retried"})
    skipped = fields.Integer(required=True, metadata={"description": "matched, nothing to do (finished; not failed)"})
    failed = fields.Integer(required=True, metadata={"description": "refused; by reason in failures"})
    outcomes = fields.Dict(keys=fields.String(), values=fields.Integer(), required=True)
    failures = fields.Dict(keys=fields.String(), values=fields.Integer(), required=True)
    waiting = fields.String(required=True, allow_none=True, metadata={
        "description": "the refusal a retry waits out (queue_backlog_full ...), else null"})
    limited = fields.Boolean(required=True)
    created_at = fields.String(required=True, metadata={"format": "date-time"})
    completed_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})
    status_url = fields.String(required=True)


def openapi_paths(spec: APISpec, errors: Callable[..., dict[str, Any]], error: Callable[..., dict[str, Any]]) -> None:
    """The two bulk routes, their bodies generated from the schemas above and :class:`BulkBody`."""
    progress = {"application/json": {"schema": BulkProgressSchema}}
    spec.path(path=paths.BULK.openapi(), operations={"post": {
        "summary": "Cancel or retry this workspace's requests a filter matches", "tags": ["requests"],
        "description": "The filters are the history list's (GET /v2/requests) and batch_id. dry_run answers at once "
                       "what would match; otherwise the action runs in the background: 202 with its progress.",
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False, "schema": {
            "type": "string", "maxLength": admission.MAX_IDEMPOTENCY_KEY_LENGTH}}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": BulkBody}}},
        "responses": {"200": {"description": "dry_run: the counts", "content": {"application/json": {
            "schema": DryRunSchema}}},
            "202": {"description": "the action, begun (or the one its Idempotency-Key began)", "content": progress,
                    "headers": {"Idempotent-Replayed": "Idempotent-Replayed"}},
            **errors(400, 401, 409, 422, 429, 503)},
    }})
    spec.path(path=paths.BULK_PROGRESS.openapi(), operations={"get": {
        "summary": "A bulk action's progress", "tags": ["requests"],
        "parameters": [{"name": "bulk_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "its progress", "content": progress},
                      "404": error("bulk_not_found: no such bulk action for this workspace, or expired"),
                      **errors(401, 429)},
    }})
