"""Running one admitted request: claim it, call its provider, record the outcome.

Plain functions, no Celery here, so they are tested directly. Safe to run
twice for one request: the claim lets one delivery at a time through, and a
request only ever completes once (complete.lua keeps the first outcome).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from router_queue import logs, states, tracing
from router_queue.catalog import CallPolicy, ModelEntry
from router_queue.metrics import Recorder
from router_queue.provider_pools import Member
from router_queue.requests.outcomes import Claim, Complete
from router_queue.requests.record import RequestRecord
from router_queue.requests.values import WEBHOOK_DUE, Lease
from router_queue.store.connect import FULL, UNREACHABLE
from router_queue.webhooks import delivery as webhook_delivery

from . import fallbacks, members
from .bodies import STORE_AWAY_RETRY_S, BodyLost, BodyUnavailable, native_body
from .context import WorkerContext
from .outputs import keep_output
from .providers import ADAPTERS, HandBack, ProviderCall, ProviderFailure
from .providers.hosts import ProviderHosts

log = logging.getLogger(__name__)

#: The store's faults a worker rides out: Redis restarting (refused, or still
#: loading its AOF), stalled (timeouts), failing over, or full (a refused
#: write wrote nothing, so trying it again later is safe).
STORE_FAULTS = UNREACHABLE + FULL
#: Seconds between two tries of a write through a store fault: first, most.
STORE_RETRY_S = (0.2, 2.0)
#: Seconds after a fresh claim in which a step does not ask Redis for the
#: cancel flag. The claim found none atomically (a queued request's cancel
#: ends it there and then, so one cancelled before its claim is never
#: claimed): the check before the first provider call was a round trip that
#: always answered no. A cancel sent meanwhile is seen at the next step, as
#: one sent just after that check always was.
CANCEL_FRESH_S = 0.5

T = TypeVar("T")

#: The claims that end the request unrun, with the outcome each counts as.
_ENDED_BY_CLAIM = {Claim.QUEUE_TIMEOUT: states.QUEUE_TIMEOUT, Claim.EXHAUSTED: states.PROVIDER_ERROR,
                   Claim.DEADLINE: states.CANCELLED}


class Later(Exception):
    """Deliver this request again in ``countdown`` seconds (a Celery retry)."""

    def __init__(self, countdown: float, reason: str):
        super().__init__(reason)
        self.countdown = countdown


def backoff(policy: CallPolicy, attempt: int, retry_after_s: float | None = None) -> float:
    """Seconds before attempt ``attempt + 1``: capped exponential, jittered, and
    never sooner than the provider's own ``Retry-After``."""
    ceiling = min(policy.backoff_max_s, policy.backoff_base_s * 2 ** (attempt - 1))
    delay = ceiling * random.uniform(0.5, 1.0)
    return max(delay, retry_after_s or 0.0)


@dataclass(frozen=True)
class Execution:
    """Who this delivery is, for the lease.

    ``token`` is unique to this execution. ``resume_key`` names this retry of
    its task ("{task id}:{retries}") and ``next_resume_key`` the next one: a
    delivery that schedules a retry keeps its lease for that retry alone, so a
    redelivered copy of a message never runs beside the original.
    """

    token: str
    resume_key: str = ""
    next_resume_key: str = ""


def deliver(context: WorkerContext, request_id: str, execution: Execution) -> str:
    """Run ``request_id`` if this delivery may; returns what happened, for logs.
    Traced, it is a ``deliver`` span in the trace its submit left on the
    record (tracing.py), whoever published its message."""
    with logs.bound(request_id=request_id, task=execution.resume_key):
        if not tracing.active():
            return _deliver(context, request_id, execution)
        with tracing.span("deliver", parent=context.services.store.traceparent(request_id), kind="CONSUMER",
                          attributes={"router_queue.request_id": request_id,
                                      "messaging.message.id": execution.resume_key}) as span:
            try:
                outcome = _deliver(context, request_id, execution)
            except Later as later:
                tracing.note(span, outcome="retry_later", retry_in_s=later.countdown)
                raise
            tracing.note(span, outcome=outcome)
            return outcome


def _deliver(context: WorkerContext, request_id: str, execution: Execution) -> str:
    services = context.services
    store = services.store
    record, body = store.load(request_id)
    if record is None:
        log.warning("request %s has no record (expired or never admitted); dropping", request_id)
        return "missing"
    entry = services.catalog.by_id(record.model_ran or record.model)  # the model it fell back to, if it did
    if entry is None:
        store.complete(record, error_type=states.INTERNAL_ERROR,
                       detail=f"model {record.model_ran or record.model} left the catalog")
        return "internal_error"
    try:
        body = native_body(services.blobs, services.metrics, request_id, body)
    except BodyUnavailable as away:  # nothing claimed: this delivery comes back
        raise Later(STORE_AWAY_RETRY_S, f"the object store did not give the body: {away}") from None
    except BodyLost as lost:
        log.error("request %s: %s; ended unbilled", request_id, lost)
        store.complete(record, error_type=states.INTERNAL_ERROR, detail=f"its body could not be read: {lost}")
        return "internal_error"
    lease = Lease(token=execution.token, lease_s=services.settings.lease_s,
                  queue_timeout_s=entry.policy.queue_timeout_s, max_takeovers=services.settings.max_takeovers,
                  resume_key=execution.resume_key)
    with logs.bound(workspace=record.workspace, model=record.model):
        return _claim_and_run(context, record, body, entry, lease, execution)


def _claim_and_run(context: WorkerContext, record: RequestRecord, body: bytes | None, entry: ModelEntry,
                   lease: Lease, execution: Execution) -> str:
    services, store, request_id = context.services, context.services.store, record.id
    claim = store.claim(record, lease)
    log.info("claim: %s", claim, extra={"outcome": claim.lower()})
    metrics = services.metrics
    if claim is Claim.CLAIMED:
        metrics.claimed(record.provider, record.model, time.time() - record.created_at)
        webhook_delivery.nudge(services, context.dispatcher, record)  # its "started" event, when it chose one
    elif claim in _ENDED_BY_CLAIM:
        metrics.completed(record.provider, record.model, _ENDED_BY_CLAIM[claim])
        webhook_delivery.nudge(context.services, context.dispatcher, record)
    if claim not in (Claim.CLAIMED, Claim.RESUMED):
        log.info("request %s: %s; this delivery does nothing", request_id, claim)
        return claim.lower()
    context.leases.hold(request_id, record.provider, execution.token, for_s=entry.policy.hung_after_s)
    # a resumed request may have been flagged while it ran elsewhere: it asks at once
    flag_unread_until = time.monotonic() + CANCEL_FRESH_S if claim is Claim.CLAIMED else 0.0
    try:
        return _run(context, record, body or b"{}", entry, execution, metrics, flag_unread_until)
    finally:
        context.leases.release(request_id)


def through_store_faults(what: str, write: Callable[[], T], within_s: float) -> T:
    """``write``, tried again through store faults for up to ``within_s``
    seconds (then the fault is raised). For the writes a worker must not
    lose: the outcome of a generation the provider already answered, and the
    provider's handle on one it accepted."""
    deadline = time.monotonic() + within_s
    delay = STORE_RETRY_S[0]
    while True:
        try:
            return write()
        except STORE_FAULTS as fault:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: Redis unavailable (%s); trying again in %.1f s", what, fault, delay)
            time.sleep(delay)
            delay = min(delay * 2, STORE_RETRY_S[1])


def _interruption(context: WorkerContext, request_id: str, flag_unread_until: float) -> str | None:
    if context.shutting_down.is_set():
        return "shutdown"
    if time.monotonic() < flag_unread_until:
        return None
    try:
        if context.services.store.cancel_requested(request_id):
            return "cancel"
    except STORE_FAULTS:  # unknown for now: the generation goes on, the next poll asks again
        log.warning("request %s: could not read its cancel flag; asking again at the next step", request_id)
    return None


def _upstream_ref(record: RequestRecord) -> dict[str, Any] | None:
    return json.loads(record.upstream_ref) if record.upstream_ref else None


def _run(context: WorkerContext, record: RequestRecord, body: bytes, entry: ModelEntry, execution: Execution,
         metrics: Recorder, flag_unread_until: float) -> str:
    services, store, request_id = context.services, context.services.store, record.id
    lease_s = services.settings.lease_s

    def complete(**outcome: Any) -> Complete:
        # The provider answered: its outcome is written through a Redis
        # restart or stall for as long as the lease would have lasted. If
        # another worker took over meanwhile, the first outcome written wins.
        with tracing.span("complete", attributes={"router_queue.error_type": outcome.get("error_type") or ""}):
            return through_store_faults(f"request {request_id}: completion",
                                        lambda: store.complete(record, **outcome), lease_s)

    def remember(ref: dict[str, Any]) -> None:
        # The provider's handle on the generation it accepted, saved the moment
        # its answer arrives: a worker that dies after this resumes the
        # generation instead of paying for another. What is left is the time
        # the accept takes to cross the network plus this write.
        through_store_faults(f"request {request_id}: upstream handle",
                             lambda: store.remember_upstream(request_id, json.dumps(ref)), lease_s)

    def progressed(progress: float) -> None:
        # A side write: a store fault loses this step's figure, never the run.
        try:
            kept = store.record_progress(request_id, execution.token, progress)
        except STORE_FAULTS as exc:
            log.warning("request %s: progress %.2f not recorded: %s", request_id, progress, exc)
            return
        if kept == WEBHOOK_DUE:
            webhook_delivery.publish_owed(context.services, context.dispatcher, request_id)  # its progress event

    def fail(failure: ProviderFailure, started_at: float) -> str:
        _completed(context, metrics, record, complete(error_type=failure.error_type, detail=failure.detail,
                                             billable=failure.billable), failure.error_type, started_at)
        log.info("request %s completed with %s after %.2f s", request_id, failure.error_type,
                 time.monotonic() - started, extra={"outcome": failure.error_type, "status": "COMPLETED"})
        return failure.error_type

    def later(countdown: float, reason: str) -> Later:
        # Keep the lease through the wait, for the retry alone.
        store.renew(request_id, record.provider, execution.token, countdown + services.settings.lease_s,
                    successor=execution.next_resume_key)
        return Later(countdown, reason)

    started = time.monotonic()
    upstream_ref = _upstream_ref(record)
    started_at = record.started_at or time.time()
    pinned = services.regions.of(record.workspace) if services.regions is not None else ()
    member, wait_s = members.take(services, entry, request_id, prefer=(upstream_ref or {}).get("member", ""),
                                  regions=pinned)
    if member is None and wait_s == math.inf:
        return fail(members.outside_pin(entry, record.workspace, pinned), started_at)
    if member is None:  # every member paused, out or full: the request waits, not charged an attempt
        wait_s = fallbacks.wait_or_turn(services, record, entry, wait_s, later)
        ended = members.past_longest_run(entry, started_at)
        if ended is not None:
            return fail(ended, started_at)
        raise later(wait_s, f"every member of {entry.provider}'s pool is paused or full")
    try:
        return _call(context, record, body, entry, execution, metrics, flag_unread_until, member, upstream_ref,
                     started_at, complete=complete, remember=remember, progressed=progressed, fail=fail,
                     later=later)
    finally:
        try:
            services.members.release(entry.provider, member.name, request_id)
        except STORE_FAULTS as exc:  # its lease gives it back
            log.warning("request %s: its slot on %s member %s not given back now (%s)", request_id,
                        entry.provider, member.name, exc)


def _call(context: WorkerContext, record: RequestRecord, body: bytes, entry: ModelEntry, execution: Execution,
          metrics: Recorder, flag_unread_until: float, member: Member, upstream_ref: dict[str, Any] | None,
          started_at: float, *, complete: Callable[..., Complete], remember: Callable[[dict[str, Any]], None],
          progressed: Callable[[float], None], fail: Callable[[ProviderFailure, float], str],
          later: Callable[[float, str], Later]) -> str:
    """The provider called through ``member``; its outcome recorded."""
    services, store, request_id = context.services, context.services.store, record.id
    credentials = context.credentials
    assert credentials is not None  # WorkerContext.__post_init__ builds it
    call = ProviderCall(
        entry=entry,
        body=body,
        url=entry.upstream(services.settings.provider_origin_override, member),
        credential=credentials.for_provider(entry.provider, member.name),
        session=context.session,
        interruption=lambda: _interruption(context, request_id, flag_unread_until),
        upstream_ref=upstream_ref,
        remember=lambda ref: remember({**ref, "member": member.name}),  # a resume polls through the same member
        progressed=progressed,
        started_at=started_at,
        timed=lambda seconds: metrics.provider_call(entry.provider, entry.id, seconds),
        hosts=ProviderHosts.of(services.settings),
        organization=member.organization,
    )
    started = time.monotonic()
    try:
        with tracing.span("provider call", attributes={"router_queue.provider": entry.provider,
                                                       "router_queue.model": entry.id}):
            output = ADAPTERS[entry.adapter](call)
    except HandBack:
        store.renew(request_id, record.provider, execution.token, 0, hand_back=True)
        context.dispatcher.publish(request_id, record.provider)
        log.info("request %s handed back for another worker to resume", request_id)
        return "handed_back"
    except ProviderFailure as failure:
        pool_wait = members.wait_after(services, entry, member, failure)
        if pool_wait is not None and members.past_longest_run(entry, call.started_at) is None:
            pool_wait = fallbacks.wait_or_turn(
                services, record, entry, pool_wait, later, member.name,
                fallbacks.MEMBER_TROUBLE.get(failure.http_status or 0, failure.error_type))
            log.info("request %s: %s member %s answered %s; trying the pool again in %.1f s (no attempt counted)",
                     request_id, entry.provider, member.name, failure.http_status, pool_wait)
            raise later(pool_wait, failure.detail) from failure
        if failure.retryable:
            attempts = store.record_attempt(request_id)
            if attempts < entry.policy.max_attempts:
                countdown = fallbacks.wait_or_turn(services, record, entry,
                                                   backoff(entry.policy, attempts, failure.retry_after_s), later,
                                                   member.name, failure.error_type)
                metrics.retried(entry.provider, entry.id)
                log.info("request %s attempt %d failed (%s); retrying in %.1f s",
                         request_id, attempts, failure.detail, countdown)
                raise later(countdown, failure.detail) from failure
        return fail(failure, call.started_at)
    except STORE_FAULTS:
        # Redis, not the request, failed before any outcome: the lease runs
        # out and another delivery resumes the generation from its handle.
        log.exception("request %s: Redis failed mid-run; leaving it to its lease", request_id)
        raise
    except Exception:
        log.exception("request %s failed inside the worker", request_id)
        _completed(context, metrics, record, complete(error_type=states.INTERNAL_ERROR,
                                             detail="the worker failed while running the request"),
                   states.INTERNAL_ERROR, call.started_at)
        return "internal_error"
    written = keep_output(services, context.leases, record, execution.token, output.content, output.content_type,
                          complete)
    _completed(context, metrics, record, written, "success", call.started_at)
    log.info("request %s completed in %.2f s", request_id, time.monotonic() - started,
             extra={"outcome": "success", "status": "COMPLETED"})
    return "completed"


def _completed(context: WorkerContext, metrics: Recorder, record: RequestRecord, written: Complete,
               outcome: str, started_at: float) -> None:
    """Count a completion this delivery wrote (not one a duplicate found done)."""
    if written is Complete.COMPLETED:
        metrics.completed(record.provider, record.model, outcome, time.time() - started_at)
        webhook_delivery.nudge(context.services, context.dispatcher, record)
