"""Big results Redis keeps while the object store is away, within a budget.

complete.lua takes a result into the fallback when the provider's share of
``OBJECT_STORE_FALLBACK_MAX_BYTES`` has room (``P:fallback-bytes:{provider}``)
and names it in ``P:fallback:{provider}``; move_result.lua points the record
at the object the sweeper wrote and gives the bytes back
(``workers/result_moves.py``). The budget is split evenly between the
catalog's providers so that each check is one script in one slot (a cluster
keeps each provider's family on one primary): no provider can hold more than
its share, and all of them together no more than the setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from ..blobs.pointers import ResultPointer
from . import keys
from .scripts import argv, load_script

#: move_result.lua's ARGV, by name.
MOVE_ARGS = ("id", "now", "blob_key", "blob_size", "blob_sha256")


def share(max_bytes: int, providers: int) -> int:
    """One provider's part of the fallback budget."""
    return max_bytes // max(providers, 1)


@dataclass(frozen=True)
class Waiting:
    request_id: str
    size: int  # bytes


class FallbackResults:
    def __init__(self, client: redis.Redis):
        self.client = client
        self._move = load_script(client, "move_result", MOVE_ARGS)

    def waiting(self, provider: str, limit: int) -> list[Waiting]:
        """Up to ``limit`` of ``provider``'s results waiting to move."""
        members = self.client.zrange(keys.fallback_results(provider), 0, limit - 1, withscores=True)
        return [Waiting(member.decode(), int(score)) for member, score in members]

    def held_bytes(self, provider: str) -> int:
        return int(self.client.get(keys.fallback_bytes(provider)) or 0)

    def inline(self, request_id: str) -> tuple[bytes | None, str]:
        """A waiting result's bytes (None once expired) and content type."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(keys.result(request_id))
        pipe.hget(keys.request(request_id), "content_type")
        output, content_type = pipe.execute()
        return output, (content_type or b"").decode()

    def move(self, provider: str, request_id: str, pointer: ResultPointer | None, now: float) -> str:
        """move_result.lua's outcome; ``pointer`` None forgets an expired result."""
        return self._move(
            keys=[keys.request(request_id), keys.result(request_id), keys.fallback_results(provider),
                  keys.fallback_bytes(provider), keys.result_objects(provider)],
            args=argv(MOVE_ARGS, id=request_id, now=repr(now), blob_key=pointer.key if pointer else "",
                      blob_size=pointer.size if pointer else 0, blob_sha256=pointer.sha256 if pointer else ""),
        ).decode()

    def may_move(self, provider: str) -> bool:
        """Whether ``provider``'s move pass runs now: not while paused."""
        return not self.client.exists(keys.fallback_pause(provider))

    def pause(self, provider: str, seconds: int) -> None:
        """Skip ``provider``'s move passes for ``seconds`` after the store failed
        one: a stalled store would otherwise stall every sweep."""
        self.client.set(keys.fallback_pause(provider), "1", ex=seconds)
