"""Rewriting what an earlier version wrote in a shape only it read, as today's
version writes it (``ops migrate-keys``, after ``migrate.py``; the service
stopped): the shared draining set becomes the schedules' marks; the shared
webhook due set's events move to their providers' own, naming it; records and
events from before costs were kept are given their cost; on a store to be
served split, each request admitted before gets its open entry. Each step
finds nothing left on a second run. What an earlier version did not keep is
rebuilt: each schedule's ``:uheads`` (safe while the service runs). Requests
minted before ids carried their provider's code (version 8) are no longer
read: counted, and deleted only when asked (:func:`version_8`); while any is
left the layout marker is not written and a process refuses the store (``epoch.py``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import redis
from redis.cluster import RedisCluster

from ..states import COMPLETED, IN_QUEUE
from . import keys
from .scripts import load_script

#: Where an earlier version marked the draining providers (a set).
OLD_DRAINING = f"{keys.PREFIX}:draining"
#: Where an earlier version kept every provider's pending webhook events
#: (request id by when due; the events named no provider).
OLD_WEBHOOKS_DUE = f"{keys.PREFIX}:webhooks:due"
#: A request's record, and its webhook events (the one being delivered, a
#: hash; those queued behind it, a list ending ``:next``), under any tag.
RECORDS = "*}:req:*"
WEBHOOK_EVENTS = "*}:webhook:*"
#: A provider's workspace effects owed by a split store's steps (``keys.owed``).
OWED = "*}:owed:*"
#: The keys a request minted before ids carried their provider's code
#: (version 8) kept under the global tag: its record, result, body (and its
#: refs), webhook events (and those queued behind), and the due sets of
#: those events (``{rq}:webhook:due:{provider}``). The tag is one slot.
VERSION_8_MATCHES = tuple(keys.PREFIX.replace("{", "[{]") + f":{kind}:*" for kind in ("req", "result", "body",
                                                                                       "webhook"))
#: An owed effect's kind, by what of the open entry it gives.
_OWES = {"start": "q", "end": "e", "webhook": "w"}


@dataclass
class Rewritten:
    #: Providers moved from the shared draining set to their schedules.
    draining: int = 0
    #: Events moved from the shared due set to their providers'.
    due: int = 0
    #: Completed records given their cost.
    records: int = 0
    #: Webhook events (being delivered or queued) given a provider or a cost.
    events: int = 0
    #: Requests admitted before the store was split, given their open entry
    #: (``consistency.SplitSteps.prepare``); None for a model that keeps none.
    opened: int | None = None


@dataclass
class Version8:
    """What is left of the requests minted before ids carried their
    provider's code (version 8)."""
    #: Requests with a key left (record, result, body or webhook event).
    requests: int = 0
    #: Their keys, and their events' due sets.
    keys: int = 0
    #: When the last key with a TTL expires (a Unix time); None if none has one.
    last_expiry: float | None = None
    #: Whether they were deleted.
    dropped: bool = False

    @property
    def left(self) -> bool:
        return self.keys > 0 and not self.dropped


def version_8(client: redis.Redis, batch: int = 1000, *, drop: bool = False) -> Version8:
    """Count the version-8 requests' keys (and when the last expires), a SCAN
    page at a time; with ``drop``, delete each page's keys as it is read (one
    ``UNLINK`` of at most ``batch`` keys, all in the global tag's slot)."""
    found = Version8(dropped=drop)
    ids: set[str] = set()
    for node in primaries(client):
        for match in VERSION_8_MATCHES:
            cursor = 0
            while True:
                cursor, page = node.scan(cursor, match=match, count=batch)
                if page:
                    _count_version_8(node, page, found, ids)
                    if drop:
                        node.unlink(*page)
                if cursor == 0:
                    break
    found.requests = len(ids)
    return found


def _count_version_8(node: redis.Redis, page: list[bytes], found: Version8, ids: set[str]) -> None:
    pipe = node.pipeline(transaction=False)
    for key in page:
        pipe.pttl(key)
    for key, ttl_ms in zip(page, pipe.execute()):
        found.keys += 1
        kind, _, rest = key.decode().partition("}:")[2].partition(":")
        if not (kind == "webhook" and rest.startswith("due:")):
            ids.add(rest.split(":")[0])
        if ttl_ms > 0:
            expiry = time.time() + ttl_ms / 1000
            found.last_expiry = max(found.last_expiry or expiry, expiry)


def rewrite(client: redis.Redis, batch: int = 1000) -> Rewritten:
    """Every step above, in order: records before the events that take
    their cost, events named before they move."""
    done = Rewritten(draining=_adopt_draining(client))
    done.records = _scan(client, RECORDS, batch, lambda key: _give_cost(client, key))
    done.events = _scan(client, WEBHOOK_EVENTS, batch, lambda key: _complete_event(client, key))
    done.due = _move_shared_due_set(client)
    return done


def open_requests(client: redis.Redis, batch: int = 1000) -> int:
    """Give each request its open entry, from its record and the effects
    still owed (a store split into per-slot steps, after :func:`rewrite`);
    returns how many were opened."""
    owing: dict[str, str] = {}
    _scan(client, OWED, batch, lambda key: _mark_owed(client, key, owing))
    return _scan(client, RECORDS, batch, lambda key: _open(client, key, owing))


def urgent_heads(client: redis.Redis, providers: Iterable[str]) -> int:
    """Each provider's ``:uheads`` rebuilt from its ``:heads`` (``uheads_rebuild.lua``,
    one step a provider): a workspace whose request that is not low waited
    from before they were kept takes the reserve now, not at its next change.
    Returns how many heads they hold in all."""
    rebuild = load_script(client, "uheads_rebuild")
    return sum(int(rebuild(keys=[keys.schedule(provider)])) for provider in providers)


def _adopt_draining(client: redis.Redis) -> int:
    drained = [member.decode() for member in client.smembers(OLD_DRAINING)]
    for provider in drained:
        client.hset(keys.schedule(provider), "draining", "1")  # as RequestStore.set_draining marks it
    client.delete(OLD_DRAINING)
    return len(drained)


def primaries(client: redis.Redis) -> list[redis.Redis]:
    """Where to scan: each primary of a cluster, else the one Redis."""
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


def _scan(client: redis.Redis, match: str, batch: int, each: Callable[[str], bool]) -> int:
    """``each`` of every key matching ``match``, on every primary, but the
    global tag's (a version-8 request's, :func:`version_8`); how many it rewrote."""
    one_tag = keys.PREFIX.encode() + b":"
    return sum(each(key.decode()) for node in primaries(client)
               for key in node.scan_iter(match=match, count=batch) if not key.startswith(one_tag))


def _int(value: Any) -> int:
    return int(float(value)) if value else 0


def _give_cost(client: redis.Redis, key: str) -> bool:
    """A record completed before costs were kept: charged what it was
    charged, else released (what a release gave back was not kept)."""
    status, state, charged = client.hmget(key, "status", "cost_state", "charged")
    if status != COMPLETED.encode() or state:
        return False
    credits = _int(charged)
    client.hset(key, mapping={"cost_state": "charged" if credits else "released", "price": credits})
    return True


def _cost_of(client: redis.Redis, request_id: str, status: str) -> tuple[int, str]:
    """A request's cost as its record reads now (``requests._cost``); for a
    record gone, nothing: released once it completed, else held."""
    price, state, hold = client.hmget(keys.request(request_id), "price", "cost_state", "hold")
    if state:
        return _int(price), state.decode()
    if hold is not None:
        return _int(hold), "held"
    return 0, "released" if status == COMPLETED else "held"


def _completed(client: redis.Redis, request_id: str, event: dict[str, str]) -> dict[str, str]:
    """What ``event`` (a snapshot's fields) lacks of today's: its provider
    (its record's, else its model's) and its cost."""
    missing = {}
    if not event.get("provider"):
        provider = client.hget(keys.request(request_id), "provider")
        missing["provider"] = provider.decode() if provider else event.get("model", "").partition("/")[0]
    if not event.get("cost_state"):
        credits, state = _cost_of(client, request_id, event.get("status", COMPLETED))
        missing.update(cost_credits=str(credits), cost_state=state)
    return missing


def _complete_event(client: redis.Redis, key: str) -> bool:
    """The event ``key`` holds (a hash), or those queued behind one (a list),
    given what it lacks; the shared due set's own keys are left."""
    path = key.partition("}:")[2]
    request_id = path.removeprefix("webhook:").removesuffix(":next")
    if path.startswith("webhook:due:") or ":" in request_id:
        return False
    if key.endswith(":next"):
        rewritten = False
        for index, raw in enumerate(client.lrange(key, 0, -1)):
            queued = json.loads(raw)
            missing = _completed(client, request_id, queued)
            if missing:
                client.lset(key, index, json.dumps({**queued, **missing}))
                rewritten = True
        return rewritten
    event = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
    missing = _completed(client, request_id, event) if event else {}
    if missing:
        client.hset(key, mapping=missing)
    return bool(missing)


def _move_shared_due_set(client: redis.Redis) -> int:
    """Each event the shared due set holds, to its provider's (at the same
    time); one whose event is gone is dropped."""
    moved = 0
    for member, due_at in client.zrange(OLD_WEBHOOKS_DUE, 0, -1, withscores=True):
        request_id = member.decode()
        provider = client.hget(keys.webhook_event(request_id), "provider")
        if provider:
            client.zadd(keys.webhooks_due(provider.decode(), request_id), {request_id: due_at})
            moved += 1
        client.zrem(OLD_WEBHOOKS_DUE, member)
    return moved


def _mark_owed(client: redis.Redis, key: str, owing: dict[str, str]) -> bool:
    """Note what each effect a provider still owes gives (``owing``: request
    id -> "q", "e", "w"), and drop its earlier version's "unopened" mark (the
    request is given its entry before the effect is applied)."""
    for member, at in client.zrange(key, 0, -1, withscores=True):
        effect = json.loads(member)
        owing[effect["request_id"]] = owing.get(effect["request_id"], "") + _OWES[effect["kind"]] + (
            "q" if effect["kind"] == "end" and effect.get("queued") else "")
        if effect.pop("unopened", None) is not None:
            client.zrem(key, member)
            client.zadd(key, {json.dumps(effect): at})
    return False


def _open(client: redis.Redis, key: str, owing: dict[str, str]) -> bool:
    """A request admitted before its store was split: the open entry its
    admission would have written, less what its workspace was given since
    (the record's state says what; an effect still owed is still owed), and
    its record's mark. An entry an earlier version opened at its first
    effect is replaced; its "W" said its webhook was given."""
    status, workspace, opened, webhook = client.hmget(key, "status", "workspace", "open", "webhook_counted")
    if status is None or opened or not workspace:
        return False
    request_id, entries = key.rpartition(":")[2], keys.open_requests(workspace.decode())
    earlier = (client.hget(entries, request_id) or b"").decode()
    completed = status == COMPLETED.encode()
    counted = webhook == b"1" and (not completed or client.hexists(keys.webhook_event(request_id), "counted"))
    owed = ("q" if status == IN_QUEUE.encode() else "") + ("" if completed else "e") + ("w" if counted else "")
    owed = "".join(kind for kind in "qew" if kind in owed + owing.get(request_id, ""))
    if "W" in earlier:
        owed = owed.replace("w", "")
    if owed:
        client.hset(entries, request_id, owed)
    else:
        client.hdel(entries, request_id)
    client.hset(key, "open", 1)
    return True
