"""Moving a store's keys from an earlier layout to today's (``keys.py``): from
before the hash tag (``rq:…``), and from one tag for everything (``{rq}:…``)
to a tag per family; then ``migrate_data.py``.

Run it with the service stopped (``router-queue ops migrate-keys``); this
version refuses a store without today's layout marker (``legacy_keys_present``).
``RENAMENX`` keeps a key's value, TTL and type; a name already taken is left
and reported. The global keys and version-8 requests' keys stay; rate windows
are dropped; the layout marker (``keys.layout``) is written last, once no
version-8 key is left. In full: ``docs/ARCHITECTURE.md``, "The store's parts".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from redis.cluster import RedisCluster

from . import keys
from .consistency import ONE_STEP, Consistency
from .migrate_data import Rewritten, Version8, primaries, rewrite, version_8
from .scripts import argv, load_script
from .secret_box import SecretBox

#: Keys written before the hash tag, and under the one tag.
LEGACY_MATCHES = (f"{keys.UNTAGGED_PREFIX}:*", keys.PREFIX.replace("{", "[{]") + ":*")

#: What follows the prefix of a provider's keys, by kind.
_PROVIDER_KINDS = {"queue": keys.queue, "seq": keys.sequence, "running": keys.running, "deadlines": keys.deadlines,
                   "stats": keys.stats, "owed": keys.owed, "admitting": keys.admitting}
#: The same of a request's keys (the id's prefix decides where they go).
_REQUEST_KINDS = {"req": keys.request, "result": keys.result, "body": keys.body}
#: The same of a workspace's keys.
_WORKSPACE_KINDS = {"ws": keys.workspace, "ledger": keys.ledger, "open": keys.open_requests, "held": keys.held}


def current_name(legacy_key: str) -> str | None:
    """The name ``legacy_key`` has in today's layout; None for a key dropped
    (a rate window, which would sit in its workspace's slot now)."""
    path = legacy_key.removeprefix(keys.PREFIX + ":") if legacy_key.startswith(keys.PREFIX + ":") \
        else legacy_key[len(keys.UNTAGGED_PREFIX) + 1:]
    kind, _, rest = path.partition(":")
    if kind in _PROVIDER_KINDS:
        return _PROVIDER_KINDS[kind](rest)
    if kind == "sched":
        provider, _, under = rest.partition(":")
        return keys.schedule(provider) + (f":{under}" if under else "")
    if kind in _REQUEST_KINDS and not _version_8(rest):
        return _REQUEST_KINDS[kind](rest)
    if kind == "webhook" and not rest.startswith("due:") and not _version_8(rest):
        request_id, _, under = rest.partition(":")
        return keys.webhook_event(request_id) + (f":{under}" if under else "")
    if kind in _WORKSPACE_KINDS:
        return _WORKSPACE_KINDS[kind](rest)
    if kind == "history":
        workspace, _, model = rest.partition(":")
        return keys.model_history(workspace, model) if model else keys.history(workspace)
    if kind == "idem":
        workspace, _, key_hash = rest.partition(":")
        return keys.idempotency(workspace, key_hash)
    if kind == "webhooks":
        what, _, workspace = rest.partition(":")
        if what == "log":
            return keys.webhook_log(workspace)
        if what == "inflight" and workspace:
            return keys.webhook_in_flight(workspace)
        if what == "circuit":
            workspace, _, origin = workspace.partition("|")
            return keys.webhook_circuit(workspace, origin)
    if kind == "rate":
        return None
    return f"{keys.PREFIX}:{path}"


def _version_8(request_id: str) -> bool:
    """Whether a request's id was minted before ids carried their provider's
    code: its keys stay under the global tag (``migrate_data.version_8``)."""
    return request_id[14:15] == "8"


def legacy_keys_present(client: redis.Redis, *, consistency: Consistency = ONE_STEP) -> bool:
    """Whether the store may still hold an earlier version's data: the
    workspace index from before the tag, or an index without today's layout
    marker; or without what ``consistency`` needs of it (split: each request's
    open entry, on a store served by one Redis until now). A few commands, never a scan."""
    old = keys.UNTAGGED_PREFIX
    if client.exists(f"{old}:workspaces", f"{old}:config:epoch"):
        return True
    if not client.exists(keys.workspaces()):
        return False
    return client.get(keys.layout()) != keys.LAYOUT.encode() or consistency.unprepared(client)


@dataclass
class Migration:
    renamed: int = 0
    #: Legacy keys whose new name was already taken (left as they are).
    clashes: list[str] = field(default_factory=list)
    #: What was rewritten in today's shape (``migrate_data.py``).
    rewritten: Rewritten = field(default_factory=Rewritten)
    #: What is left of the version-8 requests (or was, when dropped).
    version_8: Version8 = field(default_factory=Version8)


def migrate(client: redis.Redis, batch: int = 1000, *, consistency: Consistency = ONE_STEP,
            drop_version_8: bool = False) -> Migration:
    """Move every key of an earlier layout to its name in today's, a SCAN
    page's worth per round trip, count (with ``drop_version_8``, delete) the
    version-8 requests' keys, rewrite what only an earlier version read, then,
    unless version-8 keys are left, mark the store's layout (and that it has
    what ``consistency`` needs: split, each request's open entry)."""
    done = Migration()
    for match in LEGACY_MATCHES:
        for node_client in primaries(client):
            _migrate_matching(client, node_client, match, batch, done)
    done.version_8 = version_8(client, batch, drop=drop_version_8)
    done.rewritten = rewrite(client, batch)
    done.rewritten.opened = consistency.prepare(client, batch)
    if client.exists(keys.workspaces()) and not done.version_8.left:
        client.set(keys.layout(), keys.LAYOUT)
        consistency.mark_store(client)
    return done


def _migrate_matching(client: redis.Redis, node: redis.Redis, match: str, batch: int, done: Migration) -> None:
    cursor = 0
    while True:
        cursor, page = node.scan(cursor, match=match, count=batch)
        moves = [(key, current_name(key.decode())) for key in page]
        for key in (key for key, new in moves if new is None):
            client.delete(key)  # one at a time: on a cluster each may be in a slot of its own
        renames = [(key, new) for key, new in moves if new is not None and new != key.decode()]
        for key, moved in zip((key for key, _ in renames), _move(client, renames)):
            if moved:
                done.renamed += 1
            elif client.exists(key):  # its new name was taken (a key gone since the page is no clash)
                done.clashes.append(key.decode(errors="replace"))
        if cursor == 0:
            return


def _move(client: redis.Redis, moves: list[tuple[bytes, str]]) -> list[bool]:
    """Rename each key unless its new name is taken: ``RENAMENX`` on one
    Redis; on a cluster, where the names may hash to other slots, a copy
    (``DUMP``, ``RESTORE`` with the TTL left) and the old key deleted."""
    if not isinstance(client, RedisCluster):
        pipe = client.pipeline(transaction=False)
        for key, new in moves:
            pipe.renamenx(key, new)
        return [reply is True for reply in pipe.execute(raise_on_error=False)]
    moved = []
    for key, new in moves:
        value, ttl = client.dump(key), client.pttl(key)
        if value is None or client.exists(new):
            moved.append(False)
            continue
        client.restore(new, max(int(ttl), 0), value)
        client.delete(key)
        moved.append(True)
    return moved


#: A workspace's fields that hold a webhook signing secret.
SECRET_FIELDS = ("webhook_secret", "webhook_secret_previous")
#: webhook_secret_reseal.lua's ARGV by name (``scripts.argv``), in order.
RESEAL_ARGS = ("field", "read", "sealed")


def seal_webhook_secrets(client: redis.Redis, box: SecretBox) -> int:
    """Seal every workspace's webhook secrets with ``box``'s newest key:
    plaintext ones (stored before encryption) and ones sealed with an older
    key. Each is replaced only if unchanged since read (a rotation meanwhile
    wins); the store's marker is written first. Returns how many were sealed."""
    box.mark(client)
    reseal = load_script(client, "webhook_secret_reseal", RESEAL_ARGS)
    sealed = 0
    for member in client.smembers(keys.workspaces()):
        ws_key = keys.workspace(member.decode())
        for name, value in zip(SECRET_FIELDS, client.hmget(ws_key, SECRET_FIELDS)):
            if value is None or box.is_current(value.decode()):
                continue
            fresh = box.seal(box.open(value.decode()))
            sealed += int(reseal(keys=[ws_key], args=argv(RESEAL_ARGS, field=name, read=value, sealed=fresh)))
    return sealed
