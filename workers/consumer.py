"""The worker's Celery consumer: Celery's own, with one kombu race guarded so a
store fault never ends the worker process, and a heartbeat of its own.

When the broker connection drops (Redis killed, or a Sentinel primary killed
and its replica promoted), Celery's consumer first ``collect()``s the broken
connection, which detaches its kombu transport (``transport.client = None``),
and then ``close()``s it. If the task channel's first close was cut short by
the dead socket (its pending ``BRPOP`` read raises before the channel is
marked closed), the second close runs the channel's ``restore_unacked`` again,
and the Redis transport's ``_connparams`` reads ``self.connection.client``:
``AttributeError: 'NoneType' object has no attribute 'hostname'``. Celery
wraps that close in ``ignore_errors``, which ignores only connection and
channel errors, so the AttributeError becomes "Unrecoverable error" and the
worker exits (celery 5.7.0, kombu 5.7.0), losing every delivery in flight on
it and, under honcho or foreman, never coming back.

Nothing is lost by carrying on: the messages that close would have restored
stay in the Redis transport's unacked index (restored after the visibility
timeout), the deliveries running on this worker keep running and write their
outcome to Redis themselves, and the sweeper republishes any grant whose work
never started. So the guard logs the failed close and lets Celery's reconnect
cycle go on.

The heartbeat (:class:`Heartbeat`, ``router_queue/store/fleet.py``) is a
timer on the consumer's own event loop, started once the consumer consumes:
a worker that is dead, stopped, disconnected or stuck in that loop stops
beating, which a thread of its own would not.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import redis
from celery import bootsteps
from celery.worker.consumer import Consumer as CeleryConsumer

from .context import context_for

logger = logging.getLogger(__name__)


class Consumer(CeleryConsumer):
    """Celery's consumer, whose reconnect survives a close of a detached transport."""

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        connection = self.connection
        if connection is not None:
            connection.close = _forgiving_close(connection.close)
        super().on_connection_error_after_connected(exc)


def _forgiving_close(close: Any) -> Any:
    """``close``, with the AttributeError of a transport already detached by
    ``collect()`` logged instead of raised."""

    def close_after_collect() -> None:
        try:
            close()
        except AttributeError as error:
            logger.warning("closing the lost broker connection failed after its transport was released (%r); "
                           "its unacked messages stay in the broker and the sweeper covers their requests", error)

    return close_after_collect


class Heartbeat(bootsteps.StartStopStep):
    """Writes this worker's heartbeat every ``Fleet.heartbeat_s`` while it consumes."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: CeleryConsumer, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.started_at = time.time()
        self.timer_entry: Any = None

    def start(self, parent: CeleryConsumer) -> None:
        fleet = context_for(parent.app).services.fleet
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
