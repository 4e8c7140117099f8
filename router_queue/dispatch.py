"""Publishing admitted requests to their provider's Celery queue.

The message carries only the request id: the worker reads everything else
from the request's record, which is always written before the publish.
"""

from __future__ import annotations

from celery import Celery

from workers.celery_app import DELIVER_TASK, queue_name

from .store import RequestStore


class Dispatcher:
    def __init__(self, celery: Celery, store: RequestStore):
        self.celery = celery
        self.store = store

    def publish(self, request_id: str, provider: str) -> None:
        """Publish, then forget the request awaits publishing.

        A crash between the two leaves it in ``rq:due``; the sweeper
        publishes it again, and the worker's atomic claim runs it once.
        """
        self.celery.send_task(DELIVER_TASK, args=[request_id], queue=queue_name(provider))
        self.store.mark_published(request_id)
