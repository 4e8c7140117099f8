"""Renaming a store's keys from the layout before the hash tag (``rq:…``) to
today's (``{rq}:…``, ``keys.PREFIX``).

Run it with the service stopped (``router-queue ops migrate-keys``): a process
of the earlier version still writes ``rq:…`` keys, and one of this version
refuses to serve a store that holds them (``legacy_keys_present``), so that
nothing is answered as if the data were not there. ``RENAMENX`` keeps a key's
value, TTL and type; a name already taken is left and reported, never
overwritten. Pub/sub channels carry no data and need nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from redis.cluster import RedisCluster

from . import keys

LEGACY_MATCH = f"{keys.UNTAGGED_PREFIX}:*"


def tagged(legacy_key: bytes) -> bytes:
    """The name ``legacy_key`` has in today's layout."""
    return keys.PREFIX.encode() + legacy_key[len(keys.UNTAGGED_PREFIX):]


def legacy_keys_present(client: redis.Redis) -> bool:
    """Whether the store still holds the earlier layout's data: its workspace
    index or epoch marker (one command each, never a scan)."""
    old = keys.UNTAGGED_PREFIX
    return bool(client.exists(f"{old}:workspaces", f"{old}:config:epoch"))


@dataclass
class Migration:
    renamed: int = 0
    #: Legacy keys whose new name was already taken (left as they are).
    clashes: list[str] = field(default_factory=list)


def migrate(client: redis.Redis, batch: int = 1000) -> Migration:
    """Rename every ``rq:…`` key to its ``{rq}:…`` name, a SCAN page's worth
    of ``RENAMENX`` per round trip. A cluster store has nothing to rename:
    the earlier layout never ran on one (its scripts spanned slots)."""
    done = Migration()
    if isinstance(client, RedisCluster):
        return done
    cursor = 0
    while True:
        cursor, page = client.scan(cursor, match=LEGACY_MATCH, count=batch)
        if page:
            pipe = client.pipeline(transaction=False)
            for key in page:
                pipe.renamenx(key, tagged(key))
            for key, renamed in zip(page, pipe.execute(raise_on_error=False)):
                if renamed is True:
                    done.renamed += 1
                elif client.exists(key):  # its new name was taken (a key gone since the page is no clash)
                    done.clashes.append(key.decode(errors="replace"))
        if cursor == 0:
            return done
