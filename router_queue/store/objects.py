"""The Redis side of results kept in the object store: which objects are due
for deletion, and whose records are gone (``workers/object_expiry.py`` acts).

``P:objects:{provider}`` holds ``"{id} {object key}"`` scored by when the
record expires (complete.lua adds it with the pointer). An entry is due when
its score has passed and its record is gone; one whose record still lives
(Redis expired it later than the worker's clock said) is scored again at the
record's own expiry, so nothing is deleted while its record lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from . import keys


@dataclass(frozen=True)
class DueObject:
    member: bytes
    request_id: str
    key: str


class ResultObjects:
    def __init__(self, client: redis.Redis):
        self.client = client

    def due(self, provider: str, now: float, limit: int) -> list[DueObject]:
        """Up to ``limit`` of ``provider``'s objects whose records are gone;
        those whose record lives are scored again at its expiry."""
        index = keys.result_objects(provider)
        members = self.client.zrangebyscore(index, "-inf", now, start=0, num=limit)
        entries = [DueObject(m, *m.decode().split(" ", 1)) for m in members]
        if not entries:
            return []
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            pipe.ttl(keys.request(entry.request_id))
        ttls = pipe.execute()
        later = {entry.member: now + (ttl if ttl > 0 else 60) for entry, ttl in zip(entries, ttls) if ttl != -2}
        if later:
            self.client.zadd(index, later, xx=True)  # still alive: looked at again when it expires
        return [entry for entry, ttl in zip(entries, ttls) if ttl == -2]

    def forget(self, provider: str, deleted: list[DueObject]) -> None:
        """Drop entries whose objects are deleted."""
        if deleted:
            self.client.zrem(keys.result_objects(provider), *[entry.member for entry in deleted])

    def take_orphan_pass(self, every_s: int) -> bool:
        """Whether this sweeper lists the store for orphans now (one an ``every_s``, fleet-wide)."""
        return bool(self.client.set(keys.orphan_pass(), "1", nx=True, ex=every_s))
