"""Counters and histograms, kept in the process that counts them.

Each process counts in its own memory, at no Redis cost; Prometheus sums the
processes. gunicorn's workers share ``PROMETHEUS_MULTIPROC_DIR``, so the front
door's ``/metrics`` serves all of them; a Celery worker serves its own on
``WORKER_METRICS_PORT``. The queue's own state is not counted here
(``store/gauges.py`` reads it at scrape time), nor the operations page's
fleet-wide totals (``RequestStore.delivery_totals``). In full:
``docs/ARCHITECTURE.md``, "The front door's parts".
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess

log = logging.getLogger(__name__)

#: Histogram bucket bounds, seconds: from a fast poll to a long generation.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: What a webhook attempt can come to, and an event given up, as counted.
WEBHOOK_OUTCOMES = ("delivered", "failed", "gone", "refused", "given_up")
#: What the sweeper does, as counted.
SWEEPER_ACTIONS = ("republished", "reaped", "timed_out", "deadline_cancels")

#: What happens to results in the object store, as counted: an object written,
#: a put given up (the output kept in Redis instead), a collect cut short by a
#: sha256 mismatch (a corrupted object), objects deleted by the sweeper.
OBJECT_EVENTS = ("put", "put_failed", "sha256_mismatch", "deleted", "orphans_deleted", "fallback", "fallback_full",
                 "moved",
                 # request bodies over BODY_INLINE_MAX_BYTES (web/stashed.py, workers/delivery.py)
                 "body_put", "body_put_failed", "body_read_failed")

#: This process's metrics (never prometheus_client's global registry, which
#: libraries may add to).
REGISTRY = CollectorRegistry(auto_describe=False)

_MODEL = ("provider", "model")
ADMISSIONS = Counter("router_queue_admissions", "Requests admitted.", _MODEL, registry=REGISTRY)
REFUSALS = Counter("router_queue_refusals", "Submits refused at admission.", (*_MODEL, "reason"),
                   registry=REGISTRY)
COMPLETIONS = Counter("router_queue_completions", "Requests completed, by outcome.", (*_MODEL, "outcome"),
                      registry=REGISTRY)
RETRIES = Counter("router_queue_provider_retries", "Provider calls retried.", _MODEL, registry=REGISTRY)
WAIT = Histogram("router_queue_wait_seconds", "Seconds a request waited IN_QUEUE before a worker claimed it.",
                 _MODEL, buckets=BUCKETS, registry=REGISTRY)
RUN = Histogram("router_queue_run_seconds", "Seconds from claim to completion.", _MODEL, buckets=BUCKETS,
                registry=REGISTRY)
CALL = Histogram("router_queue_call_seconds", "Seconds one HTTP exchange with the provider took.", _MODEL,
                 buckets=BUCKETS, registry=REGISTRY)
MEMBER_EVENTS = Counter("router_queue_pool_member_events", "What a provider pool's members did: a generation "
                        "sent (taken), a 429 that paused one (rate_limited), a refused credential that took one out "
                        "(revoked).", ("provider", "member", "event"), registry=REGISTRY)
SWEEPS = Counter("router_queue_sweeper_actions", "What the sweeper did.", ("action",), registry=REGISTRY)
WEBHOOK_DELIVERIES = Counter("router_queue_webhook_deliveries",
                             "Webhook attempts by outcome (delivered, failed, gone, refused), and events given up "
                             "(given_up).", ("outcome",), registry=REGISTRY)
WEBHOOK_SECONDS = Histogram("router_queue_webhook_delivery_seconds",
                            "Seconds one webhook attempt took, to the receiver's answer or failure.",
                            buckets=BUCKETS, registry=REGISTRY)
BUDGET_ALERTS = Counter("router_queue_budget_alerts", "Budget thresholds crossed, by what became of the alert: "
                        "delivered (the workspace's default webhook), audited (no webhook: the key audit log), "
                        "given_up (its webhook kept failing).", ("period", "threshold", "outcome"),
                        registry=REGISTRY)
OBJECTS = Counter("router_queue_result_objects", "Results in the object store: puts, failed puts, sha256 "
                  "mismatches on collect, objects deleted (expired, orphaned).", ("event",), registry=REGISTRY)

# Series a dashboard reads before anything happened: shown at 0 from the start.
for _event in OBJECT_EVENTS:
    OBJECTS.labels(_event)
for _action in SWEEPER_ACTIONS:
    SWEEPS.labels(_action)
for _outcome in WEBHOOK_OUTCOMES:
    WEBHOOK_DELIVERIES.labels(_outcome)


def shared_directory() -> str | None:
    """The directory this process's counts go to for other processes to
    serve, or None when they live in this process alone. prometheus_client
    reads the variable once, when it is first imported."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def exposed() -> CollectorRegistry:
    """What a scrape of this process serves: every process sharing its
    directory, summed, or this process's own counts."""
    directory = shared_directory()
    if directory is None:
        return REGISTRY
    registry = CollectorRegistry(auto_describe=False)
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry


class Recorder:
    """What the front door, the workers and the sweeper count, by name.

    Every call is a few in-memory additions: no I/O, nothing that can fail
    into the request it describes; but for a failure, also handed to
    ``failures`` when given (``store/failures.py``, the fleet's recent
    failures), whose own failure is logged and let go.
    """

    def __init__(self, failures: Callable[[str, str, str], None] | None = None):
        self.failures = failures

    def admitted(self, provider: str, model: str) -> None:
        ADMISSIONS.labels(provider, model).inc()

    def refused(self, provider: str, model: str, reason: str) -> None:
        REFUSALS.labels(provider, model, reason.lower()).inc()

    def claimed(self, provider: str, model: str, waited_s: float) -> None:
        WAIT.labels(provider, model).observe(max(0.0, waited_s))

    def completed(self, provider: str, model: str, outcome: str, ran_s: float | None = None) -> None:
        """One request completed; ``outcome`` is "success" or its error_type."""
        COMPLETIONS.labels(provider, model, outcome).inc()
        if self.failures is not None and outcome != "success":
            try:
                self.failures(provider, model, outcome)
            except Exception:
                log.warning("a failure of %s could not be counted for the ops page", model, exc_info=True)
        if ran_s is not None:
            RUN.labels(provider, model).observe(max(0.0, ran_s))

    def provider_call(self, provider: str, model: str, seconds: float) -> None:
        CALL.labels(provider, model).observe(max(0.0, seconds))

    def member_event(self, provider: str, member: str, event: str) -> None:
        """A pool member's ``event``: "taken", "rate_limited" or "revoked"."""
        MEMBER_EVENTS.labels(provider, member, event).inc()

    def retried(self, provider: str, model: str) -> None:
        RETRIES.labels(provider, model).inc()

    def webhook_attempt(self, outcome: str, seconds: float) -> None:
        """One webhook attempt: "delivered", "failed", "gone", "refused" (its URL
        resolved to an address we do not call), and its latency."""
        WEBHOOK_DELIVERIES.labels(outcome).inc()
        WEBHOOK_SECONDS.observe(max(0.0, seconds))

    def webhook_given_up(self) -> None:
        WEBHOOK_DELIVERIES.labels("given_up").inc()

    def budget_alert(self, period: str, threshold: int, outcome: str) -> None:
        """A budget threshold crossed and what became of its alert (:data:`BUDGET_ALERTS`)."""
        BUDGET_ALERTS.labels(period, str(threshold), outcome).inc()

    def objects(self, event: str, count: int = 1) -> None:
        """Results and bodies in the object store: one of :data:`OBJECT_EVENTS`."""
        if count:
            OBJECTS.labels(event).inc(count)

    def swept(self, *, republished: int, reaped: int, timed_out: int, deadline_cancels: int = 0) -> None:
        for action, count in (("republished", republished), ("reaped", reaped), ("timed_out", timed_out),
                              ("deadline_cancels", deadline_cancels)):
            if count:
                SWEEPS.labels(action).inc(count)
