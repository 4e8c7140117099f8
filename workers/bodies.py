"""A request body kept in the object store, read back for its delivery.

Admission wrote it there (``web/stashed.py``) and left its pointer in
``P:body:{id}``; the delivery reads it whole before it claims the request,
and checks its sha256. A store that does not answer puts the delivery off
(nothing claimed, nothing changed); an object gone or not the body admitted
ends the request ``internal_error``, unbilled (it cannot be sent as admitted).
"""

from __future__ import annotations

import hashlib
import logging

from router_queue.blobs.pointers import BodyPointer
from router_queue.blobs.store import BlobMissing, BlobStore, BlobUnavailable
from router_queue.metrics import Recorder

log = logging.getLogger(__name__)

#: Seconds before a delivery put off by an unanswering object store tries again.
STORE_AWAY_RETRY_S = 5.0


class BodyUnavailable(Exception):
    """The object store did not answer: deliver later."""


class BodyLost(Exception):
    """The body's object is gone or is not the body admitted."""


def native_body(blobs: BlobStore | None, metrics: Recorder, request_id: str, stored: bytes | None) -> bytes | None:
    """The body ``stored`` (what ``P:body:{id}`` holds) stands for: itself,
    or the object its pointer names, read and checked."""
    pointer = BodyPointer.parse(stored)
    if pointer is None:
        return stored
    if blobs is None:
        raise BodyLost(f"its body is in an object store ({pointer.key}) and OBJECT_STORE_URL is unset here")
    try:
        body = blobs.read_all(pointer.key)
    except BlobMissing:
        metrics.objects("body_read_failed")
        raise BodyLost(f"its body's object {pointer.key} is gone") from None
    except BlobUnavailable as fault:
        metrics.objects("body_read_failed")
        log.warning("request %s: the object store did not give its body (%s); delivering later", request_id, fault)
        raise BodyUnavailable(str(fault)) from None
    if len(body) != pointer.size or hashlib.sha256(body).hexdigest() != pointer.sha256:
        metrics.objects("sha256_mismatch")
        raise BodyLost(f"its body's object {pointer.key} is not the body admitted (size or sha256 differ)")
    return body
