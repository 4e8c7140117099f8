"""Prometheus metrics, kept in Redis so they are right across every process.

The front door, the workers and the sweeper run as many processes on many
machines; counters and histograms they write go to ``rq:metrics:{provider}``
(admissions and refusals from admit.lua itself, the rest from here with one
pipelined write), and ``/metrics`` reads them back at scrape time together
with the queue depths and in-flight counts, which are read off the very
indexes the queue runs on. Whichever front-door process is scraped, the
figures are the fleet's.

Histograms are stored per bucket, not cumulated, and cumulated at scrape time.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..catalog import Catalog
from . import keys
from .connect import bounded

log = logging.getLogger(__name__)

#: Seconds a metrics write may wait on Redis. Metrics are best effort: a
#: stalled Redis costs a request this much at most, and a failed write is
#: dropped (logged), never raised into the request it describes.
WRITE_TIMEOUT_S = 0.25

#: Seconds a delivery's metrics may wait to be written with its next ones.
DELIVERY_FLUSH_S = 5.0

#: Completions are also counted per provider in windows of this many seconds,
#: kept this long: "per minute" on the ops page is what ended in the last minute.
COMPLETIONS_WINDOW_S = 10
COMPLETIONS_TTL_S = 120

#: Histogram bucket bounds, seconds: from a fast poll to a long generation.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
HISTOGRAMS = {
    "wait": "Seconds a request waited IN_QUEUE before a worker claimed it.",
    "run": "Seconds from claim to completion.",
    "call": "Seconds one HTTP exchange with the provider took.",
}


#: What a webhook attempt can come to, and an event given up, as counted.
WEBHOOK_OUTCOMES = ("delivered", "failed", "gone", "refused", "given_up")


def _bucket(value: float) -> str:
    for bound in BUCKETS:
        if value <= bound:
            return repr(bound)
    return "+Inf"


@dataclass(frozen=True)
class Totals:
    """A provider's lifetime counts, for the ops page."""

    completed: int
    #: Requests claimed, and the seconds they waited IN_QUEUE in all.
    claimed: int
    wait_s: float


class MetricsRecorder:
    """Writes the counters and histograms the workers and the sweeper own.

    Best effort: every write goes through :meth:`_write`, on a pool of its own
    with short socket waits, and a failure is logged and dropped. A provider's
    answer is never lost because its metrics could not be written.
    """

    def __init__(self, client: redis.Redis):
        self.client = bounded(client, WRITE_TIMEOUT_S)
        #: Writes dropped by this process (Redis unreachable or stalled).
        self.dropped = 0

    def _write(self, what: str, fill: Callable[[redis.client.Pipeline], object]) -> None:
        pipe = self.client.pipeline(transaction=False)
        fill(pipe)
        try:
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - no metrics failure may reach the request
            self.dropped += 1
            log.warning("metrics write %s dropped (%d so far): %s", what, self.dropped, exc)

    def _observe(self, pipe, provider: str, name: str, model: str, seconds: float) -> None:
        key = keys.metrics(provider)
        pipe.hincrby(key, f"{name}_bucket|{model}|{_bucket(seconds)}", 1)
        pipe.hincrbyfloat(key, f"{name}_sum|{model}", max(0.0, seconds))
        pipe.hincrby(key, f"{name}_count|{model}", 1)

    def claimed(self, provider: str, model: str, waited_s: float) -> None:
        self._write("claimed", self._claimed(provider, model, waited_s))

    def _claimed(self, provider: str, model: str, waited_s: float) -> Callable[[redis.client.Pipeline], None]:
        return lambda pipe: self._observe(pipe, provider, "wait", model, waited_s)

    def completed(self, provider: str, model: str, outcome: str, ran_s: float | None = None) -> None:
        """One request completed; ``outcome`` is "success" or its error_type."""
        self._write("completed", self._completed(provider, model, outcome, ran_s))

    def _completed(self, provider: str, model: str, outcome: str,
                   ran_s: float | None) -> Callable[[redis.client.Pipeline], None]:
        window = keys.completions(provider, int(time.time() // COMPLETIONS_WINDOW_S))

        def fill(pipe) -> None:
            pipe.hincrby(keys.metrics(provider), f"completed|{model}|{outcome}", 1)
            pipe.incr(window)
            pipe.expire(window, COMPLETIONS_TTL_S)
            if ran_s is not None:
                self._observe(pipe, provider, "run", model, ran_s)
        return fill

    def delivery(self) -> "DeliveryMetrics":
        """What one delivery records, written in one round trip (see the class)."""
        return DeliveryMetrics(self)

    def totals(self, provider: str) -> "Totals":
        """All of ``provider``'s models together, since the counters began."""
        raw = {k.decode(): float(v) for k, v in self.client.hgetall(keys.metrics(provider)).items()}
        return Totals(
            completed=int(sum(v for k, v in raw.items() if k.startswith("completed|"))),
            claimed=int(sum(v for k, v in raw.items() if k.startswith("wait_count|"))),
            wait_s=sum(v for k, v in raw.items() if k.startswith("wait_sum|")),
        )

    def completed_last_minute(self, provider: str, now: float | None = None) -> int:
        """Completions of ``provider`` in the last minute (the current window
        and the five before it: 50 to 60 s)."""
        current = int((now or time.time()) // COMPLETIONS_WINDOW_S)
        windows = [keys.completions(provider, w) for w in range(current - 60 // COMPLETIONS_WINDOW_S + 1, current + 1)]
        return sum(int(n) for n in self.client.mget(windows) if n is not None)

    def provider_call(self, provider: str, model: str, seconds: float) -> None:
        self._write("provider_call", self._call(provider, model, seconds))

    def _call(self, provider: str, model: str, seconds: float) -> Callable[[redis.client.Pipeline], None]:
        return lambda pipe: self._observe(pipe, provider, "call", model, seconds)

    def retried(self, provider: str, model: str) -> None:
        self._write("retried", self._retried(provider, model))

    def _retried(self, provider: str, model: str) -> Callable[[redis.client.Pipeline], None]:
        return lambda pipe: pipe.hincrby(keys.metrics(provider), f"retries|{model}", 1)

    def webhook_attempt(self, outcome: str, seconds: float) -> None:
        """One webhook attempt: "delivered", "failed", "gone", "refused" (its URL
        resolved to an address we do not call), and its latency."""
        def fill(pipe) -> None:
            key = keys.webhook_metrics()
            pipe.hincrby(key, f"outcome|{outcome}", 1)
            pipe.hincrby(key, f"seconds_bucket|{_bucket(seconds)}", 1)
            pipe.hincrbyfloat(key, "seconds_sum", max(0.0, seconds))
            pipe.hincrby(key, "seconds_count", 1)
        self._write("webhook_attempt", fill)

    def webhook_given_up(self) -> None:
        self._write("webhook_given_up", lambda pipe: pipe.hincrby(keys.webhook_metrics(), "outcome|given_up", 1))

    def swept(self, *, republished: int, reaped: int, timed_out: int, deadline_cancels: int = 0) -> None:
        def fill(pipe) -> None:
            for action, count in (("republished", republished), ("reaped", reaped), ("timed_out", timed_out),
                                  ("deadline_cancels", deadline_cancels)):
                if count:
                    pipe.hincrby(keys.sweeper_metrics(), action, count)
        self._write("swept", fill)


class DeliveryMetrics:
    """One delivery's metrics (claimed, each provider exchange, retries, the
    completion), written together in one pipeline when the delivery ends
    instead of a round trip each: a one-call delivery's metrics cost one round
    trip, not three. A long run (BFL polling) writes what it has every
    :data:`DELIVERY_FLUSH_S`, so /metrics does not wait for its end."""

    def __init__(self, recorder: MetricsRecorder):
        self.recorder = recorder
        self.pending: list[Callable[[redis.client.Pipeline], None]] = []
        self.since = time.monotonic()

    def _add(self, fill: Callable[[redis.client.Pipeline], None]) -> None:
        self.pending.append(fill)
        if time.monotonic() - self.since > DELIVERY_FLUSH_S:
            self.flush()

    def claimed(self, provider: str, model: str, waited_s: float) -> None:
        self._add(self.recorder._claimed(provider, model, waited_s))

    def provider_call(self, provider: str, model: str, seconds: float) -> None:
        self._add(self.recorder._call(provider, model, seconds))

    def retried(self, provider: str, model: str) -> None:
        self._add(self.recorder._retried(provider, model))

    def completed(self, provider: str, model: str, outcome: str, ran_s: float | None = None) -> None:
        self._add(self.recorder._completed(provider, model, outcome, ran_s))

    def flush(self) -> None:
        """Write what is pending, best effort like every metrics write."""
        pending, self.pending, self.since = self.pending, [], time.monotonic()
        if pending:
            self.recorder._write("delivery", lambda pipe: [fill(pipe) for fill in pending])


class RedisCollector(Collector):
    """Reads the fleet's figures from Redis on each scrape."""

    def __init__(self, client: redis.Redis, catalog: Catalog):
        self.client = client
        self.catalog = catalog

    def collect(self) -> Iterable:
        providers = self.catalog.providers()
        pipe = self.client.pipeline(transaction=False)
        for provider in providers:
            pipe.zcard(keys.queue(provider))
            pipe.zcard(keys.running(provider))
            pipe.zrange(keys.queue(provider), 0, 0)
            pipe.hgetall(keys.metrics(provider))
            pipe.zcard(keys.schedule_workspaces(provider))
        pipe.hgetall(keys.sweeper_metrics())
        pipe.smembers(keys.draining())
        now = time.time()
        pipe.zcount(keys.webhooks_due(), "-inf", repr(now))
        pipe.zcount(keys.webhooks_in_flight(), f"({now!r}", "+inf")
        pipe.hgetall(keys.webhook_metrics())
        replies = pipe.execute()
        webhooks = {k.decode(): float(v) for k, v in replies[-1].items()}
        webhooks_due, webhooks_in_flight = replies[-3], replies[-2]
        draining = {d.decode() for d in replies[-4]}
        sweeper = {k.decode(): int(v) for k, v in replies[-5].items()}

        depth = GaugeMetricFamily("router_queue_depth", "Requests waiting IN_QUEUE.", labels=["provider"])
        in_flight = GaugeMetricFamily("router_queue_in_flight",
                                      "Requests holding a provider slot: IN_PROGRESS, "
                                      "or granted one and not yet started.",
                                      labels=["provider"])
        cap = GaugeMetricFamily("router_queue_in_flight_limit", "The provider's cap on requests in flight.",
                                labels=["provider"])
        workspaces = GaugeMetricFamily("router_queue_waiting_workspaces",
                                       "Workspaces with requests waiting for a provider slot.", labels=["provider"])
        oldest = GaugeMetricFamily("router_queue_oldest_wait_seconds", "Age of the longest-waiting request.",
                                   labels=["provider"])
        drain = GaugeMetricFamily("router_queue_draining", "1 while the provider admits nothing new.",
                                  labels=["provider"])
        admitted = CounterMetricFamily("router_queue_admissions", "Requests admitted.", labels=["provider", "model"])
        refused = CounterMetricFamily("router_queue_refusals", "Submits refused at admission.",
                                      labels=["provider", "model", "reason"])
        completed = CounterMetricFamily("router_queue_completions", "Requests completed, by outcome.",
                                        labels=["provider", "model", "outcome"])
        retries = CounterMetricFamily("router_queue_provider_retries", "Provider calls retried.",
                                      labels=["provider", "model"])
        histograms = {name: HistogramMetricFamily(f"router_queue_{name}_seconds", text, labels=["provider", "model"])
                      for name, text in HISTOGRAMS.items()}

        oldest_ids = []
        for index, provider in enumerate(providers):
            queued, running, head, fields, waiting_workspaces = replies[index * 5: index * 5 + 5]
            depth.add_metric([provider], queued)
            workspaces.add_metric([provider], waiting_workspaces)
            in_flight.add_metric([provider], running)
            cap.add_metric([provider], self.catalog.max_in_flight(provider))
            drain.add_metric([provider], 1 if provider in draining else 0)
            oldest_ids.append((provider, head[0].decode() if head else None))
            self._counters(provider, fields, admitted, refused, completed, retries, histograms)
        created = self._created_at([request_id for _, request_id in oldest_ids if request_id])
        for provider, request_id in oldest_ids:
            age = now - created[request_id] if request_id in created else 0.0
            oldest.add_metric([provider], max(0.0, age))
        sweeps = CounterMetricFamily("router_queue_sweeper_actions", "What the sweeper did.", labels=["action"])
        for action in ("republished", "reaped", "timed_out", "deadline_cancels"):
            sweeps.add_metric([action], sweeper.get(action, 0))
        yield from (depth, in_flight, cap, workspaces, oldest, drain, admitted, refused, completed, retries, sweeps)
        yield from histograms.values()
        yield from self._webhooks(webhooks, webhooks_due, webhooks_in_flight)

    @staticmethod
    def _webhooks(fields: dict[str, float], due: int, running: int) -> Iterable:
        deliveries = CounterMetricFamily("router_queue_webhook_deliveries",
                                         "Webhook attempts by outcome (delivered, failed, gone, refused), and "
                                         "events given up (given_up).", labels=["outcome"])
        for outcome in WEBHOOK_OUTCOMES:
            deliveries.add_metric([outcome], fields.get(f"outcome|{outcome}", 0))
        latency = HistogramMetricFamily("router_queue_webhook_delivery_seconds",
                                        "Seconds one webhook attempt took, to the receiver's answer or failure.")
        cumulative, rows = 0, []
        for bound in [repr(b) for b in BUCKETS] + ["+Inf"]:
            cumulative += int(fields.get(f"seconds_bucket|{bound}", 0))
            rows.append((bound, cumulative))
        latency.add_metric([], rows, fields.get("seconds_sum", 0.0))
        # The webhooks Deployment's autoscaler reads these two (deploy/k8s).
        due_now = GaugeMetricFamily("router_queue_webhooks_due",
                                    "Webhook events due now and not yet published to router.webhooks.")
        due_now.add_metric([], due)
        in_flight = GaugeMetricFamily("router_queue_webhook_attempts_in_flight",
                                      "Webhook attempts running now (each holds a thread of the webhooks worker).")
        in_flight.add_metric([], running)
        yield deliveries
        yield latency
        yield due_now
        yield in_flight

    def _created_at(self, request_ids: list[str]) -> dict[str, float]:
        if not request_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hget(keys.request(request_id), "created_at")
        return {rid: float(value) for rid, value in zip(request_ids, pipe.execute()) if value}

    @staticmethod
    def _counters(provider, fields, admitted, refused, completed, retries, histograms) -> None:
        buckets: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
        sums: dict[tuple[str, str], float] = defaultdict(float)
        for raw_name, raw_value in fields.items():
            kind, *labels = raw_name.decode().split("|")
            value = float(raw_value)
            if kind == "admitted":
                admitted.add_metric([provider, labels[0]], value)
            elif kind == "refused":
                refused.add_metric([provider, labels[0], labels[1].lower()], value)
            elif kind == "completed":
                completed.add_metric([provider, labels[0], labels[1]], value)
            elif kind == "retries":
                retries.add_metric([provider, labels[0]], value)
            elif kind.endswith("_bucket"):
                buckets[(kind[:-7], labels[0])][labels[1]] = int(value)
            elif kind.endswith("_sum"):
                sums[(kind[:-4], labels[0])] = value
        for (name, model), counts in buckets.items():
            cumulative, rows = 0, []
            for bound in [repr(b) for b in BUCKETS] + ["+Inf"]:
                cumulative += counts.get(bound, 0)
                rows.append((bound, cumulative))
            histograms[name].add_metric([provider, model], rows, sums[(name, model)])
