"""The Redis side of results and bodies kept in the object store: which
objects are due for deletion, and whose pointers are gone
(``workers/object_expiry.py`` acts).

``P:objects:{provider}`` holds ``"{id} {object key}"`` scored by when its
pointer expires: a result's record (complete.lua), a body's ``P:body:{id}``
(lib/body.lua's drop_body, when the body's last request ends). An entry is due
when its score has passed and its pointer is gone; one whose pointer still
lives (Redis's clock behind the worker's, or a retry shares the body now)
is scored again at the pointer's expiry: nothing goes while its pointer lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from ..blobs.pointers import BODIES, BodyPointer, id_of
from . import keys

#: Seconds before a body whose pointer has no expiry (a retry sharing it
#: waits or runs) is looked at again; its end scores it anew anyway.
PERSISTED_RECHECK_S = 3600


#: Bytes of a body pointer's text at most (its object key is short).
POINTER_MAX_BYTES = 1024


@dataclass(frozen=True)
class DueObject:
    member: bytes
    request_id: str
    key: str


def pointer_key(entry: DueObject) -> str:
    """The key whose life the entry's object shares: a body's P:body:{id}, a result's record."""
    if entry.key.startswith(BODIES + "/"):
        return keys.body(entry.request_id)
    return keys.request(entry.request_id)


class ResultObjects:
    def __init__(self, client: redis.Redis):
        self.client = client

    def due(self, provider: str, now: float, limit: int) -> list[DueObject]:
        """Up to ``limit`` of ``provider``'s objects whose pointers are gone;
        those whose pointer lives are scored again at its expiry."""
        index = keys.result_objects(provider)
        members = self.client.zrangebyscore(index, "-inf", now, start=0, num=limit)
        entries = [DueObject(m, *m.decode().split(" ", 1)) for m in members]
        if not entries:
            return []
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            pipe.ttl(pointer_key(entry))
        ttls = pipe.execute()
        later = {entry.member: now + (ttl if ttl > 0 else PERSISTED_RECHECK_S if ttl == -1 else 60)
                 for entry, ttl in zip(entries, ttls) if ttl != -2}
        if later:
            self.client.zadd(index, later, xx=True)  # still alive: looked at again when it expires
        return [entry for entry, ttl in zip(entries, ttls) if ttl == -2]

    def forget(self, provider: str, deleted: list[DueObject]) -> None:
        """Drop entries whose objects are deleted."""
        if deleted:
            self.client.zrem(keys.result_objects(provider), *[entry.member for entry in deleted])

    def unpointed_bodies(self, object_keys: list[str]) -> list[str]:
        """Those of ``object_keys`` (body objects) no ``P:body:{id}`` points
        at: their admission never wrote the pointer (refused, or a crash
        between the put and the admission), or it is gone."""
        pipe = self.client.pipeline(transaction=False)
        for key in object_keys:
            pipe.getrange(keys.body(id_of(key)), 0, POINTER_MAX_BYTES)
        stored = pipe.execute()
        return [key for key, text in zip(object_keys, stored)
                if (pointer := BodyPointer.parse(text or None)) is None or pointer.key != key]

    def take_orphan_pass(self, every_s: int) -> bool:
        """Whether this sweeper lists the store for orphans now (one an ``every_s``, fleet-wide)."""
        return bool(self.client.set(keys.orphan_pass(), "1", nx=True, ex=every_s))
