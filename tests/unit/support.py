"""Small helpers the unit tests share."""

from __future__ import annotations


def record_of(services, request_id: str, provider: str):
    """The request's record as a worker would hold it."""
    record = services.store.status_view(request_id, provider).record
    assert record is not None, f"no record for {request_id}"
    return record


def deliver_webhook(context, request_id: str) -> str:
    """One webhook attempt as the ``deliver_webhook`` task makes it, from a worker's context."""
    from router_queue.webhooks import delivery

    return delivery.deliver(context.services, context.dispatcher, request_id)
