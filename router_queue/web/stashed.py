"""A request body larger than ``BODY_INLINE_MAX_BYTES`` goes to the object
store at admission, before the ``201`` (a ``201`` means it is durable), and
Redis keeps its pointer (``blobs/pointers.py``, ``BodyPointer``) in its place.

The put runs off the gevent hub (``blobs/offhub.py``). A store that does not
take it answers ``503`` with ``Retry-After``: nothing admitted or charged.
An admission that refuses it deletes the object at once; one whose outcome
is unknown leaves it to the sweeper's orphan pass, which deletes it if no
``P:body:{id}`` points at it (``workers/object_expiry.py``).
"""

from __future__ import annotations

import logging

from ..blobs.pointers import BodyPointer
from ..blobs.store import BlobUnavailable
from ..errors import ServiceUnavailable
from ..services import Services

log = logging.getLogger(__name__)

#: Seconds a caller whose body the object store did not take is told to wait.
STORE_AWAY_RETRY_AFTER_S = 5


def stash(services: Services, request_id: str, raw_body: bytes) -> BodyPointer | None:
    """The pointer to ``raw_body`` written to the object store, or None when
    it stays in Redis (small enough, or no store)."""
    blobs = services.blobs
    if blobs is None or len(raw_body) <= services.settings.body_inline_max_bytes:
        return None
    pointer = BodyPointer.of(request_id, raw_body)
    try:
        blobs.put(pointer.key, raw_body, "application/json")
    except BlobUnavailable as fault:
        log.warning("request %s: the object store did not take its %d-byte body (%s); refused 503",
                    request_id, len(raw_body), fault)
        services.metrics.objects("body_put_failed")
        raise ServiceUnavailable("the object store that keeps large bodies did not answer; nothing was admitted "
                                 "or charged; retry shortly", retry_after=STORE_AWAY_RETRY_AFTER_S) from None
    services.metrics.objects("body_put")
    return pointer


def unstash(services: Services, pointer: BodyPointer | None, request_id: str) -> None:
    """Delete the object of a body whose admission refused it; a failure is
    left to the sweeper's orphan pass."""
    if pointer is None or services.blobs is None:
        return
    try:
        services.blobs.delete([pointer.key])
    except BlobUnavailable as fault:
        log.warning("request %s: could not delete its refused body's object %s (%s); the sweeper will",
                    request_id, pointer.key, fault)
