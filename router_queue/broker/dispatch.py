"""Publishing granted requests to their provider's Celery queue.

A waiting request has no message; one is published when the schedule grants
it a slot, carrying only the request id. With the store's own Redis as the
broker (the default), the granting script pushes Celery's own message (a
template built once per provider by ``send_task``, its body UTF-8 so Lua can
fill it in) in the same atomic step. With any other broker the script returns
the ids it granted and ``send_task`` publishes them after (a failed publish:
``grant_unsent.lua``; a crash: the reaper). Either way the worker's atomic
claim runs it once. ``docs/ARCHITECTURE.md``, "The broker and the workers".
"""

from __future__ import annotations

import base64
import json

from celery import Celery

from ..store.requests_base import BrokerTemplate, GrantPublishing
from .celery_app import (
    BATCH_WEBHOOK_TASK,
    BUDGET_ALERT_TASK,
    DELIVER_TASK,
    DRAIN_BATCH_TASK,
    MAINTENANCE_QUEUE,
    WEBHOOK_TASK,
    WEBHOOKS_QUEUE,
    queue_name,
)

#: Stand-ins for the per-grant values, as lib/schedule.lua's grant() replaces them
#: (plain letters: they are Lua patterns too).
REQUEST_STANDIN = "RQTPLREQ"
TASK_STANDIN = "RQTPLTASK"
TAG_STANDIN = "RQTPLTAG"


def broker_template(celery: Celery, queue: str, list_key: str) -> BrokerTemplate:
    """One provider's deliver message as Celery builds it, with stand-ins."""
    with celery.connection_for_write("memory://") as connection:
        celery.send_task(DELIVER_TASK, args=[REQUEST_STANDIN], task_id=TASK_STANDIN, queue=queue,
                         connection=connection)
        message = connection.default_channel._get(queue)
    message["properties"]["delivery_tag"] = TAG_STANDIN
    message["properties"]["body_encoding"] = "utf-8"
    message["body"] = base64.b64decode(message["body"]).decode()
    return BrokerTemplate(list_key, json.dumps(message))


class Dispatcher:
    def __init__(self, celery: Celery, *, providers: tuple[str, ...] = (), broker_is_store: bool = False):
        """``broker_is_store`` (the broker is the store's Redis): the scripts
        get ``providers``' message templates; otherwise what they grant is
        published here. The store takes :attr:`grants` as ``Services`` builds it."""
        self.celery = celery
        self.broker_is_store = broker_is_store
        #: Handed to the request store: how its scripts' grants are published.
        self.grants = GrantPublishing(publish=self.publish_granted)
        if broker_is_store:
            # kombu's Redis transport keeps a queue's priority-0 messages in a
            # list named after the queue, behind its optional global key prefix
            prefix = (celery.conf.broker_transport_options or {}).get("global_keyprefix", "")
            for provider in providers:
                queue = queue_name(provider)
                self.grants.templates[provider] = broker_template(celery, queue, prefix + queue)

    def publish(self, request_id: str, provider: str) -> None:
        """Publish one request's delivery (a takeover, a hand-back, an operator's requeue)."""
        self.celery.send_task(DELIVER_TASK, args=[request_id], queue=queue_name(provider))

    def publish_webhook(self, request_id: str) -> None:
        """Nudge a webhook worker to attempt the request's event now."""
        self.celery.send_task(WEBHOOK_TASK, args=[request_id], queue=WEBHOOKS_QUEUE)

    def publish_batch_webhook(self, workspace: str, batch_id: str) -> None:
        """Nudge a webhook worker to attempt the batch's batch.completed webhook."""
        self.celery.send_task(BATCH_WEBHOOK_TASK, args=[workspace, batch_id], queue=WEBHOOKS_QUEUE)

    def publish_budget_alert(self, workspace: str, crossing: str) -> None:
        """Nudge a webhook worker to attempt a budget crossing's alert (``Crossing.ident``)."""
        self.celery.send_task(BUDGET_ALERT_TASK, args=[workspace, crossing], queue=WEBHOOKS_QUEUE)

    def publish_batch(self, workspace: str, batch_id: str) -> None:
        """Run (or resume) a batch's drain."""
        self.celery.send_task(DRAIN_BATCH_TASK, args=[workspace, batch_id], queue=MAINTENANCE_QUEUE)

    def publish_granted(self, provider: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.publish(request_id, provider)
