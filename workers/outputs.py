"""Where a delivered output is kept: in Redis, or first in the object store.

An output larger than ``RESULT_INLINE_MAX_BYTES`` is written to the object
store before complete.lua records its pointer, so a request is COMPLETED only
once its output is durable in one of the two stores. A put the store does not
take within the window (the delivery's lease, renewed meanwhile) keeps the
output in Redis instead: a paid generation is never lost for a store fault.
"""

from __future__ import annotations

import logging
import time

from router_queue.blobs.pointers import ResultPointer, result_key
from router_queue.blobs.store import BlobStore, BlobUnavailable
from router_queue.metrics import Recorder
from router_queue.settings import Settings

log = logging.getLogger(__name__)

#: Seconds between two tries of a put the store refused: first, most.
PUT_RETRY_S = (0.5, 5.0)


def keep_output(blobs: BlobStore | None, settings: Settings, metrics: Recorder, request_id: str, content: bytes,
                content_type: str, within_s: float) -> ResultPointer | None:
    """The pointer to ``content`` written to the object store, or None when it
    stays in Redis (small, no store, or the store failing for ``within_s``)."""
    if blobs is None or len(content) <= settings.result_inline_max_bytes:
        return None
    pointer = ResultPointer.of(result_key(request_id), content, content_type)
    deadline = time.monotonic() + within_s
    delay = PUT_RETRY_S[0]
    while True:
        try:
            blobs.put(pointer.key, content, content_type)
        except BlobUnavailable as fault:
            if time.monotonic() + delay > deadline:
                log.error("request %s: the object store did not take its %d-byte output (%s); kept in Redis",
                          request_id, len(content), fault)
                metrics.objects("put_failed")
                return None
            log.warning("request %s: object store put failed (%s); trying again in %.1f s", request_id, fault, delay)
            time.sleep(delay)
            delay = min(delay * 2, PUT_RETRY_S[1])
            continue
        metrics.objects("put")
        return pointer


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
