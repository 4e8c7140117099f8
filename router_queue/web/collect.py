"""A succeeded request's output as the caller collects it, wherever it is kept.

The same answer for the response_url, the synchronous route and its
idempotent resend: the provider's bytes under its Content-Type, with
``Content-Length``, ``ETag: "sha256:<hex>"`` (``If-None-Match`` answers 304)
and ``Range`` (206, or 416 invalid_input). An output in the object store is
streamed a chunk at a time, its sha256 checked as it goes: the last chunk is
held back until the digest of the whole matches, and a mismatch aborts the connection, so
a wrong body never arrives whole (logged and counted).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Iterator

from flask import Request, Response

from ..blobs.pointers import ResultPointer
from ..blobs.store import BlobMissing, BlobStore, BlobUnavailable
from ..errors import Gone, RangeNotSatisfiable, ServiceUnavailable
from ..metrics import Recorder
from ..store.record import RequestRecord
from .bodies import iso

log = logging.getLogger(__name__)

#: Seconds a caller is told to wait when the object store does not answer.
STORE_AWAY_RETRY_S = 5


class CorruptResult(RuntimeError):
    """An object's bytes do not hash to its pointer's sha256: the collect is cut short."""


def etag(sha256: str) -> str:
    return f'"sha256:{sha256}"'


def _wanted(req: Request, size: int, tag: str) -> tuple[int, int] | None:
    """The byte range (start, end exclusive) the caller asked for, None for
    all of it (no Range, several ranges, or an ``If-Range`` that no longer holds)."""
    if req.range is None or len(req.range.ranges) != 1:
        if req.headers.get("Range") and req.range is None:
            raise RangeNotSatisfiable(f"Range must be bytes=START-END within the result's {size} bytes", size=size)
        return None
    if_range = req.headers.get("If-Range")
    if if_range is not None and if_range.strip() != tag:
        return None
    if req.range.units != "bytes":
        return None
    span = req.range.range_for_length(size)
    if span is None:
        raise RangeNotSatisfiable(f"the range {req.headers['Range']} is outside the result's {size} bytes", size=size)
    return span


def collect(req: Request, record: RequestRecord, stored: bytes | ResultPointer | None, blobs: BlobStore | None,
            metrics: Recorder, headers: dict[str, str]) -> Response:
    """The 200, 206 or 304 for ``record``'s output (``stored``: the store's
    ``result``); ``headers`` go on every answer (its cost)."""
    if stored is None:
        raise Gone(f"the result of request {record.id} is past its retention window")
    size = len(stored) if isinstance(stored, bytes) else stored.size
    sha256 = hashlib.sha256(stored).hexdigest() if isinstance(stored, bytes) else stored.sha256
    content_type = record.content_type or "application/octet-stream"
    tag = etag(sha256)
    headers = {**headers, "ETag": tag, "Accept-Ranges": "bytes"}
    if req.if_none_match.contains_weak(f"sha256:{sha256}") or req.if_none_match.star_tag:
        return Response(status=304, headers=headers)
    span = _wanted(req, size, tag)
    start, end = span if span is not None else (0, size)
    status = 206 if span is not None else 200
    if status == 206:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    headers["Content-Length"] = str(end - start)
    if isinstance(stored, bytes):
        return Response(stored[start:end], status, headers=headers, content_type=content_type)
    chunks = _open(blobs, record.id, stored, start, end)
    body = _verified(chunks, stored, record.id, metrics) if span is None else chunks
    return Response(body, status, headers=headers, content_type=content_type, direct_passthrough=True)


def link(record: RequestRecord, stored: bytes | ResultPointer | None, blobs: BlobStore | None,
         response_url: str, link_s: int, retention_s: int, now: float) -> dict[str, Any]:
    """The ``/link`` answer's body: a URL that GETs the output without our key,
    signed for ``link_s`` seconds where the store can sign, else the
    ``response_url`` itself (it answers until the record expires)."""
    if stored is None:
        raise Gone(f"the result of request {record.id} is past its retention window")
    if isinstance(stored, bytes):
        size, sha256, url = len(stored), hashlib.sha256(stored).hexdigest(), None
    else:
        size, sha256 = stored.size, stored.sha256
        try:
            url = blobs.sign(stored.key, link_s) if blobs is not None else None
        except BlobUnavailable as exc:
            log.warning("request %s: the object store could not sign a link: %s", record.id, exc)
            raise ServiceUnavailable("the result store did not answer; retry shortly",
                                     retry_after=STORE_AWAY_RETRY_S) from None
    expires_at = now + link_s if url is not None else (record.completed_at or now) + retention_s
    return {"url": url or response_url, "expires_at": iso(expires_at), "size": size,
            "content_type": record.content_type or "application/octet-stream", "sha256": sha256}


def _open(blobs: BlobStore | None, request_id: str, pointer: ResultPointer, start: int, end: int) -> Iterator[bytes]:
    """The object's bytes, opened before any header is sent: a missing object
    is a 410 like an expired result, an unanswering store a 503."""
    if blobs is None:
        log.error("request %s: its result is in an object store and none is configured (OBJECT_STORE_URL)",
                  request_id)
        raise ServiceUnavailable("the result is in an object store this server is not configured to reach",
                                 retry_after=STORE_AWAY_RETRY_S)
    try:
        return blobs.read(pointer.key, start, end)
    except BlobMissing:
        raise Gone(f"the result of request {request_id} is past its retention window") from None
    except BlobUnavailable as exc:
        log.warning("request %s: the object store did not answer a collect: %s", request_id, exc)
        raise ServiceUnavailable("the result store did not answer; retry shortly",
                                 retry_after=STORE_AWAY_RETRY_S) from None


def _verified(chunks: Iterator[bytes], pointer: ResultPointer, request_id: str, metrics: Recorder) -> Iterator[bytes]:
    """``chunks`` passed on as they come, but the one that reaches the pointer's
    size: that one only once the whole hashes to the pointer's sha256. A short
    object never reaches it, so whatever happens the caller misses bytes."""
    digest = hashlib.sha256()
    seen = 0
    for chunk in chunks:
        digest.update(chunk)
        seen += len(chunk)
        if seen < pointer.size:
            yield chunk
            continue
        _check(digest, seen, pointer, request_id, metrics)
        yield chunk
        return
    _check(digest, seen, pointer, request_id, metrics)


def _check(digest: Any, seen: int, pointer: ResultPointer, request_id: str, metrics: Recorder) -> None:
    """Raise :class:`CorruptResult` unless ``seen`` bytes of ``digest`` are the pointer's."""
    if seen != pointer.size or digest.hexdigest() != pointer.sha256:
        metrics.objects("sha256_mismatch")
        log.error("request %s: object %s has %d bytes of sha256 %s, its record says %d bytes of %s; "
                  "collect aborted", request_id, pointer.key, seen, digest.hexdigest(), pointer.size,
                  pointer.sha256)
        raise CorruptResult(f"object {pointer.key} does not match its sha256")
