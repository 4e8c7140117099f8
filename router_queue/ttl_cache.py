"""A process's short memory of what Redis answered: each entry reused until its time.

Bounded by a count, not a size: when full, it starts afresh (cleared
wholesale) rather than tracking which entry is oldest, since every entry
lives seconds and a lookup missed is only a round trip. Times are the
caller's clock (``now``, ``until``), so a test's clock steers it, and each
entry has its own (a key's ends no later than the key). Values are never
None: None is a miss. Used by ``web/auth.py``'s key cache and
``store/regions.py``'s region pins.
"""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        #: key -> (reused until, value)
        self._entries: dict[K, tuple[float, V]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def fresh(self, key: K, now: float) -> V | None:
        """``key``'s value while its entry is within its time, else None."""
        kept = self._entries.get(key)
        return kept[1] if kept is not None and kept[0] > now else None

    def last(self, key: K) -> V | None:
        """``key``'s value whatever its age (the answer before a stale one's lookup), else None."""
        kept = self._entries.get(key)
        return None if kept is None else kept[1]

    def put(self, key: K, value: V, until: float) -> None:
        """Keep ``value`` for ``key`` until ``until``; a full cache is cleared first."""
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key] = (until, value)

    def drop(self, key: K) -> None:
        """Forget ``key``: its next read goes to Redis."""
        self._entries.pop(key, None)
