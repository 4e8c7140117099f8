"""The queue's own state as Prometheus gauges, read from Redis at scrape time.

Depth, in flight, the oldest wait, the waiting workspaces, draining and the
webhook backlog are read off the very indexes the queue runs on, so they are
the fleet's whichever process is scraped, and cost Redis one pipelined read a
scrape, nothing per delivery. Counters and histograms are not here: each
process keeps its own (``router_queue/metrics.py``).
"""

from __future__ import annotations

import time
from typing import Iterable

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..catalog import Catalog
from . import keys
from .members import read_states


class QueueGauges(Collector):
    """Reads the queue's state from Redis on each scrape."""

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
            pipe.zcard(keys.schedule_workspaces(provider))
            pipe.zcard(keys.owed(provider))
            pipe.zcard(keys.admitting(provider))
            pipe.hexists(keys.schedule(provider), "draining")
        now = time.time()
        due_sets = [keys.webhooks_due(provider) for provider in providers]
        for due_set in due_sets:
            pipe.zcount(due_set, "-inf", repr(now))
        pipe.zcount(keys.webhooks_in_flight(), f"({now!r}", "+inf")
        replies = pipe.execute()
        webhooks_due, webhooks_in_flight = sum(replies[-1 - len(due_sets):-1]), replies[-1]

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
        # A cluster's steps split per slot (store/owed.py, store/admission.py): what waits between them.
        owed = GaugeMetricFamily("router_queue_workspace_effects_owed",
                                 "Effects of requests' starts and ends not yet given to their workspace "
                                 "(a cluster's; the sweeper gives those left 5 s).", labels=["provider"])
        pending = GaugeMetricFamily("router_queue_admissions_pending",
                                    "Admissions between their workspace's step and their provider's "
                                    "(a cluster's; the sweeper undoes those left past their deadline).",
                                    labels=["provider"])
        oldest_ids = []
        for index, provider in enumerate(providers):
            queued, running, head, waiting_workspaces, effects, admitting, draining = \
                replies[index * 7: index * 7 + 7]
            owed.add_metric([provider], effects)
            pending.add_metric([provider], admitting)
            depth.add_metric([provider], queued)
            workspaces.add_metric([provider], waiting_workspaces)
            in_flight.add_metric([provider], running)
            cap.add_metric([provider], self.catalog.max_in_flight(provider))
            drain.add_metric([provider], 1 if draining else 0)
            oldest_ids.append((provider, head[0].decode() if head else None))
        created = self._created_at([request_id for _, request_id in oldest_ids if request_id])
        for provider, request_id in oldest_ids:
            age = now - created[request_id] if request_id in created else 0.0
            oldest.add_metric([provider], max(0.0, age))
        # The webhooks Deployment's autoscaler reads these two (deploy/k8s).
        due_now = GaugeMetricFamily("router_queue_webhooks_due",
                                    "Webhook events due now and not yet published to router.webhooks.")
        due_now.add_metric([], webhooks_due)
        attempts = GaugeMetricFamily("router_queue_webhook_attempts_in_flight",
                                     "Webhook attempts running now (each holds a thread of the webhooks worker).")
        attempts.add_metric([], webhooks_in_flight)
        yield from (depth, in_flight, cap, workspaces, oldest, drain, due_now, attempts, owed, pending)
        yield from self._members(providers, now)

    def _members(self, providers: list[str], now: float) -> Iterable:
        """Each pool member's slots in use, learned cap and whether it is paused or out (``members.py``)."""
        labels = ["provider", "member"]
        used = GaugeMetricFamily("router_queue_pool_member_in_flight", "Generations holding a slot on a provider "
                                 "pool's member.", labels=labels)
        learned = GaugeMetricFamily("router_queue_pool_member_cap", "A pool member's cap as learned from its 429s "
                                    "(its catalog cap when it has had none lately).", labels=labels)
        paused = GaugeMetricFamily("router_queue_pool_member_paused", "1 while a pool member is paused by a 429 or "
                                   "out for a refused key.", labels=labels)
        for provider in providers:
            for state in read_states(self.client, provider, self.catalog.members(provider)):
                names = [provider, state.member]
                used.add_metric(names, state.in_flight)
                learned.add_metric(names, state.learned_cap)
                paused.add_metric(names, 1 if max(state.paused_until, state.revoked_until) > now else 0)
        yield from (used, learned, paused)

    def _created_at(self, request_ids: list[str]) -> dict[str, float]:
        if not request_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hget(keys.request(request_id), "created_at")
        return {rid: float(value) for rid, value in zip(request_ids, pipe.execute()) if value}
