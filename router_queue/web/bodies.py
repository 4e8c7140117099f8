"""The JSON bodies the queue routes answer with, and the URLs inside them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flask import Response

from ..requests.record import STATUS_LISTED, RequestRecord, iso
from ..states import COMPLETED, IN_QUEUE


@dataclass(frozen=True)
class Answer:
    """A JSON answer before it is encoded: what the routes' shared functions
    return, for the Flask views and the lane to send."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    #: The request id the call admitted, for ``X-Comfy-Request-Id``.
    call_id: str | None = None


def response_url(base: str, model_id: str, request_id: str) -> str:
    """Where a request's result is collected; the other two URLs hang off it."""
    return f"{base}/v2/models/{model_id}/requests/{request_id}"


def request_urls(base: str, model_id: str, request_id: str) -> dict[str, str]:
    """The three absolute URLs that address one request."""
    root = response_url(base, model_id, request_id)
    return {"status_url": f"{root}/status", "response_url": root, "cancel_url": f"{root}/cancel"}


def status_body(record: RequestRecord, position: int | None, base: str, retention_s: int) -> dict[str, Any]:
    """A request's status body (and a history entry's, an event stream's
    update): the fields ``requests/record.py`` declares on status, those in a
    place of their own here, then those LISTED."""
    body: dict[str, Any] = {"request_id": record.id, "status": record.status}
    if record.status != COMPLETED:
        body["queue_position"] = (position or 0) if record.status == IN_QUEUE else 0
    body.update(request_urls(base, record.model, record.id))
    body["created_at"] = iso(record.created_at)
    if record.started_at is not None:
        body["started_at"] = iso(record.started_at)
    if record.completed_at is not None:
        body["completed_at"] = iso(record.completed_at)
        body["expires_at"] = iso(record.completed_at + retention_s)
    for listed in STATUS_LISTED:  # the fields record.py declares LISTED, each when set
        value = getattr(record, listed.name)
        if value is not None:
            body[listed.name] = listed.codec.show(value)
    if record.status == COMPLETED and not record.error_type:
        body["progress"] = 1.0  # a success is whole, whatever (or whether) the provider reported
    elif record.progress is not None:
        body["progress"] = record.progress  # only grows
    if record.error_type:
        body["error_type"] = record.error_type
        body["detail"] = record.detail or ""
    body["cost"] = record.cost.as_json()
    return body


#: The result's headers naming its cost (the status body's ``cost``).
COST_CREDITS_HEADER, COST_STATE_HEADER = "X-Comfy-Cost-Credits", "X-Comfy-Cost-State"
#: The header comfy-sdk reads as a run's ``credits_used``: sent once charged.
CREDITS_USED_HEADER = "X-Comfy-Credits-Used"


def cost_headers(record: RequestRecord) -> dict[str, str]:
    credits, state = str(record.cost.credits), record.cost.state
    headers = {COST_CREDITS_HEADER: credits, COST_STATE_HEADER: state}
    if state == "charged":
        headers[CREDITS_USED_HEADER] = credits
    return headers


def json_text(body: Any) -> str:
    """Every JSON answer's encoding: compact."""
    return json.dumps(body, separators=(",", ":"))


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_text(body), status=status, headers=headers, mimetype="application/json")
