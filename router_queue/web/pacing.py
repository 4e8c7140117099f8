"""``Retry-After`` on status reads: when a new poll is worth the round trip.

Derived from what the provider's queue is actually doing: the moving averages
of run time and of the gap between completions that ``complete.lua`` keeps.
A request ``n`` places back waits about ``n`` gaps plus one run, so it is told
to come back later than a running request, which is told its expected
remaining time.
"""

from __future__ import annotations

import math
import time

from ..states import COMPLETED, IN_PROGRESS
from ..store.record import RequestRecord
from ..store.requests_values import Pace

#: Assumed run time (s) for a provider that has not completed anything yet.
DEFAULT_RUN_S = 2.0
#: Bounds (s) on the hint: never under a second, never parking a poller long.
MIN_HINT_S, MAX_QUEUED_HINT_S, MAX_RUNNING_HINT_S = 1, 60, 30
#: A finished request never changes again: nothing to wait for, and the
#: contract's status read names a ``Retry-After`` all the same.
FINISHED_HINT_S = 0


def retry_after(record: RequestRecord, position: int | None, pace: Pace, now: float | None = None) -> int:
    """Seconds before a new poll is worth it; ``0`` for a finished request,
    which never changes again: there is nothing to wait for."""
    if record.status == COMPLETED:
        return FINISHED_HINT_S
    now = time.time() if now is None else now
    run = pace.avg_run_s if pace.avg_run_s else DEFAULT_RUN_S
    if record.status == IN_PROGRESS:
        elapsed = now - (record.started_at or now)
        remaining = run - elapsed if run > elapsed else run / 4
        return int(min(max(math.ceil(remaining), MIN_HINT_S), MAX_RUNNING_HINT_S))
    gap = pace.avg_gap_s if pace.avg_gap_s else run
    wait = (position or 0) * gap + run / 2
    return int(min(max(math.ceil(wait), MIN_HINT_S), MAX_QUEUED_HINT_S))


def backlog_retry_after(pace: Pace) -> int:
    """After a full backlog: about when one of the provider's requests leaves the queue."""
    gap = pace.avg_gap_s or pace.avg_run_s or DEFAULT_RUN_S
    return int(min(max(math.ceil(gap), MIN_HINT_S), MAX_QUEUED_HINT_S))
