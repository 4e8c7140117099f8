"""A store as an earlier version left it, made from today's by rewriting its
keys back into the shapes that version wrote (the shapes
``router_queue/store/migrate_data.py`` rewrites): shared by the unit tests
(fakeredis) and the integration tests (a real Redis, one or a cluster)."""

from __future__ import annotations

from router_queue.store import keys

#: The keys an earlier version wrote, named as it named them.
OLD_DRAINING = "{rq}:draining"
OLD_WEBHOOKS_DUE = "{rq}:webhooks:due"
#: The layout marker's value before this one.
OLD_LAYOUT = "2"


def mark_earlier_layout(client) -> None:
    """The marker an earlier version wrote with its first workspace."""
    client.set(keys.layout(), OLD_LAYOUT)


def drain_as_before(client, provider: str) -> None:
    """A provider drained in the one shared set an earlier version kept."""
    client.sadd(OLD_DRAINING, provider)


def forget_cost(client, request_id: str) -> None:
    """The record of a request completed before costs were kept: its
    ``charged`` (when charged) and a zero hold, no ``price`` nor ``cost_state``."""
    client.hdel(keys.request(request_id), "price", "cost_state")


def owe_event_as_before(client, request_id: str, provider: str) -> None:
    """The request's pending event as an earlier version owed it: in the
    shared due set (at the same time), naming neither its provider nor its cost."""
    due_at = client.zscore(keys.webhooks_due(provider, request_id), request_id)
    assert due_at is not None, "the request owes no event"
    client.zrem(keys.webhooks_due(provider, request_id), request_id)
    client.zadd(OLD_WEBHOOKS_DUE, {request_id: due_at})
    client.hdel(keys.webhook_event(request_id), "provider", "cost_credits", "cost_state")
