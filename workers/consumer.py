"""The worker's Celery consumer: Celery's own, with one kombu race guarded so a
store fault never ends the worker process, and a heartbeat of its own.

The race: on a lost broker connection Celery's consumer ``collect()``s the
connection, which detaches its kombu transport's client, and a task channel
whose close the dead socket cut short then reads that client
(``AttributeError: 'NoneType' object has no attribute 'hostname'``): an
"Unrecoverable error" that exits the worker (celery 5.7.0, kombu 5.7.0). The
guard gives the transport its client back as soon as ``collect()`` took it.
The heartbeat (:class:`Heartbeat`) is a timer on the consumer's own event
loop. The whole story: ``docs/ARCHITECTURE.md``, "The broker and the workers".
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import redis
from celery import bootsteps
from celery.worker.consumer import Consumer as CeleryConsumer

from router_queue.store.connect import bounded
from router_queue.store.fleet import Fleet

from .context import context_for

logger = logging.getLogger(__name__)


#: Longest wait between two of the consumer's attempts to reach a broker that
#: went away, in seconds. kombu's default backs off to 30 s, so a worker could
#: resume up to 30 s after the broker's return (issue 23 asks for 10 s); an
#: attempt is one connect, cheap enough every 2 s for the length of an outage.
RECONNECT_EVERY_S = 2.0
#: Seconds a heartbeat waits on Redis: it is written from the consumer's event loop.
HEARTBEAT_WAIT_S = 1.0


class Consumer(CeleryConsumer):
    """Celery's consumer, whose lost connection keeps its transport's client,
    and which tries a lost broker again at least every ``RECONNECT_EVERY_S``."""

    def ensure_connected(self, conn: Any) -> Any:
        conn.ensure_connection = functools.partial(conn.ensure_connection, interval_start=RECONNECT_EVERY_S / 4,
                                                   interval_step=RECONNECT_EVERY_S / 4,
                                                   interval_max=RECONNECT_EVERY_S)
        return super().ensure_connected(conn)

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        connection = self.connection
        if connection is not None and connection._transport is not None:  # not .transport: that makes one
            connection.collect = _keeping_the_client(connection)
        super().on_connection_error_after_connected(exc)


def _keeping_the_client(connection: Any) -> Any:
    """``connection.collect``, after which its transport has its client back."""
    collect, transport = connection.collect, connection._transport

    def collect_keeping_the_client(*args: Any, **kwargs: Any) -> None:
        try:
            collect(*args, **kwargs)
        finally:
            transport.client = connection

    return collect_keeping_the_client


class Heartbeat(bootsteps.StartStopStep):
    """Writes this worker's heartbeat every ``Fleet.heartbeat_s`` while it consumes."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: CeleryConsumer, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.started_at = time.time()
        self.timer_entry: Any = None
        self.fleet: Fleet | None = None

    def start(self, parent: CeleryConsumer) -> None:
        if self.fleet is None:  # made once; start runs again at every reconnect
            services = context_for(parent.app).services
            # a client of its own with a short wait: a stalled store holds the loop a second at most
            self.fleet = Fleet(bounded(services.redis, HEARTBEAT_WAIT_S), services.fleet.heartbeat_s)
        fleet = self.fleet
        queues = tuple(sorted(parent.app.amqp.queues.consume_from or {}))

        def beat() -> None:
            try:
                fleet.beat(parent.hostname, queues, os.getpid(), self.started_at)
            except redis.RedisError as exc:  # the next one tries again; a heartbeat never ends the loop
                logger.warning("worker heartbeat not written: %s", exc)

        beat()
        self.timer_entry = parent.timer.call_repeatedly(fleet.heartbeat_s, beat)

    def stop(self, parent: CeleryConsumer) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None

    shutdown = stop
