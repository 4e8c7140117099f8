"""The model routes of the contract: the four queue routes (submit, status,
result, cancel) and the synchronous run that shares their admission."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from flask import Blueprint, Request, Response, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.sansio.utils import host_is_trusted

from .. import tracing
from ..catalog import Catalog, ModelEntry
from ..errors import (
    CompletedWithError,
    DeadlineExceeded,
    Gone,
    InvalidInput,
    ModelNotFound,
    NotRetryable,
    PayloadTooLarge,
    RequestNotFound,
    ServiceUnavailable,
    Unauthorized,
)
from ..states import COMPLETED, RESULT_STATUS
from ..store.outcomes import Cancel
from ..store.record import RequestRecord
from ..store.requests_values import StatusView
from . import admission, pacing, paths
from .bodies import Answer, cost_headers, json_response, request_urls, response_url, status_body
from .collect import collect, link as collect_link
from .envelope import carried_allowance, current_call
from .front import FrontDoor, front_door
from .ratelimit import Meter
from .refusals import NOT_FOUND
from .stream import stream
from .waiting import HeldFrames, holding, take_slot, wait_until_completed

log = logging.getLogger(__name__)
queue = Blueprint("queue", __name__)

#: What gunicorn's body reader raises on broken framing, as the app reads the body.
BODY_FRAMING_ERRORS: tuple[type[BaseException], ...] = (ParseException, NoMoreData)


def base_url(front: FrontDoor, req: Request) -> str:
    """``PUBLIC_BASE_URL``, else the origin the caller used (scheme and Host;
    not ``request.host_url``, whose IRI decoding costs a tenth of a status read)
    when its Host is one of ``TRUSTED_HOSTS``: a forged Host is refused, never
    echoed into the URLs we answer or sign. Called before anything is written."""
    settings = front.services.settings
    if settings.public_base_url:
        return settings.public_base_url
    host = req.host
    if settings.trusted_hosts and not host_is_trusted(host, settings.trusted_hosts):
        raise InvalidInput("the Host header names a host this server does not answer for")
    return f"{req.scheme}://{host}"


def _base_url(front: FrontDoor) -> str:
    return base_url(front, request)


def model_entry(provider: str, model: str, catalog: Catalog | None = None) -> ModelEntry:
    """The catalog entry, or ``404 model_not_found`` suggesting close ids."""
    if catalog is None:
        catalog = front_door().services.catalog
    entry = catalog.get(provider, model)
    if entry is None:
        model_id = f"{provider}/{model}"
        close = catalog.suggest(model_id)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelNotFound(f"{model_id} is not a model{hint}")
    return entry


def _caller_request(front: FrontDoor, provider: str, model: str, request_id: str,
                    replica: bool = False) -> StatusView:
    """The request's view as this caller may see it, or 404/410."""
    workspace = front.keys.workspace(request)
    entry = model_entry(provider, model, front.services.catalog)
    return visible_view(front, workspace, entry, request_id, carried_allowance(), replica=replica)


def visible_view(front: FrontDoor, workspace: str, entry: ModelEntry, request_id: str,
                 allowance: Meter | None, *, replica: bool = False) -> StatusView:
    """A well-formed id's view, counted against ``allowance`` in the same
    round trip; 404 unless it is this workspace's request for this model,
    410 when it was but is past retention. (The lane calls it too.) With
    ``replica`` (status polls), a read replica answers when there is one."""
    if not front.services.store.addressable(request_id, entry.provider):
        if allowance is not None:
            front.services.store.count_apart(allowance)  # counted, as a read it would have been
        raise RequestNotFound(NOT_FOUND)
    view = front.services.store.status_view(request_id, entry.provider, allowance, replica=replica)
    record = view.record
    if record is None:
        if front.services.ids.is_ours(request_id, workspace, entry.id):
            raise Gone(f"request {request_id} finished more than its retention window ago")
        raise RequestNotFound(NOT_FOUND)
    if record.workspace != workspace or record.model != entry.id:
        raise RequestNotFound(NOT_FOUND)
    return view


def status_answer(front: FrontDoor, view: StatusView, base: str, status: int = 200) -> Answer:
    """A status read's JSON body, with ``Retry-After`` (``0`` once it is finished)."""
    record = view.record
    assert record is not None  # visible_view raised on a missing one
    body = status_body(record, view.position, base, front.services.settings.result_retention_s)
    return Answer(status, body, {"Retry-After": str(pacing.retry_after(record, view.position, view.pace))})


def _status_response(front: FrontDoor, view: StatusView, status: int = 200) -> Response:
    answer = status_answer(front, view, _base_url(front), status)
    return json_response(answer.body, answer.status, answer.headers)


@paths.SUBMIT.view(queue)
def submit(provider: str, model: str) -> Response:
    answer = submit_answer(front_door(), request, provider, model, carried_allowance, tracing.traceparent())
    current_call().id = answer.call_id
    return json_response(answer.body, answer.status, answer.headers)


def submit_answer(front: FrontDoor, req: Request, provider: str, model: str,
                  rate: Callable[[], Meter | None], traceparent: str = "") -> Answer:
    """Admit a submit (``admission.py``) and answer its handle; ``rate``
    hands over the call's allowance when the admit script runs. (The lane
    calls it too, only while tracing is off: no ``traceparent``.)"""
    workspace = front.keys.workspace(req)
    entry = model_entry(provider, model, front.services.catalog)
    admission.refuse_bring_your_own_key(req.headers)
    base = base_url(front, req)
    headers = req.headers
    admitted = admission.admit(
        front.services, workspace=workspace, entry=entry, raw_body=read_body(req),
        raw_idempotency_key=headers.get("Idempotency-Key"), raw_priority=headers.get("X-Comfy-Priority"),
        rate=rate, raw_webhook_url=headers.get(admission.WEBHOOK_HEADER), base_url=base, headers=headers,
        traceparent=traceparent,
    )
    return _handle(front, entry, workspace, admitted, base, "submit")


def _handle(front: FrontDoor, entry: ModelEntry, workspace: str, admitted: admission.Admitted, base: str,
            what: str) -> Answer:
    """A submit's (or a retry's) 201: the new request's handle, or the
    original one for an Idempotency-Key sent again."""
    outcome = "replayed" if admitted.replayed else "admitted"
    log.info("%s: %s", what, outcome, extra={"request_id": admitted.request_id, "workspace": workspace,
                                             "model": entry.id, "outcome": outcome, "status": "IN_QUEUE"})
    if admitted.replayed:
        return _replayed_handle(front, entry, admitted.request_id, base)
    body = {
        "request_id": admitted.request_id,
        "status": "IN_QUEUE",
        "queue_position": admitted.position or 0,
        **request_urls(base, entry.id, admitted.request_id),
    }
    return Answer(201, body, call_id=admitted.request_id)


def read_body(req: Request) -> bytes:
    """The request body; ``413`` when it is over ``req.max_content_length``,
    ``400`` when its framing is broken (a malformed chunk, a body shorter than
    announced).

    A body with a Content-Length over the limit is refused by werkzeug before
    this; a chunked one (no Content-Length) is only cut at the limit, so a
    body that fills the limit is taken to be over it.
    """
    try:
        raw = req.get_data(cache=False)
    except BODY_FRAMING_ERRORS as exc:
        raise InvalidInput(f"the request body could not be read: {exc.__class__.__name__} {exc}".strip()) from None
    limit = req.max_content_length
    if req.content_length is None and limit is not None and len(raw) >= limit:
        raise PayloadTooLarge(f"the body is larger than {limit} bytes")
    return raw


def _replayed_handle(front: FrontDoor, entry: ModelEntry, request_id: str, base: str) -> Answer:
    """The original request's handle (the 201's fields, its status as it stands
    now), marked as a replay."""
    view = front.services.store.status_view(request_id, entry.provider)
    status = view.record.status if view.record is not None else COMPLETED  # past retention, key still alive
    body: dict[str, Any] = {"request_id": request_id, "status": status}
    if status != COMPLETED:
        body["queue_position"] = view.position or 0
    body.update(request_urls(base, entry.id, request_id))
    return Answer(201, body, {"Idempotent-Replayed": "true"}, request_id)


@paths.STATUS.view(queue)
def status(provider: str, model: str, request_id: str) -> Response:
    front = front_door()
    return _status_response(front, _caller_request(front, provider, model, request_id, replica=True))


@paths.EVENTS.view(queue)
def events(provider: str, model: str, request_id: str) -> Response:
    """Server-sent events, one per change, until COMPLETED (``stream.py``).
    Found, authorized and counted like a status read: one stream is one call.
    It holds one of the workspace's held-connection slots until it is closed,
    and ends once its key stops working (revoked, or past its overlap)."""
    front = front_door()
    view = _caller_request(front, provider, model, request_id)
    assert view.record is not None  # visible_view raised on a missing one
    base = _base_url(front)  # a refused Host is refused before a slot is taken
    slot = take_slot(front.held, view.record.workspace)
    try:  # from here the response's close() gives the slot back; until then, this
        frames = stream(front.services.store, front.events, view, base=base,  # a generator: runs nothing yet
                        retention_s=front.services.settings.result_retention_s,
                        last_event_id=request.headers.get("Last-Event-ID"), key=front.keys.held_key(request))
        return Response(HeldFrames(frames, lambda: front.held.release(slot)), 200, mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    except BaseException:
        front.held.release(slot)
        raise


@paths.RESULT.view(queue)
def result(provider: str, model: str, request_id: str) -> Response:
    front = front_door()
    view = _caller_request(front, provider, model, request_id)
    assert view.record is not None  # visible_view raised on a missing one
    if view.record.status != COMPLETED:
        response = _status_response(front, view, 202)
        response.headers.update(cost_headers(view.record))
        return response
    return _finished(front, view.record)


@paths.LINK.view(queue)
def link(provider: str, model: str, request_id: str) -> Response:
    """Where to download the output without our key (``collect.link``): read
    like a collect, 202 while it runs and its error once it failed. A route of
    its own, never a redirect: clients keep X-API-Key across a redirect."""
    front = front_door()
    view = _caller_request(front, provider, model, request_id)
    record = view.record
    assert record is not None  # visible_view raised on a missing one
    if record.status != COMPLETED:
        response = _status_response(front, view, 202)
        response.headers.update(cost_headers(record))
        return response
    _raise_error_of(record)
    services = front.services
    settings = services.settings
    body = collect_link(record, services.store.result(record.id), services.blobs,
                        response_url(_base_url(front), record.model, record.id), settings.result_link_s,
                        settings.result_retention_s, time.time())
    return json_response(body, 200, {**cost_headers(record), "Cache-Control": "no-store"})


def _raise_error_of(record: RequestRecord) -> None:
    """A failed request's collect: the error response of its bucket, with its cost."""
    if record.error_type:
        raise CompletedWithError(RESULT_STATUS.get(record.error_type, 502), record.error_type,
                                 record.detail or record.error_type, cost_headers(record))


def _finished(front: FrontDoor, record: RequestRecord) -> Response:
    """A completed request as the caller collects it: the native bytes under the
    provider's Content-Type (``collect.py``: ranges, ETag, from either store),
    or the error response of its bucket; either way with its cost on
    ``X-Comfy-Cost-Credits`` and ``X-Comfy-Cost-State``."""
    _raise_error_of(record)
    services = front.services
    return collect(request, record, services.store.result(record.id), services.blobs, services.metrics,
                   cost_headers(record))


@paths.COST.view(queue)
def cost(provider: str, model: str) -> Response:
    """What a submit of this model would hold now: the price admit.lua holds."""
    front = front_door()
    front.keys.workspace(request)
    entry = model_entry(provider, model, front.services.catalog)
    return json_response({"model": entry.id, "credits": entry.price_credits})


@paths.RUN.view(queue)
def run(provider: str, model: str) -> Response:
    """The synchronous route: the same admission and workers as the queue,
    holding the connection until the request completes or the deadline. It
    holds one of the workspace's held-connection slots from before its
    admission (refused: nothing admitted) to its answer. Its key revoked
    while held: 401, and the generation runs on."""
    front = front_door()
    caller = front.keys.caller(request)
    entry = model_entry(provider, model, front.services.catalog)
    settings = front.services.settings
    with holding(front.held, caller.workspace):
        admitted = admission.admit(
            front.services, workspace=caller.workspace, entry=entry, raw_body=read_body(request),
            raw_idempotency_key=request.headers.get("Idempotency-Key"),
            raw_priority=request.headers.get("X-Comfy-Priority"), queued=False, rate=carried_allowance,
            raw_webhook_url=request.headers.get(admission.WEBHOOK_HEADER), base_url=_base_url(front),
            headers=request.headers,
            traceparent=tracing.traceparent(),
        )
        current_call().id = admitted.request_id
        try:
            view = wait_until_completed(front.services.store, front.events, admitted.request_id, entry.provider,
                                        settings.sync_hold_s, front.keys.held_key(request))
        except Unauthorized as stopped:
            raise Unauthorized(f"{stopped.detail}; request {admitted.request_id} runs on, charged as admitted: "
                               f"collect it with another key of the workspace") from None
    if view.record is None:
        raise Gone(f"request {admitted.request_id} finished more than its retention window ago")
    if view.record.status != COMPLETED:
        raise DeadlineExceeded(
            f"the generation did not finish within {settings.sync_deadline_s:.0f} s and runs on; "
            "send the same request with the same Idempotency-Key to collect it",
            retry_after=pacing.retry_after(view.record, view.position, view.pace),
        )
    return _finished(front, view.record)


@paths.RETRY.view(queue)
def retry(provider: str, model: str, request_id: str) -> Response:
    """Submit a failed request's body again as a new request (its status
    names ``retry_of``), admitted like any submit, with this call's headers."""
    front = front_door()
    workspace = front.keys.workspace(request)
    entry = model_entry(provider, model, front.services.catalog)
    if not front.services.store.addressable(request_id, entry.provider):
        raise RequestNotFound(NOT_FOUND)
    admission.refuse_bring_your_own_key(request.headers)
    base = _base_url(front)
    headers = request.headers
    admitted = admission.admit(
        front.services, workspace=workspace, entry=entry, raw_body=b"",
        raw_idempotency_key=headers.get("Idempotency-Key"), raw_priority=headers.get("X-Comfy-Priority"),
        rate=carried_allowance, raw_webhook_url=headers.get(admission.WEBHOOK_HEADER), base_url=base,
        headers=headers, retry_of=request_id, traceparent=tracing.traceparent(),
    )
    if admitted.replayed:
        raise NotRetryable(f"{request_id} was already retried under this Idempotency-Key, as "
                           f"{admitted.request_id}; nothing new was admitted")
    answer = _handle(front, entry, workspace, admitted, base, "retry")
    current_call().id = answer.call_id
    return json_response(answer.body, answer.status, answer.headers)


@paths.CANCEL.view(queue)
def cancel(provider: str, model: str, request_id: str) -> Response:
    front = front_door()
    workspace = front.keys.workspace(request)
    entry = model_entry(provider, model, front.services.catalog)
    if not front.services.store.addressable(request_id, entry.provider):
        raise RequestNotFound(NOT_FOUND)
    base = _base_url(front)
    outcome = front.services.store.cancel(
        request_id=request_id, workspace=workspace, model=entry.id, provider=entry.provider
    )
    if outcome is Cancel.EXPIRED:
        raise ServiceUnavailable("the request store answered too late; nothing was cancelled; retry shortly",
                                 retry_after=1)
    if outcome is Cancel.MISSING:
        if front.services.ids.is_ours(request_id, workspace, entry.id):
            raise Gone(f"request {request_id} finished more than its retention window ago")
        raise RequestNotFound(NOT_FOUND)
    log.info("cancel: %s", outcome.lower(), extra={"request_id": request_id, "workspace": workspace,
                                                   "model": entry.id, "outcome": outcome.lower()})
    if outcome is Cancel.CANCELLED:
        front.services.metrics.completed(entry.provider, entry.id, "cancelled")
    if outcome is Cancel.ALREADY_COMPLETED:
        return json_response(
            {"request_id": request_id, "status": "ALREADY_COMPLETED",
             "detail": "the request had already finished; there was nothing to cancel"},
            409, {"X-Comfy-Error-Type": "already_completed"},
        )
    body = {"request_id": request_id, "status": "CANCELLATION_REQUESTED", **request_urls(base, entry.id, request_id)}
    return json_response(body, 202)
