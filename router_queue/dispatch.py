"""Publishing admitted requests to their provider's Celery queue.

The message carries only the request id: the worker reads everything else
from the request's record, which is always written before the publish.

Two ways to publish, chosen by where the broker is:

* The broker is the store's own Redis (``CELERY_BROKER_URL`` unset, the
  default): the admission script pushes the Celery message onto the queue's
  list in the same atomic step that writes the record, so nothing can fall
  between the admit and the publish, and a submit costs one Redis round trip.
  The message is the one Celery itself builds for the task: made once per
  provider by ``send_task`` through kombu's in-memory transport (the same
  virtual-transport envelope the Redis transport pushes), then filled in per
  request (task id, request id, delivery tag).
* Any other broker (RabbitMQ, another Redis): ``send_task`` after the admit;
  the admit leaves the request in ``rq:due`` first, so a crash between the two
  is repaired by the sweeper, and the worker's atomic claim runs it once.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass

from celery import Celery

from workers.celery_app import DELIVER_TASK, queue_name

from .store import RequestStore

#: Stand-ins for the per-request values while Celery builds a template.
_REQUEST = "rq-template-request-id"
_TASK = "rq-template-task-id"
_TAG = "rq-template-delivery-tag"


@dataclass(frozen=True)
class BrokerMessage:
    """A Celery message ready for ``LPUSH``: the list kombu's Redis transport
    consumes for the queue, and the message as kombu serialises it."""

    list_key: str
    payload: str


class _Template:
    """One provider's deliver message as Celery builds it, with stand-ins, and
    the list it goes onto."""

    def __init__(self, celery: Celery, queue: str, list_key: str):
        with celery.connection_for_write("memory://") as connection:
            celery.send_task(DELIVER_TASK, args=[_REQUEST], task_id=_TASK, queue=queue, connection=connection)
            message = connection.default_channel._get(queue)
        message["properties"]["delivery_tag"] = _TAG
        self.list_key = list_key
        self.body = base64.b64decode(message["body"]).decode()
        self.body_b64 = message["body"]
        self.text = json.dumps(message)

    def message(self, request_id: str) -> BrokerMessage:
        body = base64.b64encode(self.body.replace(_REQUEST, request_id).encode()).decode()
        payload = (self.text.replace(self.body_b64, body).replace(_REQUEST, request_id)
                   .replace(_TASK, str(uuid.uuid4())).replace(_TAG, str(uuid.uuid4())))
        return BrokerMessage(self.list_key, payload)


class Dispatcher:
    def __init__(self, celery: Celery, store: RequestStore, *, providers: tuple[str, ...] = (),
                 broker_is_store: bool = False):
        """``broker_is_store``: the broker is the store's Redis, so ``providers``'
        messages are pushed by the admission script (see the module docstring)."""
        self.celery = celery
        self.store = store
        self._templates: dict[str, _Template] = {}
        if broker_is_store:
            # kombu's Redis transport keeps a queue's priority-0 messages in a
            # list named after the queue, behind its optional global key prefix
            prefix = (celery.conf.broker_transport_options or {}).get("global_keyprefix", "")
            for provider in providers:
                queue = queue_name(provider)
                self._templates[provider] = _Template(celery, queue, prefix + queue)

    def message_for_admit(self, request_id: str, provider: str) -> BrokerMessage | None:
        """The message the admission script should push with the record, or
        None when this provider's requests are published after the admit."""
        template = self._templates.get(provider)
        return template.message(request_id) if template is not None else None

    def publish(self, request_id: str, provider: str) -> None:
        """Publish, then forget the request awaits publishing.

        A crash between the two leaves it in ``rq:due``; the sweeper
        publishes it again, and the worker's atomic claim runs it once.
        """
        self.celery.send_task(DELIVER_TASK, args=[request_id], queue=queue_name(provider))
        self.store.mark_published(request_id)
