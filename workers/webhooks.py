"""Delivering one webhook event: take it, check its URL again, sign, POST once,
record what happened and when to try again.

Plain functions, no Celery here (``tasks.deliver_webhook`` calls them). At
least once, never twice at a time: ``webhook_take.lua`` lets one attempt hold
an event for ``WEBHOOK_LEASE_SECONDS``; a worker killed mid-attempt leaves it
held until then, and beat's sweeper publishes it again after, with the same
``webhook-id``. The event's state in Redis is the truth; a message is a nudge.

One attempt: the URL is checked again (``webhooks/safety.py``: DNS may have
changed since the submit), the event is signed with every secret that signs
for the workspace now, and POSTed with ``WEBHOOK_TIMEOUT_SECONDS`` for the
connect and each read, no redirects followed, and at most
:data:`MAX_RESPONSE_BYTES` of the answer read (a receiver's answer is not
ours to store; reading stops at the timeout too). A 2xx delivers, a 410 stops
for good, anything else is tried again on the schedule of
``webhooks/schedule.py``. Secrets and signatures are never logged, nor the
URL's path and query (receivers put tokens there): only its origin.
"""

from __future__ import annotations

import logging
import time
import uuid
from urllib.parse import urlsplit

import requests

from router_queue import logs
from router_queue.store.webhooks import WebhookEvent
from router_queue.webhooks import event as wire
from router_queue.webhooks import safety, schedule

from .context import WorkerContext

log = logging.getLogger(__name__)

#: Bytes of a receiver's answer read at most; the rest is dropped with the connection.
MAX_RESPONSE_BYTES = 64 * 1024


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def deliver_webhook(context: WorkerContext, request_id: str) -> str:
    """One attempt at ``request_id``'s event, if it is due and free; returns
    what happened, for logs."""
    services, settings = context.services, context.services.settings
    token = uuid.uuid4().hex
    taken = services.webhooks.take(request_id, now=time.time(), lease_s=settings.webhook_lease_s, token=token)
    if taken.event is None:
        log.debug("webhook %s: %s; nothing to do", request_id, taken.outcome)
        return taken.outcome.lower()
    event = taken.event
    with logs.bound(request_id=request_id, workspace=event.workspace, model=event.model):
        started = time.monotonic()
        outcome, status, error = attempt(context, event)
        seconds = time.monotonic() - started
        now = time.time()
        next_at = None
        if outcome in ("failed", "refused"):
            next_at = schedule.next_attempt_at(event.attempt, now, event.first_attempt_at,
                                               schedule_s=settings.webhook_retry_schedule_s,
                                               window_s=settings.webhook_retry_for_s)
        recorded = services.webhooks.record(event, token=token, now=now,
                                            outcome="failed" if outcome == "refused" else outcome,
                                            status=status, error=error, seconds=seconds, next_at=next_at)
        services.metrics.webhook_attempt(outcome, seconds)
        if recorded == "GAVE_UP":
            services.metrics.webhook_given_up()
        log.info("webhook attempt %d to %s: %s%s in %.2f s; %s", event.attempt, origin(event.url), outcome,
                 f" ({error})" if error else "", seconds,
                 f"next at +{next_at - now:.1f} s" if recorded == "RETRY" and next_at else recorded.lower(),
                 extra={"outcome": f"webhook_{outcome}"})
        return recorded.lower()


def attempt(context: WorkerContext, event: WebhookEvent) -> tuple[str, int | None, str]:
    """POST the event once: (outcome, HTTP status or None, error or "")."""
    settings = context.services.settings
    try:
        safety.check(event.url, allow_loopback_http=settings.webhook_allow_loopback_http)
    except safety.UnsafeWebhookUrl as exc:
        return "refused", None, f"the URL {exc}"
    signing = context.services.accounts.signing_secrets(event.workspace)
    if not signing:
        return "failed", None, "the workspace has no webhook secret (router-queue workspace webhook-secret WS)"
    body = wire.event_body(request_id=event.request_id, model=event.model, status=event.status,
                           error_type=event.error_type, response_url=event.response_url,
                           created_at=event.created_at, started_at=event.started_at,
                           completed_at=event.completed_at)
    headers = wire.signed_headers(wire.webhook_id(event.request_id), body, signing, int(time.time()))
    timeout = settings.webhook_timeout_s
    deadline = time.monotonic() + timeout
    try:
        with context.webhook_session.post(event.url, data=body, headers=headers, timeout=timeout,
                                          allow_redirects=False, stream=True) as response:
            _drain(response, deadline)
            status = response.status_code
    except requests.Timeout:
        return "failed", None, f"no answer within {timeout:g} s"
    except requests.RequestException as exc:
        return "failed", None, f"{type(exc).__name__}: {str(exc)[:200]}"
    if 200 <= status < 300:
        return "delivered", status, ""
    if status == 410:
        return "gone", status, "the receiver answered 410 Gone; no more attempts"
    return "failed", status, f"HTTP {status}"


def _drain(response: requests.Response, deadline: float) -> None:
    """Read at most MAX_RESPONSE_BYTES of the answer, and not past ``deadline``."""
    read = 0
    for chunk in response.iter_content(8192):
        read += len(chunk)
        if read >= MAX_RESPONSE_BYTES or time.monotonic() > deadline:
            return


def nudge(context: WorkerContext, request_id: str) -> None:
    """The fast path: a worker that just completed a request publishes its
    webhook at once when it owes one. Best effort: the sweeper publishes
    every event due anyway, within a sweep."""
    try:
        if context.services.webhooks.owed(request_id):
            context.dispatcher.publish_webhook(request_id)
    except Exception as exc:  # noqa: BLE001 - the completion is written; the sweeper covers this
        log.warning("webhook %s: not published at once (%s); the sweeper publishes it", request_id, exc)
