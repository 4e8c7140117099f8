"""``/readyz``'s answer, checked at most once a second per process.

The check reads Redis (the epoch marker, an INFO on every primary) and may
reach the broker, and ``/readyz`` answers on the public port with no rate
limit: reused for ``READYZ_CACHE_SECONDS`` from the end of the last check, so
its cost is bounded whatever the call rate. Callers arriving while a check
runs wait for that one (a lock: gevent's once gunicorn's worker has patched
``threading``) rather than start their own.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

#: The app's ``extensions`` entry that holds the :class:`Readiness`.
READINESS = "router_queue.readiness"


class Readiness:
    def __init__(self, reuse_s: float, clock: Callable[[], float] = time.monotonic):
        self.reuse_s = reuse_s
        self.clock = clock
        self._lock = threading.Lock()
        #: When the last check ended (``clock``), and what it raised (None: ready).
        self._checked_at: float | None = None
        self._refusal: Exception | None = None

    def _fresh(self) -> bool:
        return self._checked_at is not None and self.clock() - self._checked_at < self.reuse_s

    def answer(self, check: Callable[[], None]) -> None:
        """Return if ready, else raise what ``check`` raised, from the last
        check while it is fresh, else from running ``check`` once more."""
        if self.reuse_s <= 0:
            check()
            return
        if not self._fresh():
            with self._lock:
                if not self._fresh():  # the check another caller ran while this one waited
                    try:
                        check()
                        self._refusal = None
                    except Exception as exc:  # noqa: BLE001 - kept, and raised to every caller until stale
                        self._refusal = exc
                    self._checked_at = self.clock()
        refusal = self._refusal
        if refusal is not None:
            raise refusal.with_traceback(None)
