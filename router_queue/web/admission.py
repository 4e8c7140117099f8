"""Everything the front door decides before a request is queued.

Parsing and validating the native body, the priority, the idempotency
fingerprint, then one atomic admit in Redis (record + place in the provider's
schedule + key reservation, and a slot with its Celery message when one is
free). Nothing here reaches a worker unless the admit succeeded.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..catalog import ModelEntry
from ..errors import (
    BudgetExceeded,
    ConcurrencyLimitExceeded,
    Gone,
    IdempotencyKeyConflict,
    InsufficientCredits,
    InvalidInput,
    NotEnabled,
    NotRetryable,
    OutcomeUnknown,
    PendingWebhooksFull,
    QueueBacklogFull,
    QueuedBytesFull,
    RequestNotFound,
    RetryLimitReached,
    RouterError,
    ServiceUnavailable,
    StoredBytesFull,
    ValidationFailed,
)
from ..requests.outcomes import Admit
from ..requests.record import Submission
from ..requests.values import PRIORITIES, Admission
from ..services import Services
from ..store.apikeys import hash_key, is_legacy_namespace, key_id
from ..store.connect import Unsent
from ..validation import too_many_items, validate
from ..webhooks import event as webhook_event, safety
from . import pacing, stashed
from .auth import key_in
from .bodies import request_urls, response_url
from .fallback_models import FALLBACK_HEADER, fallback_models, held_price
from .refusals import NOT_FOUND, key_in_doubt

#: Longest Idempotency-Key accepted, in characters.
MAX_IDEMPOTENCY_KEY_LENGTH = 255
#: Seconds a submit refused for its pending webhook events is told to wait:
#: about when a first retry of a failed event has come and gone.
PENDING_WEBHOOKS_RETRY_AFTER_S = 30
#: Headers that carry the provider's own credentials (bring your own key):
#: such a request is the caller's to run synchronously, never ours to queue.
BYOK_HEADERS = ("X-Provider-Api-Key", "X-Provider-Authorization")


def refuse_bring_your_own_key(headers) -> None:
    if any(name in headers for name in BYOK_HEADERS):
        raise NotEnabled("a request carrying the provider's own credentials cannot be queued; "
                         "send it to the synchronous route")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``400 invalid_input`` saying what is wrong.

    JSON on the wire is UTF-8 (RFC 8259); ``json.loads`` would also take UTF-16
    and UTF-32 bytes, which we would then store and forward as they came, so the
    bytes are decoded strictly first. A body of more items than any model's
    input holds is ``422`` unparsed (``validation.too_many_items``).
    """
    too_many = too_many_items(raw)
    if too_many:
        raise ValidationFailed([{"loc": ["body"], "msg": too_many, "type": "too_long"}])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput("the body must be JSON encoded as UTF-8") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise InvalidInput("the body nests too deeply to be a model's input") from None
    except ValueError as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput(f"the body must be a JSON object, not {type(body).__name__}")
    return body


def validate_body(entry: ModelEntry, body: dict[str, Any]) -> None:
    """``422 invalid_input`` with the per-field ``detail`` array (bounded:
    ``validation.py``) when the schema refuses."""
    detail = validate(entry.schema(), body)
    if detail:
        raise ValidationFailed(detail)


def idempotency_key(raw: str | None) -> str | None:
    if raw is None:
        return None
    if not raw or len(raw) > MAX_IDEMPOTENCY_KEY_LENGTH or not raw.isascii() or not raw.isprintable():
        raise InvalidInput(
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable ASCII characters"
        )
    return raw


def priority(raw: str | None) -> str:
    """``X-Comfy-Priority``: orders a workspace's own requests; ``normal`` when absent."""
    if raw is None:
        return "normal"
    if raw not in PRIORITIES:
        raise InvalidInput(f"X-Comfy-Priority must be one of {', '.join(PRIORITIES)}, not {raw[:40]!r}")
    return raw


WEBHOOK_HEADER = webhook_event.URL_HEADER


def webhook_url(raw: str | None, *, allow_loopback_http: bool, resolve_timeout_s: float, workspace: str = "") -> str:
    """``X-Comfy-Webhook-Url``: where the completion's event goes; "" when
    absent (the workspace's default applies, if it has one). ``400
    invalid_input`` unless it is https and resolves, within
    ``resolve_timeout_s``, to public addresses only (``webhooks/safety.py``;
    checked again before every delivery); ``503`` when this process has no
    room for another lookup, or none for another of ``workspace``'s
    (``webhooks/lookup.py``)."""
    if raw is None:
        return ""
    try:
        safety.check(raw, allow_loopback_http=allow_loopback_http, resolve_timeout_s=resolve_timeout_s,
                     holder=workspace)
    except safety.UnsafeWebhookUrl as exc:
        raise InvalidInput(f"{WEBHOOK_HEADER} {exc}") from None
    except safety.LookupsBusy:
        raise ServiceUnavailable(f"too many {WEBHOOK_HEADER} host lookups (or too many of this workspace's) are "
                                 "under way here; nothing was queued or charged; retry shortly",
                                 retry_after=1) from None
    return raw


WEBHOOK_EVENTS_HEADER = webhook_event.EVENTS_HEADER


def webhook_events(raw: str | None) -> str:
    """``X-Comfy-Webhook-Events``: which of the request's events its webhook
    gets, canonical; "" when absent (the workspace's default, else
    ``completed``). ``400 invalid_input`` for an unknown name or none."""
    if raw is None:
        return ""
    try:
        return webhook_event.parse_events(raw)
    except webhook_event.UnknownEvents as exc:
        raise InvalidInput(f"{WEBHOOK_EVENTS_HEADER} {exc}") from None


def no_webhook_secret(workspace: str, source: str | None) -> str:
    """Why a submit naming a webhook was refused when the workspace cannot sign
    its events, and how to fix it."""
    named = (f"{WEBHOOK_HEADER} names a webhook" if source == "header"
             else "the workspace has a default webhook URL")
    if is_legacy_namespace(workspace):
        return (f"{named}, but this API key belongs to no workspace, so its events could not be signed; "
                "use a workspace key; nothing was queued or charged")
    return (f"{named}, but workspace {workspace} has no webhook signing secret, so its events could not be "
            f"signed; create one with `router-queue workspace webhook-secret {workspace}`, then send this "
            "again; nothing was queued or charged")


START_DEADLINE_HEADER = "X-Comfy-Start-Deadline"
DEADLINE_HEADER = "X-Comfy-Deadline"
#: A caller's deadline: seconds from the submit, a plain decimal number (no
#: sign, exponent, "inf" or "nan"), at most 9 digits before the point.
_SECONDS = re.compile(r"[0-9]{1,9}(\.[0-9]{1,6})?")


@dataclass(frozen=True)
class Deadlines:
    """The caller's deadlines as Unix seconds, each None when not asked for."""

    start_at: float | None = None
    run_at: float | None = None


def _deadline_seconds(name: str, raw: str, bound_s: float, bound_why: str) -> float:
    if not _SECONDS.fullmatch(raw):
        raise InvalidInput(f"{name} must be a number of seconds greater than 0, such as 30 or 2.5, "
                           f"not {raw[:40]!r}")
    seconds = float(raw)
    if seconds <= 0:
        raise InvalidInput(f"{name} must be greater than 0 seconds")
    if seconds > bound_s:
        raise InvalidInput(f"{name} may be at most {bound_s:g} s for this model ({bound_why}), not {raw}")
    return seconds


def deadlines(headers, entry: ModelEntry, now: float) -> Deadlines:
    """``X-Comfy-Start-Deadline`` and ``X-Comfy-Deadline``: seconds from now.
    Bounded by the model's own policy, refused (``400 invalid_input``) past
    it: the start deadline by its queue timeout (it never waits longer), the
    deadline by its queue timeout plus its longest run (it never lives longer)."""
    raw_start, raw_run = headers.get(START_DEADLINE_HEADER), headers.get(DEADLINE_HEADER)
    if raw_start is None and raw_run is None:
        return Deadlines()
    policy = entry.policy
    start = None if raw_start is None else _deadline_seconds(
        START_DEADLINE_HEADER, raw_start, policy.queue_timeout_s, "its queue timeout")
    run = None if raw_run is None else _deadline_seconds(
        DEADLINE_HEADER, raw_run, policy.queue_timeout_s + policy.max_run_s, "its queue timeout plus its longest run")
    return Deadlines(None if start is None else now + start, None if run is None else now + run)


def fingerprint(model_id: str, body: dict[str, Any]) -> str:
    """What an Idempotency-Key is bound to: the model and the canonical body."""
    # ASCII escapes keep a lone surrogate (legal in JSON text) encodable.
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{model_id}\n{canonical}".encode()).hexdigest()


def retry_fingerprint(model_id: str, original_id: str) -> str:
    """What an Idempotency-Key sent on a retry is bound to: the model and the
    request retried (never a body: a submit of the same body under the same
    key is another request)."""
    return hashlib.sha256(f"{model_id}\nretry of {original_id}".encode()).hexdigest()


@dataclass(frozen=True)
class Admitted:
    request_id: str
    replayed: bool
    #: Position at admission; None for a replay (read it from the store).
    position: int | None


def admit(services: Services, *, workspace: str, entry: ModelEntry, raw_body: bytes,
          raw_idempotency_key: str | None, raw_priority: str | None = None, queued: bool = True,
          rate: Callable[[], Any] = lambda: None, raw_webhook_url: str | None = None,
          base_url: str = "", headers=None, retry_of: str = "",
          traceparent: str = "", bulk_id: str = "") -> Admitted:
    """Admit a request for the workers. ``queued`` is False for the synchronous
    route, which shares everything but queued delivery's gating. ``rate`` hands
    over the call's rate allowance (``envelope.carried_allowance``), taken only
    when the admit script runs to count it in the same atomic step: a body
    refused before that leaves it to the after-request hook. ``base_url``
    builds the response_url a webhook's event names. ``headers`` carry the
    caller's deadlines and webhook events. ``retry_of``: submit that failed request's kept body
    again (``raw_body`` is not read). ``traceparent``
    (``tracing.traceparent()``, "" when off) is kept on the record; ``bulk_id``
    names the bulk action a retry is part of (``web/bulk.py``)."""
    if queued and not entry.queueable:
        raise NotEnabled(f"{entry.id} cannot be queued; use POST /v2/models/{entry.id}")
    key = idempotency_key(raw_idempotency_key)
    rank = priority(raw_priority)
    hook = webhook_url(raw_webhook_url, allow_loopback_http=services.settings.webhook_allow_loopback_http,
                       resolve_timeout_s=services.settings.webhook_resolve_timeout_s, workspace=workspace)
    events = webhook_events(headers.get(WEBHOOK_EVENTS_HEADER) if headers is not None else None)
    now = time.time()
    due = deadlines(headers, entry, now) if headers is not None else Deadlines()
    fallback = fallback_models(headers.get(FALLBACK_HEADER) if headers is not None else None, entry,
                               services.catalog)
    bound_model = f"{entry.id} or {fallback}" if fallback else entry.id  # the key is bound to the models it accepts
    hold, model_price = held_price(entry, fallback, services.catalog)
    if retry_of:
        bound_to = retry_fingerprint(bound_model, retry_of) if key else ""
    else:
        body = parse_body(raw_body)
        validate_body(entry, body)
        bound_to = fingerprint(bound_model, body) if key else ""
    request_id = services.ids.mint(workspace, entry.id)
    pointer = None if retry_of else stashed.stash(services, request_id, raw_body)
    try:
        admission = services.store.admit(Submission(
            request_id=request_id,
            workspace=workspace,
            model=entry.id,
            provider=entry.provider,
            body=pointer.text() if pointer else "" if retry_of else raw_body.decode(),
            fingerprint=bound_to,
            idempotency_key_hash=hashlib.sha256(key.encode()).hexdigest() if key else "",
            price=hold,
            model_price=model_price,
            require_enabled=queued,
            priority=rank,
            webhook_url=hook,
            response_url=response_url(base_url, entry.id, request_id) if base_url else "",
            retry_of=retry_of,
            start_deadline_at=due.start_at,
            deadline_at=due.run_at,
            now=time.time() if pointer else now,  # a put may have taken a while: the write deadline runs from here
            traceparent=traceparent,
            webhook_events=events,
            bulk_id=bulk_id,
            fallback_models=fallback,
            key_id=caller_key_id(headers),
        ), rate=rate())
    except (RouterError, Unsent):  # refused (a rate window), or never sent: not admitted
        stashed.unstash(services, pointer, request_id)
        raise
    if admission.outcome not in (Admit.ADMITTED, Admit.IN_DOUBT):  # refused: its body's object goes at once
        stashed.unstash(services, pointer, request_id)
    return _answer(services, admission, request_id, workspace, entry, raw_body, key, base_url, retry_of, hold)


@dataclass(frozen=True)
class _Refused:
    """What a refusal's answer draws on: the admission and the submit."""

    services: Services
    admission: Admission
    request_id: str
    workspace: str
    entry: ModelEntry
    raw_body: bytes
    key: str | None
    base_url: str
    retry_of: str
    #: The credits it would have held (the dearest model it may run on).
    hold: int


def _retry_missing(r: _Refused) -> RouterError:
    if r.services.ids.is_ours(r.retry_of, r.workspace, r.entry.id):
        return Gone(f"request {r.retry_of} finished more than its retention window ago")
    return RequestNotFound(NOT_FOUND)


def _holds(r: _Refused) -> str:
    if r.hold == r.entry.price_credits:
        return f"{r.entry.id} costs {r.hold} credits"
    return f"this request holds {r.hold} credits (the dearest model it named in {FALLBACK_HEADER})"


def _backlog_hint(r: _Refused) -> int:
    return pacing.backlog_retry_after(r.services.store.pace(r.entry.provider))


#: The answer to each outcome of an admission that admitted nothing (raised).
REFUSALS: dict[Admit, Callable[[_Refused], Exception]] = {
    Admit.EXPIRED: lambda r: ServiceUnavailable(
        "the request store answered too late; nothing was admitted or charged; retry shortly", retry_after=1),
    Admit.IN_DOUBT: lambda r: _in_doubt(r.request_id, r.entry, r.key, r.base_url),
    Admit.ADMITTING: lambda r: ConcurrencyLimitExceeded(
        "a request with this Idempotency-Key is still being admitted; send it again shortly to get its handle",
        retry_after=1),
    Admit.RETRY_MISSING: _retry_missing,
    Admit.NOT_RETRYABLE: lambda r: NotRetryable(_not_retryable(r.retry_of, r.admission.original_status)),
    Admit.RETRY_BODY_GONE: lambda r: NotRetryable(
        f"request {r.retry_of} failed before failed requests kept their body, so it cannot be submitted again; "
        "submit its body anew"),
    Admit.RETRY_LIMIT: lambda r: RetryLimitReached(
        f"request {r.retry_of}'s chain (the request it first retried, its retries and theirs) has had "
        f"{r.services.store.retry_max} retries, as many as it may; submit its body anew"),
    Admit.INSUFFICIENT_CREDITS: lambda r: InsufficientCredits(
        f"{_holds(r)} and the workspace has {r.admission.available} available; nothing was queued or charged"),
    Admit.BUDGET_EXCEEDED: lambda r: BudgetExceeded(budget_detail(r.hold, r.admission.budget)),
    Admit.BACKLOG_FULL: lambda r: QueueBacklogFull(
        "this workspace already has as many requests waiting as it may; retry when some have started",
        retry_after=_backlog_hint(r)),
    Admit.QUEUED_BYTES_FULL: lambda r: QueuedBytesFull(
        f"this body ({len(r.raw_body)} bytes) would put the bodies this workspace has stored for requests not yet "
        "completed over its byte quota; retry when some have completed", retry_after=_backlog_hint(r)),
    Admit.STORED_BYTES_FULL: lambda r: StoredBytesFull(
        "this workspace keeps as many bytes as it may (bodies kept for a retry and results not yet expired); "
        "nothing was queued or charged; retry when enough have expired", retry_after=r.admission.retry_after),
    Admit.PENDING_WEBHOOKS_FULL: lambda r: PendingWebhooksFull(
        "this workspace has as many webhook events pending (owed and not yet delivered, or owed once its running "
        "requests complete) as it may; retry once some are delivered, or submit without a webhook",
        retry_after=PENDING_WEBHOOKS_RETRY_AFTER_S),
    Admit.DRAINING: lambda r: ServiceUnavailable(
        f"{r.entry.provider} is draining for maintenance and admits nothing new; retry shortly", retry_after=30),
    Admit.NOT_ENABLED: lambda r: NotEnabled(
        "queued delivery is not switched on for this workspace; "
        f"POST /v2/models/{r.entry.id} serves the same body synchronously"),
    Admit.NO_WEBHOOK: lambda r: InvalidInput(
        f"{WEBHOOK_EVENTS_HEADER} chooses webhook events, but there is no webhook to send them to: name one with "
        f"{WEBHOOK_HEADER} (or set the workspace's default); nothing was queued or charged"),
    Admit.NO_WEBHOOK_SECRET: lambda r: InvalidInput(no_webhook_secret(r.workspace, r.admission.webhook_source)),
    Admit.IDEM_CONFLICT: lambda r: IdempotencyKeyConflict(
        "this Idempotency-Key is held by a different request; send this one under a new key"),
}


def _answer(services: Services, admission: Admission, request_id: str, workspace: str, entry: ModelEntry,
            raw_body: bytes, key: str | None, base_url: str, retry_of: str, hold: int) -> Admitted:
    """What the admission's outcome answers: the admitted request (or the one
    an Idempotency-Key replays), or its refusal raised (:data:`REFUSALS`)."""
    _count(services, entry, admission.outcome)
    refusal = REFUSALS.get(admission.outcome)
    if refusal is not None:
        raise refusal(_Refused(services, admission, request_id, workspace, entry, raw_body, key, base_url, retry_of,
                               hold))
    if admission.outcome is Admit.REPLAY:
        assert admission.request_id is not None  # a replay names the request it replays
        return Admitted(admission.request_id, True, None)
    return Admitted(request_id, False, admission.position)


#: Seconds a caller whose admission is in doubt is told to wait before asking
#: again: by then Redis has answered, or the next ask is in doubt too.


def _in_doubt(request_id: str, entry: ModelEntry, key: str | None, base_url: str) -> Exception:
    """The answer when the store ran out of time before telling whether the
    admission took effect: never a 503 (it may have). With an
    Idempotency-Key, the contract's own answer for a key in doubt, which a
    resend settles; without one, the id it has if admitted, and where to look."""
    if key:
        return key_in_doubt()
    status_url = request_urls(base_url, entry.id, request_id)["status_url"]
    return OutcomeUnknown(
        f"the request store did not answer in time, so whether this request was admitted is not known; if it was, "
        f"it is {request_id}. Read {status_url} once the store answers: a status means it was admitted; 404 or "
        "410 means it was not (nothing was queued or charged) and it may be submitted again. Send an "
        "Idempotency-Key to have a resend settle this for you", request_id=request_id, status_url=status_url)


#: The refusals counted as ``router_queue_refusals{reason}``: what the
#: workspace's or the provider's state refused, not a malformed call.
COUNTED_REFUSALS = frozenset({Admit.DRAINING, Admit.NOT_ENABLED, Admit.NO_WEBHOOK, Admit.NO_WEBHOOK_SECRET,
                              Admit.BACKLOG_FULL, Admit.QUEUED_BYTES_FULL, Admit.STORED_BYTES_FULL,
                              Admit.PENDING_WEBHOOKS_FULL,
                              Admit.INSUFFICIENT_CREDITS, Admit.BUDGET_EXCEEDED})


def _count(services: Services, entry: ModelEntry, outcome: Admit) -> None:
    if outcome is Admit.ADMITTED:
        services.metrics.admitted(entry.provider, entry.id)
    elif outcome in COUNTED_REFUSALS:
        services.metrics.refused(entry.provider, entry.id, outcome.value)


def caller_key_id(headers) -> str:
    """The id of the API key a call presents (its budgets are checked), or ""."""
    key = key_in(headers) if headers is not None else None
    return key_id(hash_key(key)) if key else ""


def budget_detail(price: int, budget) -> str:
    """What a budget's refusal says: whose, which period, its limit and what is spent."""
    whose = "the workspace's" if budget.scope == "workspace" else "this API key's"
    every = {"day": "daily", "week": "weekly", "month": "monthly"}.get(budget.period, budget.period)
    return (f"this request's {price} credits would take {whose} {every} budget of {budget.limit} credits "
            f"over ({budget.spent} held or charged this {budget.period}); nothing was queued or held")


def _not_retryable(request_id: str, status: str | None) -> str:
    if status == "SUCCEEDED":
        return f"request {request_id} succeeded; only a request that failed (COMPLETED with an error_type) is retried"
    return (f"request {request_id} is {status} and has not failed; only a request that failed (COMPLETED with an "
            "error_type) is retried")
