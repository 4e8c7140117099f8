"""The sweeper's move pass: results kept in Redis while the object store was
away (``outputs.py``) go to the store once it answers.

Per provider, a batch at a time: put each waiting result under a fresh
object name, then move_result.lua swaps the record's inline bytes for the
pointer in one step, only if the record still holds them, and gives its
fallback bytes back. An object the swap did not take (another sweeper moved
it first, or the record changed) is deleted. A put the store fails ends the
provider's pass and pauses it for :data:`PAUSE_AFTER_FAILURE_S`, so a stalled
store costs a sweep one put's timeout at most that often.
"""

from __future__ import annotations

import logging

from router_queue.blobs.pointers import ResultPointer, result_key
from router_queue.blobs.store import BlobUnavailable
from router_queue.store.fallback import FallbackResults

from .context import WorkerContext
from .outputs import discard

log = logging.getLogger(__name__)

#: Results of one provider moved per sweep at most (the rest: next sweep).
MOVES_PER_SWEEP = 50
#: Seconds a provider's move pass waits after the store failed one.
PAUSE_AFTER_FAILURE_S = 15


def move_fallback_results(context: WorkerContext, now: float) -> int:
    """Results moved from Redis's fallback to the object store this sweep."""
    services = context.services
    blobs = services.blobs
    if blobs is None:
        return 0
    fallback = FallbackResults(services.redis)
    moved = 0
    for provider in services.catalog.providers():
        waiting = fallback.waiting(provider, MOVES_PER_SWEEP)
        if not waiting or not fallback.may_move(provider):
            continue
        for entry in waiting:
            output, content_type = fallback.inline(entry.request_id)
            if output is None:  # expired before the store came back
                fallback.move(provider, entry.request_id, None, now)
                continue
            pointer = ResultPointer.of(result_key(entry.request_id, now), output, content_type)
            try:
                blobs.put(pointer.key, output, content_type)
            except BlobUnavailable as exc:
                log.warning("sweeper: the object store is still away (%s); %d %s result(s) stay in Redis",
                            exc, len(waiting), provider)
                fallback.pause(provider, PAUSE_AFTER_FAILURE_S)
                break
            outcome = fallback.move(provider, entry.request_id, pointer, now)
            if outcome == "MOVED":
                moved += 1
            else:
                discard(blobs, pointer, entry.request_id)
    if moved:
        services.metrics.objects("moved", moved)
        log.warning("sweeper: %d result(s) kept in Redis while the object store was away moved to it", moved)
    return moved
