"""The batch routes (``paths.BATCH_ROUTES``): thousands of requests in one
call, in two phases. The submit reads the NDJSON body line by line
(``batch_lines.py``), stages it, and answers ``201`` once the batch and its
lines are durable (``batch_commit.lua``); its lines are then admitted in the
background (``batches/drain.py``), each as an ordinary request. Reading,
results, cancel and the list read the batch back (``batches/reading.py``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
import time
from typing import Any, Iterator

from flask import Blueprint, Response, request

from ..batches.drain import cancel_unrecorded
from ..batches.finish import finish_if_done
from ..batches.reading import CHUNK, line_views, summary
from ..errors import BatchNotFound, ConcurrencyLimitExceeded, IdempotencyKeyConflict, InvalidInput, UnsupportedMediaType
from ..requests.outcomes import Cancel
from ..requests.record import iso
from ..states import COMPLETED
from . import admission, paths
from .batch_lines import BatchCall, Reading, TooLarge, read
from .bodies import json_response, response_url
from .envelope import fresh_call_id
from .front import FrontDoor, front_door
from .routes import BODY_FRAMING_ERRORS, base_url

log = logging.getLogger(__name__)
batches = Blueprint("batches", __name__)

NDJSON = "application/x-ndjson"
#: A batch id is a UUID's text.
_BATCH_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: Seconds a caller is told to wait before reading a batch not yet COMPLETED again.
RETRY_AFTER_S = 5
DEFAULT_LIMIT, MAX_LIMIT = 20, 100
_CURSOR_VERSION = "b1"


def batch_urls(base: str, batch_id: str) -> dict[str, str]:
    root = f"{base}{paths.BATCHES}/{batch_id}"
    return {"status_url": root, "results_url": f"{root}/results", "cancel_url": f"{root}/cancel"}


@paths.BATCH_SUBMIT.view(batches)
def submit() -> Response:
    front = front_door()
    workspace = front.keys.workspace(request)
    if request.mimetype != NDJSON:
        raise UnsupportedMediaType(f"a batch is NDJSON: send it with Content-Type {NDJSON}, not "
                                   f"{(request.mimetype or 'none')[:60]!r}")
    admission.refuse_bring_your_own_key(request.headers)
    services, settings = front.services, front.services.settings
    key = admission.idempotency_key(request.headers.get("Idempotency-Key"))
    base = base_url(front, request)
    hook = admission.webhook_url(request.headers.get(admission.WEBHOOK_HEADER),
                                 allow_loopback_http=settings.webhook_allow_loopback_http,
                                 resolve_timeout_s=settings.webhook_resolve_timeout_s, workspace=workspace)
    if hook and not services.accounts.signing_secrets(workspace):
        raise InvalidInput(admission.no_webhook_secret(workspace, "header"))
    if not key and services.batches.open_batches(workspace) >= settings.max_open_batches:
        raise _too_many(settings.max_open_batches)
    if (request.content_length or 0) > settings.max_batch_bytes:
        raise TooLarge(f"the batch is larger than MAX_BATCH_BYTES, {settings.max_batch_bytes} bytes; "
                       "nothing was queued")
    request.max_content_length = settings.max_batch_bytes
    batch_id = fresh_call_id()
    call = BatchCall(services, workspace, batch_id, key, base, admission.caller_key_id(request.headers))
    reading = Reading()
    try:
        for chunk in read(call, request.stream, reading):
            services.batches.stage(workspace, batch_id, chunk.lines, chunk.outcomes)
    except BODY_FRAMING_ERRORS as exc:
        services.batches.discard(workspace, batch_id)
        raise InvalidInput(f"the request body could not be read: {exc.__class__.__name__}") from None
    except BaseException:
        services.batches.discard(workspace, batch_id)
        raise
    if not reading.lines:
        services.batches.discard(workspace, batch_id)
        raise InvalidInput("the batch has no lines; send one JSON object per line")
    now = time.time()
    fields = {"status": "IN_QUEUE", "created_at": repr(now), "total": reading.lines, "cursor": 0,
              "refused": reading.refused, "bytes": reading.bytes, "webhook_url": hook, "base_url": base}
    code, detail = services.batches.commit(
        workspace, batch_id, fields, fingerprint=reading.digest.hexdigest() if key else "",
        key_hash=hashlib.sha256(key.encode()).hexdigest() if key else "", max_open=settings.max_open_batches,
        now=now)
    if code != "CREATED":
        services.batches.discard(workspace, batch_id)
    if code == "CONFLICT":
        raise IdempotencyKeyConflict("this Idempotency-Key is held by a different batch; send this one under a "
                                     "new key")
    if code == "TOO_MANY":
        raise _too_many(settings.max_open_batches)
    if code == "REPLAY":
        assert isinstance(detail, str)
        return _handle(front, workspace, detail, base, replayed=True)
    front.dispatcher.publish_batch(workspace, batch_id)
    log.info("batch: %d lines, %d refused at parsing", reading.lines, reading.refused,
             extra={"workspace": workspace, "batch_id": batch_id})
    return _handle(front, workspace, batch_id, base, replayed=False)


def _too_many(cap: int) -> ConcurrencyLimitExceeded:
    return ConcurrencyLimitExceeded(f"this workspace has {cap} batches open (not yet COMPLETED), as many as it "
                                    "may (MAX_OPEN_BATCHES_PER_WORKSPACE); send this one once one has completed",
                                    retry_after=60)


def _handle(front: FrontDoor, workspace: str, batch_id: str, base: str, *, replayed: bool) -> Response:
    batch = _batch(front, workspace, batch_id)
    body = {"batch_id": batch_id, "status": batch.get("status", "IN_QUEUE"), "counts": _submit_counts(batch),
            **batch_urls(base, batch_id)}
    return json_response(body, 201, {"Idempotent-Replayed": "true"} if replayed else {})


def _submit_counts(batch: dict[str, str]) -> dict[str, int]:
    total, refused = int(batch.get("total", 0)), int(batch.get("refused", 0))
    return {"lines": total, "accepted": total - refused, "refused": refused}


def _batch(front: FrontDoor, workspace: str, batch_id: str) -> dict[str, str]:
    """The workspace's batch, or ``404 batch_not_found``."""
    found = front.services.batches.get(workspace, batch_id) if _BATCH_ID.fullmatch(batch_id) else None
    if found is None:
        raise BatchNotFound(f"this workspace has no batch {batch_id[:40]!r} (or it expired with its last line)")
    return found


@paths.BATCH_STATUS.view(batches)
def status(batch_id: str) -> Response:
    front = front_door()
    workspace = front.keys.workspace(request)
    batch = _batch(front, workspace, batch_id)
    found = finish_if_done(front.services, workspace, batch_id, batch) or summary(front.services, workspace,
                                                                                   batch_id, batch)
    body = {"batch_id": batch_id, **found.as_json(), "lines": int(batch.get("total", 0)),
            "created_at": _iso(batch.get("created_at")), "cancelled": batch.get("cancelled") == "1",
            **batch_urls(base_url(front, request), batch_id)}
    return json_response(body, 200, {"Retry-After": "0" if found.status == COMPLETED else str(RETRY_AFTER_S)})


def _iso(text: str | None) -> str | None:
    return iso(float(text)) if text else None


@paths.BATCH_RESULTS.view(batches)
def results(batch_id: str) -> Response:
    """One NDJSON line per input line, in input order, read and sent
    :data:`CHUNK` lines at a time."""
    front = front_door()
    workspace = front.keys.workspace(request)
    batch = _batch(front, workspace, batch_id)
    base = base_url(front, request)
    services = front.services

    def lines() -> Iterator[bytes]:
        total = int(batch.get("total", 0))
        for first in range(1, total + 1, CHUNK):
            out = []
            for view in line_views(services, workspace, batch_id, batch, first, min(CHUNK, total - first + 1)):
                item: dict[str, Any] = {"line": view.line, "request_id": view.request_id, "status": view.status}
                if view.error_type:
                    item["error_type"] = view.error_type
                if view.detail:
                    item["detail"] = view.detail
                item["response_url"] = (response_url(base, view.model, view.request_id)
                                        if view.request_id and view.model else None)
                out.append(json.dumps(item, separators=(",", ":")))
            yield ("\n".join(out) + "\n").encode()
    return Response(lines(), 200, mimetype=NDJSON)


@paths.BATCH_CANCEL.view(batches)
def cancel(batch_id: str) -> Response:
    """Stop admitting the batch's lines (those not yet admitted end
    cancelled) and cancel each of its requests not yet finished."""
    front = front_door()
    workspace = front.keys.workspace(request)
    batch = _batch(front, workspace, batch_id)
    services = front.services
    outcome = services.batches.cancel(workspace, batch_id)
    if outcome == "MISSING":
        raise BatchNotFound(f"this workspace has no batch {batch_id!r}")
    cancelled = requested = 0
    if outcome != "COMPLETED":
        batch["cancelled"] = "1"
        total = int(batch.get("total", 0))
        for first in range(1, total + 1, CHUNK):
            for view in line_views(services, workspace, batch_id, batch, first, min(CHUNK, total - first + 1)):
                if view.request_id and view.model and view.status != COMPLETED:
                    entry = services.catalog.by_id(view.model)
                    if entry is None:
                        continue
                    done = services.store.cancel(request_id=view.request_id, workspace=workspace,
                                                 model=entry.id, provider=entry.provider)
                    cancelled += done is Cancel.CANCELLED
                    requested += done is Cancel.REQUESTED
        for done in cancel_unrecorded(services, workspace, batch_id):
            cancelled += done is Cancel.CANCELLED
            requested += done is Cancel.REQUESTED
    body = {"batch_id": batch_id, "status": "ALREADY_COMPLETED" if outcome == "COMPLETED" else
            "CANCELLATION_REQUESTED", "cancelled": cancelled, "cancellation_requested": requested,
            **batch_urls(base_url(front, request), batch_id)}
    return json_response(body, 409 if outcome == "COMPLETED" else 202)


@paths.BATCH_LIST.view(batches)
def list_batches() -> Response:
    """The workspace's batches, newest first: ``?limit=`` (1 to 100) and the ``cursor`` a page hands out."""
    front = front_door()
    workspace = front.keys.workspace(request)
    limit = _limit(request.args.get("limit"))
    before = _decode_cursor(request.args["cursor"]) if request.args.get("cursor") else None
    services = front.services
    page = services.batches.page(workspace, before, limit)
    base = base_url(front, request)
    listed, gone = [], []
    for batch_id, _ in page:
        batch = services.batches.get(workspace, batch_id)
        if batch is None:
            gone.append(batch_id)
            continue
        listed.append({"batch_id": batch_id, "status": batch.get("status", "IN_QUEUE"),
                       "lines": int(batch.get("total", 0)), "created_at": _iso(batch.get("created_at")),
                       **batch_urls(base, batch_id)})
    services.batches.forget(workspace, gone)
    cursor = _encode_cursor(page[-1][1]) if len(page) == limit else None
    return json_response({"batches": listed, "next_cursor": cursor})


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise InvalidInput(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {raw[:20]!r}")
    return int(raw)


def _encode_cursor(score: float) -> str:
    return base64.urlsafe_b64encode(f"{_CURSOR_VERSION}|{score!r}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> float:
    try:
        version, score = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_",
                                          validate=True).decode().split("|")
        if version == _CURSOR_VERSION:
            return float(score)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise InvalidInput("cursor is not one this server handed out; start again without it")
