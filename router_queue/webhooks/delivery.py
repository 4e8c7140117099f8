"""Delivering one webhook event: take it, check its URL again, sign, POST
once, record what happened and when to try again (``retry_policy``).

At least once, never twice at a time: ``webhook_take.lua`` leases the event
to one attempt, and the event's state in Redis is the truth; a message is a
nudge. ``workers/tasks.py``'s ``deliver_webhook`` is the Celery shim that
calls :func:`deliver`. The attempt's safety (the address re-checked and
connected to, the whole-attempt timeout, no redirects, a bounded answer) is
written down in docs/ARCHITECTURE.md, "The webhook".
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import threading
import time
import uuid
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from router_queue import logs, tracing
from router_queue.store.secret_box import SecretsKeyError
from router_queue.webhooks.values import WebhookEvent

from ..urls import origin
from . import event as webhook_event, retry_policy, safety

if TYPE_CHECKING:
    from router_queue.requests.record import RequestRecord
    from router_queue.services import Services

log = logging.getLogger(__name__)

#: Bytes of a receiver's answer read at most; the rest is dropped with the connection.
MAX_RESPONSE_BYTES = 64 * 1024


class Publisher(Protocol):
    """What publishes a request's webhook message (``broker/dispatch.py``'s Dispatcher)."""

    def publish_webhook(self, request_id: str) -> None: ...


def deliver(services: Services, publisher: Publisher, request_id: str) -> str:
    """One attempt at ``request_id``'s event, if it is due and free; returns
    what happened, for logs."""
    settings = services.settings
    token = uuid.uuid4().hex
    taken = services.webhooks.take(request_id, now=time.time(), lease_s=settings.webhook_lease_s, token=token)
    if taken.event is None:
        if taken.outcome == "GAVE_UP":
            publish_owed(services, publisher, request_id)
        if taken.due_at is not None:
            log.debug("webhook %s: %s; due again in %.1f s", request_id,
                      "its endpoint's circuit is open" if taken.outcome == "OPEN" else "its workspace's turn",
                      taken.due_at - time.time())
        else:
            log.debug("webhook %s: %s; nothing to do", request_id, taken.outcome)
        return taken.outcome.lower()
    event = taken.event
    with logs.bound(request_id=request_id, workspace=event.workspace, model=event.model):
        started = time.monotonic()
        with _attempt_span(services, event) as span:
            outcome, status, error, endpoint_failed = attempt(services, event)
            tracing.note(span, outcome=outcome, attempt=event.attempt)
            if status is not None and span is not None:
                span.set_attribute("http.response.status_code", status)
        seconds = time.monotonic() - started
        now = time.time()
        next_at = None
        if outcome in ("failed", "refused"):
            next_at = retry_policy.next_attempt_at(event.attempt, now, min(event.owed_at, event.first_attempt_at),
                                                   delays_s=settings.webhook_retry_schedule_s,
                                                   window_s=settings.webhook_retry_for_s)
        recorded = services.webhooks.record(event, token=token, now=now,
                                            outcome="failed" if outcome == "refused" else outcome,
                                            status=status, error=error, seconds=seconds, next_at=next_at,
                                            endpoint_failed=endpoint_failed)
        services.metrics.webhook_attempt(outcome, seconds)
        if recorded == "GAVE_UP":
            services.metrics.webhook_given_up()
        if recorded in ("DELIVERED", "GONE", "GAVE_UP"):
            publish_owed(services, publisher, request_id)
        log.info("webhook %s attempt %d to %s: %s%s in %.2f s; %s", event.event, event.attempt, origin(event.url),
                 outcome,
                 f" ({error})" if error else "", seconds,
                 f"next at +{next_at - now:.1f} s" if recorded == "RETRY" and next_at else recorded.lower(),
                 extra={"outcome": f"webhook_{outcome}"})
        return recorded.lower()


def _attempt_span(services: Services, event: WebhookEvent):
    """Traced, the attempt is a span in its request's trace (the record's
    traceparent, tracing.py); else nothing, not even the record's read."""
    if not tracing.active():
        return tracing.span("webhook attempt")
    return tracing.span("webhook attempt", parent=services.store.traceparent(event.request_id),
                        kind="CLIENT", attributes={"router_queue.request_id": event.request_id,
                                                   "server.address": urlsplit(event.url).hostname or ""})


def attempt(services: Services, event: WebhookEvent) -> tuple[str, int | None, str, bool]:
    """POST the event once: (outcome, HTTP status or None, error or "",
    whether the endpoint failed: not when the attempt never reached it)."""
    timeout = services.settings.webhook_timeout_s
    body = webhook_event.event_body(request_id=event.request_id, model=event.model, status=event.status,
                                    error_type=event.error_type, response_url=event.response_url,
                                    created_at=event.created_at, started_at=event.started_at,
                                    completed_at=event.completed_at, event=event.event, progress=event.progress,
                                    cost=event.cost, listed=event.listed)
    try:
        status = send_signed(services, url=event.url, workspace=event.workspace, webhook_id=event.msg_id, body=body)
    except safety.UnresolvedInTime as exc:
        return "failed", None, f"the URL {exc}", True
    except safety.LookupsBusy:
        return "failed", None, "too many webhook host lookups under way in this worker; not attempted", False
    except safety.UnsafeWebhookUrl as exc:
        return "refused", None, f"the URL {exc}", False
    except (SecretsKeyError, NoSigningSecret) as exc:
        return "failed", None, str(exc), False
    except ConnectTimedOut:
        return "failed", None, f"no connection within {timeout:g} s", True
    except AttemptTimedOut:
        return "failed", None, f"no answer within {timeout:g} s", True
    except (OSError, http.client.HTTPException) as exc:
        return "failed", None, f"{type(exc).__name__}: {without_path(str(exc), event.url)[:200]}", True
    if 200 <= status < 300:
        return "delivered", status, "", False
    if status == 410:
        return "gone", status, "the receiver answered 410 Gone; no more attempts", False
    return "failed", status, f"HTTP {status}", True


def without_path(text: str, url: str) -> str:
    """``text`` with ``url``'s path and query cut out (http.client names a bad
    path in its error; the error is logged and shown to operators)."""
    parts = urlsplit(url)
    for secret in sorted({parts.path + (f"?{parts.query}" if parts.query else ""), parts.path, parts.query},
                         key=len, reverse=True):
        if len(secret) > 1:
            text = text.replace(secret, "…")
    return text


class AttemptTimedOut(Exception):
    """The attempt's whole time ran out before its answer was read."""


class ConnectTimedOut(AttemptTimedOut):
    """The attempt's whole time ran out before the connection was made."""


class NoSigningSecret(ValueError):
    """The workspace has no secret to sign with: nothing is sent unsigned."""


#: What ends one :func:`send_signed` without an answer: the URL refused or
#: unresolved, no secret, the POST's faults (timeouts included).
SEND_FAILURES = (ValueError, safety.LookupsBusy, SecretsKeyError, AttemptTimedOut, OSError, http.client.HTTPException)


def send_signed(services: Services, *, url: str, workspace: str, webhook_id: str, body: bytes) -> int:
    """Sign ``body`` (Standard Webhooks, with every secret that signs for
    ``workspace`` now) and POST it once to ``url``, checked again here (DNS
    may have changed): the answer's status. The one way every event is sent
    (a request's, ``batch.completed``, ``budget.threshold_crossed``), so each
    gets the same checks and one whole-attempt bound, the lookup included.
    Raises one of :data:`SEND_FAILURES` when there is no answer."""
    settings = services.settings
    timeout = settings.webhook_timeout_s
    started = time.monotonic()  # the lookup is inside the attempt's whole time
    addresses = safety.check(url, allow_loopback_http=settings.webhook_allow_loopback_http,
                             resolve_timeout_s=min(settings.webhook_resolve_timeout_s, timeout), holder=workspace)
    signing = services.accounts.signing_secrets(workspace)
    if not signing:
        raise NoSigningSecret("the workspace has no webhook secret (router-queue workspace webhook-secret WS)")
    headers = webhook_event.signed_headers(webhook_id, body, signing, int(time.time()))
    return post(url, str(addresses[0]), body, headers, max(0.001, timeout - (time.monotonic() - started)))


def post(url: str, address: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POST ``body`` to ``url`` over a connection to ``address`` (checked);
    the answer's status, which must arrive with its whole head within
    ``timeout_s`` of the start, the connect included (the body is read while
    time is left)."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    path = safety.request_target(parts)  # as safety.check had http.client check it
    expired = threading.Event()
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    # Every blocking step (the connect first: an address that drops our SYN
    # never refuses) waits at most timeout_s, and the watchdog below ends
    # them all at timeout_s from here.
    sock.settimeout(timeout_s)

    def cut() -> None:
        expired.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)  # `sock` is the TLS socket once wrapped
        except OSError:
            pass

    watchdog = threading.Timer(timeout_s, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            sock.connect((address, port))
        except OSError as exc:  # the watchdog's shutdown may end the connect first, as another error
            if isinstance(exc, TimeoutError) or expired.is_set():
                raise ConnectTimedOut() from None
            raise
        if expired.is_set():
            raise ConnectTimedOut()
        if https:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        connection = http.client.HTTPConnection(parts.hostname or address, port, timeout=timeout_s)
        connection.sock = sock  # already connected, to the checked address
        try:
            connection.request("POST", path, body=body, headers={"Host": parts.netloc, **headers})
            response = connection.getresponse()
            if expired.is_set():  # cut mid-head: http.client reads a shut socket as the head's end
                raise AttemptTimedOut()
            try:
                response.read(MAX_RESPONSE_BYTES)
            except (OSError, http.client.HTTPException):
                if not expired.is_set():
                    raise
                # the answer's status arrived in time: it stands; its body is not ours to wait for
            return response.status
        finally:
            connection.close()
    except (OSError, http.client.HTTPException) as exc:
        if isinstance(exc, (TimeoutError, socket.timeout)) or expired.is_set():
            raise AttemptTimedOut() from None
        raise
    finally:
        watchdog.cancel()
        sock.close()


def publish_owed(services: Services, publisher: Publisher, request_id: str) -> None:
    """Publish the request's webhook delivery when it owes an event now: the
    next one once an event ended (``lib/webhooks.lua``'s ``webhook_ended``), a progress
    event just owed. At once rather than at the next sweep; best effort, as
    :func:`nudge`."""
    try:
        if services.webhooks.owed(request_id):
            publisher.publish_webhook(request_id)
    except Exception as exc:  # noqa: BLE001 - the event is due; the sweeper covers this
        log.warning("webhook %s: next event not published at once (%s); the sweeper publishes it", request_id, exc)


def nudge(services: Services, publisher: Publisher, record: RequestRecord) -> None:
    """The fast path: a worker that just started or completed a request
    publishes its webhook at once when it owes an event. Best effort: the sweeper publishes
    every event due anyway, within a sweep. A record that names no webhook
    URL owes nothing: no round trip is spent asking."""
    if not record.webhook_url:
        return
    request_id = record.id
    try:
        if services.webhooks.owed(request_id):
            publisher.publish_webhook(request_id)
    except Exception as exc:  # noqa: BLE001 - the completion is written; the sweeper covers this
        log.warning("webhook %s: not published at once (%s); the sweeper publishes it", request_id, exc)
