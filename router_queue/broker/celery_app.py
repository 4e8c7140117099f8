"""The Celery factory. ``workers/main.py`` (the worker and beat entry point) and
the front door's dispatcher both build their app here, from one ``Settings``.

Delivery semantics, chosen deliberately: ``task_acks_late`` with
``task_reject_on_worker_lost`` (a request may be delivered twice; the claim's
lease runs it once at a time), ``worker_prefetch_multiplier = 1``, a
``visibility_timeout`` far above the longest generation in every transport
options dict, no Celery results and no Celery time limits (the model's call
policy and the lease heartbeat bound a delivery). Why each, with the upstream
issues: ``docs/ARCHITECTURE.md``, "The broker and the workers".
"""

from __future__ import annotations

from celery import Celery

from ..settings import Settings
from ..store.connect import BROKER_WAIT_S, celery_broker

#: Registered name of the delivery task; the front door publishes by name so
#: it never imports the provider adapters.
DELIVER_TASK = "workers.tasks.deliver"
SWEEP_TASK = "workers.tasks.sweep"
#: One step of a bulk action (``workers/bulk.py``), on the maintenance queue.
BULK_TASK = "workers.tasks.bulk_step"
#: Queue for housekeeping (the sweeper), consumed by any worker.
MAINTENANCE_QUEUE = "router.maintenance"
#: Webhook deliveries: a queue of their own, consumed only by the webhooks
#: worker (the Procfile's ``webhooks``), so a slow receiver never holds a
#: provider's thread or queue. Each message carries a request id whose event
#: (``rq:webhook:{id}``) is the truth; the message is only a nudge, and beat's
#: sweeper publishes again every event due whose message was lost.
WEBHOOK_TASK = "workers.tasks.deliver_webhook"
WEBHOOKS_QUEUE = "router.webhooks"
#: A batch's batch.completed webhook (``batches/finish.py``): on the same queue and worker.
BATCH_WEBHOOK_TASK = "workers.tasks.deliver_batch_webhook"
#: A budget threshold's budget.threshold_crossed alert (``webhooks/budget_alerts.py``): the same queue and worker.
BUDGET_ALERT_TASK = "workers.tasks.deliver_budget_alert"
#: A batch's drain (``batches/drain.py``): on the maintenance queue, which
#: every worker deployment consumes, so a batch needs no worker of its own;
#: each message names a batch whose state is in Redis, and the sweeper
#: publishes it again while the batch has lines left.
DRAIN_BATCH_TASK = "workers.tasks.drain_batch"


def queue_name(provider: str) -> str:
    """The Celery queue a provider's requests are published to."""
    return f"provider.{provider}"


def make_celery(settings: Settings, *, include: tuple[str, ...] = (), broker_wait_s: float = BROKER_WAIT_S) -> Celery:
    """``broker_wait_s``: how long a Redis broker's sockets wait (the front door
    passes its own Redis wait, so a hung broker costs a submit little more)."""
    broker_url, broker_options = celery_broker(settings.effective_broker_url, broker_wait_s)
    app = Celery("router_queue", broker=broker_url, include=list(include))
    transport_options = {"visibility_timeout": settings.visibility_timeout_s, **broker_options}
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=MAINTENANCE_QUEUE,
        broker_transport_options=transport_options,
        result_backend_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        # A publish tries twice, not Celery's four times: a failed grant
        # publish is made due and the next sweep publishes it (dispatch.py),
        # so retrying longer only holds the submit or completion that granted it.
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2,
                                   "interval_max": 0.2},
        # Set explicitly (Celery 6 flips the default). On a lost broker
        # connection a running task keeps running and writes its outcome to
        # Redis itself; the message it can no longer ack is redelivered, and
        # its new execution finds the lease alive (each execution has its own
        # token), so nothing runs twice and nothing is cut.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # After a broker reconnect Celery lowers the prefetch count and raises
        # it again from each ack, in the pool threads; on py-amqp that put 27
        # threads and the consumer on one socket, corrupted its frames and
        # left a worker consuming nothing for 183 s after RabbitMQ came back
        # (issue 23). With a prefetch of one per thread there is nothing to lower.
        worker_enable_prefetch_count_reduction=False,
        # A channel error ends the consumer's connection, not the worker: a
        # Redis broker at maxmemory refuses the unacked-index write of the
        # message just popped (OutOfMemoryError, a ResponseError), which
        # otherwise is "Unrecoverable" and exits the worker. The popped grant
        # never reached a task, and the sweeper publishes it again.
        broker_channel_error_retry=True,
        # Celery's consumer, with the kombu race that exited the worker on a
        # lost Redis broker guarded (workers/consumer.py). A string, so the
        # front door, which builds this app too, never imports the workers.
        worker_consumer="workers.consumer:Consumer",
        worker_hijack_root_logger=False,
        beat_schedule={
            "sweep": {
                "task": SWEEP_TASK,
                "schedule": settings.sweep_interval_s,
                "options": {"queue": MAINTENANCE_QUEUE, "expires": settings.sweep_interval_s * 3},
            },
        },
    )
    app.router_settings = settings
    return app
