"""Celery tasks. Thin: each takes a request id (or nothing) and calls a plain
function. Delivery semantics are spelled out on each task.
"""

from __future__ import annotations

from celery import shared_task

from .celery_app import DELIVER_TASK, SWEEP_TASK
from .context import context_for
from .delivery import deliver as deliver_request
from .delivery import republish_unpublished


@shared_task(
    bind=True,
    name=DELIVER_TASK,
    # Ack after the run; a killed child's message goes back to the queue and
    # the claim makes the redelivery harmless. See workers/celery_app.py.
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    # No Celery-level retries: the task records every outcome itself.
    max_retries=0,
)
def deliver(self, request_id: str) -> str:
    context = context_for(self.app)
    return deliver_request(context.services, context.session, request_id)


@shared_task(bind=True, name=SWEEP_TASK, acks_late=True, ignore_result=True, max_retries=0)
def sweep_unpublished(self) -> int:
    context = context_for(self.app)
    return republish_unpublished(context.services, context.dispatcher)
