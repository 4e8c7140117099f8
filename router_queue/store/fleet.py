"""Which workers are consuming, from their heartbeats.

Each worker's consumer writes a heartbeat here from its own event loop
(``workers/consumer.py``), so a worker that is dead, stopped or stuck in its
loop stops beating; the operations page, ``ops depths`` and the
``router_queue_workers_alive`` gauge count the ones heard from lately. Keys:
``keys.fleet`` (names by last heartbeat) and ``keys.fleet_worker`` (what one
consumes, expiring once it is long gone): ``docs/KEYS.md``. Each heartbeat is
one pipeline of single-key commands, so it runs on a Redis Cluster as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import keys

#: Seconds between two heartbeats of a worker (``WORKER_HEARTBEAT_SECONDS``).
HEARTBEAT_S = 10.0
#: Heartbeats a worker may miss before it is counted dead: a loaded machine
#: may delay one, never three.
MISSED_BEATS = 3
#: Seconds a silent worker stays listed (as dead) before it is forgotten.
FORGET_AFTER_S = 3600


@dataclass(frozen=True)
class WorkerSeen:
    name: str
    #: The queues it consumes (``provider.bfl``, ``router.webhooks``, ...).
    queues: tuple[str, ...]
    pid: int
    started_at: float
    beat_at: float

    def alive(self, now: float, heartbeat_s: float = HEARTBEAT_S) -> bool:
        return now - self.beat_at <= heartbeat_s * MISSED_BEATS


class Fleet:
    def __init__(self, client: redis.Redis, heartbeat_s: float = HEARTBEAT_S):
        self.client = client
        self.heartbeat_s = heartbeat_s

    def beat(self, name: str, queues: tuple[str, ...], pid: int, started_at: float,
             now: float | None = None) -> None:
        """One heartbeat of worker ``name``; forgets the workers silent for an hour."""
        now = time.time() if now is None else now
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.fleet_worker(name), mapping={"queues": ",".join(queues), "pid": pid,
                                                    "started_at": repr(started_at), "beat_at": repr(now)})
        pipe.expire(keys.fleet_worker(name), FORGET_AFTER_S)
        pipe.zadd(keys.fleet(), {name: now})
        pipe.zremrangebyscore(keys.fleet(), "-inf", now - FORGET_AFTER_S)
        pipe.execute()

    def workers(self) -> list[WorkerSeen]:
        """Every worker heard from in the last hour, most recently heard first."""
        names = [n.decode() for n in self.client.zrevrange(keys.fleet(), 0, -1)]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.fleet_worker(name))
        seen = []
        for name, fields in zip(names, pipe.execute()):
            if not fields:
                continue  # forgotten between the two reads
            values = {k.decode(): v.decode() for k, v in fields.items()}
            seen.append(WorkerSeen(name=name, queues=tuple(q for q in values["queues"].split(",") if q),
                                   pid=int(values["pid"]), started_at=float(values["started_at"]),
                                   beat_at=float(values["beat_at"])))
        return seen

    def alive_per_queue(self, queues: list[str], workers: list[WorkerSeen] | None = None,
                        now: float | None = None) -> dict[str, int]:
        """How many live workers consume each of ``queues``, among ``workers``
        (as :meth:`workers` read them; read here when not given)."""
        now = time.time() if now is None else now
        alive = [w for w in (self.workers() if workers is None else workers) if w.alive(now, self.heartbeat_s)]
        return {queue: sum(1 for w in alive if queue in w.queues) for queue in queues}


class FleetCollector(Collector):
    """``router_queue_workers_alive{queue}``, read from the heartbeats on each
    scrape: the alert for a queue nothing consumes (docs/OPERATIONS.md, "Which workers are alive")."""

    def __init__(self, fleet: Fleet, queues: list[str]):
        self.fleet = fleet
        self.queues = queues

    def collect(self) -> Iterable:
        gauge = GaugeMetricFamily("router_queue_workers_alive",
                                  "Workers consuming the queue whose heartbeat was heard lately.", labels=["queue"])
        for queue, alive in self.fleet.alive_per_queue(self.queues).items():
            gauge.add_metric([queue], alive)
        yield gauge
