"""A store as an earlier version left it, made from today's by rewriting its
keys back into the shapes that version wrote (the shapes
``router_queue/store/migrate_data.py`` rewrites): shared by the unit tests
(fakeredis) and the integration tests (a real Redis, one or a cluster)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from router_queue.store import keys
from router_queue.store.ids import uuid_text

#: The keys an earlier version wrote, named as it named them.
OLD_DRAINING = "{rq}:draining"
OLD_WEBHOOKS_DUE = "{rq}:webhooks:due"
#: The layout marker's value before this one.
OLD_LAYOUT = "2"
#: The tag every key of a request minted before ids carried their provider's
#: code (version 8) kept, and its events' due sets.
ONE_TAG = "{rq}"


def version_8_id(client, workspace: str, model: str) -> str:
    """An id as an earlier version minted it for ``workspace`` and ``model``
    (version 8): 64 random bits less the version, a 62-bit HMAC of them, the
    workspace and the model, and no provider's code."""
    head = bytearray(secrets.token_bytes(8))
    head[6] = (head[6] & 0x0F) | 0x80
    secret = client.get(keys.id_secret())
    tail = bytearray(hmac.new(secret, bytes(head) + b"\0" + workspace.encode() + b"\0" + model.encode(),
                              hashlib.sha256).digest()[:8])
    tail[0] = (tail[0] & 0x3F) | 0x80
    return uuid_text(head + tail)


def write_as_version_8(client, request_id: str, provider: str) -> str:
    """The request's keys (record, result, body, webhook events, the event's
    due entry) written again as an earlier version wrote a request minted
    before codes: under a version-8 id of its workspace and model, with the
    global tag, each with its TTL; its events owed in the global tag's due set
    of its provider. Returns the version-8 id."""
    workspace, model = (v.decode() for v in client.hmget(keys.request(request_id), "workspace", "model"))
    old_id = version_8_id(client, workspace, model)
    for kind, name in (("req", keys.request), ("result", keys.result), ("body", keys.body),
                       ("webhook", keys.webhook_event), ("webhook", keys.webhook_next)):
        value = client.dump(name(request_id))
        if value is not None:
            suffix = ":next" if name is keys.webhook_next else ""
            client.restore(f"{ONE_TAG}:{kind}:{old_id}{suffix}", max(client.pttl(name(request_id)), 0), value)
    due_at = client.zscore(keys.webhooks_due(provider), request_id)
    if due_at is not None:
        client.zadd(f"{ONE_TAG}:webhook:due:{provider}", {old_id: due_at})
    return old_id


def version_8_keys(client) -> list[bytes]:
    """Every key left of version-8 requests (on one Redis, or the global tag's node of a cluster)."""
    nodes = ([client.get_redis_connection(n) for n in client.get_primaries()] if hasattr(client, "get_primaries")
             else [client])
    return [key for node in nodes for kind in ("req", "result", "body", "webhook")
            for key in node.scan_iter(match=f"[{{]rq[}}]:{kind}:*")]


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
