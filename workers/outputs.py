"""Where a delivered output is kept: in Redis, or first in the object store.

An output larger than ``RESULT_INLINE_MAX_BYTES`` is written to the object
store before complete.lua records its pointer, so a request is COMPLETED only
once its output is durable in one of the two stores. A store that does not
take it is tried again with backoff, the lease held meanwhile; past
``OBJECT_STORE_PUT_WINDOW_SECONDS`` the output is kept in Redis within the
fallback budget (``store/fallback.py``) and the sweeper moves it later
(``result_moves.py``). With that budget full too, the request stays
IN_PROGRESS and both are tried until one takes it: a paid generation is
never lost, nor charged, while neither store can hold it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from router_queue.blobs.pointers import ResultPointer, result_key
from router_queue.blobs.store import BlobStore, BlobUnavailable
from router_queue.services import Services
from router_queue.store.fallback import share
from router_queue.store.outcomes import Complete
from router_queue.store.record import RequestRecord

from .leases import LeaseKeeper

log = logging.getLogger(__name__)

#: Seconds between two tries of a put the store refused: first, most.
PUT_RETRY_S = (0.5, 5.0)
#: Seconds one put may take before its delivery counts as hung (the lease is
#: then left to run out): the client's whole-transfer timeout and its retries
#: (``blobs/store.py``), and a margin.
PUT_HUNG_AFTER_S = 660.0


@dataclass(frozen=True)
class Clock:
    """How the put loop reads time and waits (tests give a fake one)."""

    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Any] = time.sleep


#: The clock :func:`keep_output` uses when given none.
CLOCK = Clock()


def keep_output(services: Services, leases: LeaseKeeper, record: RequestRecord, token: str, content: bytes,
                content_type: str, complete: Callable[..., Complete], clock: Clock | None = None) -> Complete:
    """Complete ``record`` with ``content`` (``complete`` runs complete.lua),
    once it is durable: inline, in the object store, or in Redis's fallback."""
    blobs, settings, metrics = services.blobs, services.settings, services.metrics
    clock = clock or CLOCK
    if blobs is None or len(content) <= settings.result_inline_max_bytes:
        return complete(output=content, content_type=content_type)
    pointer = ResultPointer.of(result_key(record.id), content, content_type)
    window_ends = clock.now() + settings.object_store_put_window_s
    fallback_max = share(settings.object_store_fallback_max_bytes, len(services.catalog.providers()))
    delay, full_said = PUT_RETRY_S[0], False
    while True:
        leases.hold(record.id, record.provider, token, for_s=PUT_HUNG_AFTER_S)  # renewed while it tries
        try:
            blobs.put(pointer.key, content, content_type)
        except BlobUnavailable as fault:
            metrics.objects("put_failed")
            log.warning("request %s: object store put failed (%s); trying again in %.1f s", record.id, fault, delay)
        else:
            metrics.objects("put")
            written = complete(output=b"", content_type=content_type, pointer=pointer)
            if written is not Complete.COMPLETED:
                discard(blobs, pointer, record.id)
            return written
        if clock.now() >= window_ends:
            written = complete(output=content, content_type=content_type, fallback_max=fallback_max)
            if written is not Complete.FALLBACK_FULL:
                if written is Complete.COMPLETED:
                    metrics.objects("fallback")
                    log.error("request %s: the object store did not take its %d-byte output for %.0f s; kept in "
                              "Redis until the sweeper moves it", record.id, len(content),
                              settings.object_store_put_window_s)
                return written
            metrics.objects("fallback_full")
            if not full_said:
                full_said = True
                log.error("request %s: the object store is away and Redis's fallback for big outputs is full "
                          "(OBJECT_STORE_FALLBACK_MAX_BYTES); it stays IN_PROGRESS, trying both", record.id)
        clock.sleep(delay)
        delay = min(delay * 2, PUT_RETRY_S[1])


def discard(blobs: BlobStore | None, pointer: ResultPointer | None, request_id: str) -> None:
    """Delete an object whose pointer was not recorded (another delivery
    completed the request first); the sweeper's orphan pass covers a failure."""
    if blobs is None or pointer is None:
        return
    try:
        blobs.delete([pointer.key])
    except BlobUnavailable as fault:
        log.warning("request %s: could not delete its unrecorded object %s (%s); the sweeper will",
                    request_id, pointer.key, fault)
