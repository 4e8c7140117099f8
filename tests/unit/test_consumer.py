"""The worker's consumer outlives the kombu race that ended the worker when
Redis, the broker, went away with tasks in flight (``workers/consumer.py``).

The race, on a private redis-server: a task delivered and unacked on the task
channel, that channel waiting in a BRPOP, a control channel with a fanout
binding beside it (the worker's pidbox), and Redis SIGKILLed."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest
from celery import Celery
from celery.concurrency.thread import TaskPool
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu import Connection, Exchange, Queue

from tests.redis_servers import PrivateRedis
from workers.consumer import Consumer


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, persist=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _consumer_losing_its_broker(cls: type[CeleryConsumer], broker: PrivateRedis) -> CeleryConsumer:
    """A consumer of ``cls`` whose connection is in the state a worker's is
    when Redis is killed mid-poll: its broker is already gone."""
    connection = Connection(broker.url)
    tasks = Queue("provider.bfl")
    with connection.Producer() as producer:
        producer.publish({"request_id": "r-1"}, routing_key=tasks.name, declare=[tasks])
    delivered: list[object] = []
    connection.Consumer(tasks, callbacks=[lambda body, message: delivered.append(message)]).consume()
    connection.drain_events(timeout=5)
    with pytest.raises(socket.timeout):
        connection.drain_events(timeout=0.2)  # the next BRPOP is out, as the worker's always is
    control = connection.channel()
    broadcast = Queue("celery.pidbox", Exchange("celery.pidbox", type="fanout"), auto_delete=True)
    connection.Consumer(broadcast, channel=control, callbacks=[lambda body, message: None]).consume()
    assert len(delivered) == 1 and connection.default_channel._in_poll

    app = Celery("consumer-race", broker=broker.url, set_as_current=False)
    app.conf.update(worker_cancel_long_running_tasks_on_connection_loss=False,
                    worker_enable_prefetch_count_reduction=False)
    consumer = cls(on_task_request=lambda *args: None, app=app, hub=None, pool=TaskPool(1), timer=None,
                   controller=SimpleNamespace(use_eventloop=False))  # the one flag it reads of the worker
    consumer.connection = connection
    broker.kill()
    return consumer


def test_celerys_own_consumer_raises_out_of_its_reconnect(broker: PrivateRedis) -> None:
    """The race itself, on the pinned celery and kombu: the error that made the worker exit."""
    consumer = _consumer_losing_its_broker(CeleryConsumer, broker)
    with pytest.raises(AttributeError, match="hostname"):
        consumer.on_connection_error_after_connected(ConnectionError("Connection closed by server."))


# Celery warns on every reconnect that its default for cancelling running tasks changes in 6.0
# (celery_app.py sets it explicitly); here that warning is not the subject.
@pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning")
def test_the_workers_consumer_reconnects_past_it_and_still_acks(broker: PrivateRedis) -> None:
    consumer = _consumer_losing_its_broker(Consumer, broker)
    delivered = consumer.connection.default_channel.qos._delivered
    message = next(iter(delivered.values()))  # a task still running when the broker went
    consumer.on_connection_error_after_connected(ConnectionError("Connection closed by server."))
    assert consumer.connection is None  # released: Celery's reconnect cycle starts afresh from here
    # Its ack, from the event loop once the task returns: while the broker is down a
    # connection error, which Celery logs (``ack_log_error``) and rides out ...
    with pytest.raises(consumer.connection_errors):
        message.ack()
    broker.start()
    message.ack()  # ... and once it is back, the ack reaches it
