"""Rate counting for the reads a replica serves, at one primary write per
caller per process every :data:`SYNC_S`, not one per call.

Each process counts a caller's replica-served polls in memory and adds them to
the primary's windows at most every :data:`SYNC_S` per caller
(``rate_add.lua``), learning the fleet-wide counts in the same step; between
syncs it refuses once what it last learnt plus what it counted since passes
the limit. The price: a window can admit up to one :data:`SYNC_S` of each
process's polls beyond its limit. ``docs/ARCHITECTURE.md``, "The front door's
parts".
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import redis

log = logging.getLogger(__name__)

#: Seconds between two syncs of one caller's counts with the primary.
SYNC_S = 0.1
#: Windows remembered per process; past it, those whose window ended are dropped.
MAX_WINDOWS = 10_000


@dataclass
class _Window:
    #: Calls counted here and not yet added to the primary's window.
    pending: int = 0
    #: The window's fleet-wide count at the last sync (ours included).
    total: int = 0
    #: When the window ends, on this process's monotonic clock.
    ends_at: float = -math.inf
    synced_at: float = -math.inf


def _left_ms(window: _Window, now: float, seconds: int) -> int:
    """Ms left in ``window``; a whole window's when no sync has told its end yet."""
    return max(0, int((window.ends_at - now) * 1000)) if window.ends_at > -math.inf else seconds * 1000


class SyncedRateCounts:
    """One process's counts of the calls it let a replica answer."""

    def __init__(self, add: Any, sync_s: float = SYNC_S, clock: Callable[[], float] = time.monotonic):
        """``add``: ``rate_add.lua`` loaded on the primary (``scripts.load_script``)."""
        self._add = add
        self.sync_s = sync_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}

    def spend(self, keys: Sequence[str], args: Sequence[int]) -> list:
        """Count one call in ``keys``' windows (``args``: a (limit, seconds)
        pair each, as ``ratelimit.Allowance`` carries them); answers as
        ``rate.lua`` does: ``[window index, ms left]`` when one is spent, else
        ``[0, [count, ms left]...]``, where each window stands as far as this
        process knows (its last sync plus what it counted since)."""
        now = self.clock()
        windows = [self._window(key, now) for key in keys]
        for window in windows:
            window.pending += 1
        if now - windows[0].synced_at >= self.sync_s:
            self._sync(keys, args, windows, now)
        for index, window in enumerate(windows):
            if window.total + window.pending > args[2 * index]:
                return [index + 1, max(1, int((window.ends_at - now) * 1000))]
        return [0, *([window.total + window.pending, _left_ms(window, now, seconds)]
                     for window, seconds in zip(windows, args[1::2]))]

    def _window(self, key: str, now: float) -> _Window:
        window = self._windows.get(key)
        if window is None:
            if len(self._windows) >= MAX_WINDOWS:
                self._windows = {k: w for k, w in self._windows.items() if w.ends_at > now or w.pending}
            window = self._windows[key] = _Window()
        elif window.ends_at <= now and window.synced_at > -math.inf:
            window.total, window.synced_at = 0, -math.inf  # its window ended: learn the next one's at once
        return window

    def _sync(self, keys: Sequence[str], args: Sequence[int], windows: list[_Window], now: float) -> None:
        sent = [window.pending for window in windows]
        for window in windows:
            window.pending, window.synced_at = 0, now  # other greenlets count on meanwhile
        try:
            reply = self._add(keys=list(keys), args=[n for pair in zip(sent, args[1::2]) for n in pair])
        except redis.RedisError:  # the counter store's trouble must not refuse calls
            log.warning("rate-limit counters unreachable; reads let through", exc_info=True)
            for window, count in zip(windows, sent):
                window.pending += count
            return
        for window, (total, left_ms) in zip(windows, reply):
            window.total, window.ends_at = int(total), now + int(left_ms) / 1000
