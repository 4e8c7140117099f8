"""The object-store client: obstore behind the few calls the project makes.

obstore (one Rust client for S3, GCS, Azure and local files) reads each
cloud's standard configuration itself: for ``s3://`` the ``AWS_*`` variables
(credentials, ``AWS_REGION``, ``AWS_ENDPOINT_URL`` for R2/MinIO/Ceph,
``AWS_ALLOW_HTTP=true`` for a plain-http endpoint), instance and container
roles, web identity; for ``gs://`` ``GOOGLE_APPLICATION_CREDENTIALS`` or the
metadata server. Every call goes through :mod:`offhub`, but for a read from a
store that signs: that GETs a signed URL in Python (:mod:`signed_get`).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Iterator, Sequence

import obstore
from obstore.exceptions import BaseError, NotFoundError
from obstore.store import from_url

from . import offhub, signed_get

log = logging.getLogger(__name__)

#: Bytes a read hands on at most at a time: what a collect holds per caller. 64 collects of 10 MB
#: raise the web workers' RSS 1.04x at 64 KiB, 1.07x at 256 KiB, for no CPU measurably saved
#: (bench/README.md, front_door_rss_collect_10mb and collect_throughput_2mb).
CHUNK_BYTES = 64 * 1024
#: Seconds the URL a read GETs is signed for: it need only be valid when the GET is sent.
READ_URL_SECONDS = 60
#: Keys one delete call names (S3's DeleteObjects takes 1,000).
DELETE_BATCH = 1000
#: The client's patience: connect, a stalled read, a whole transfer (one to a
#: slow caller too), and its own retries of 5xx and dropped connections.
_CLIENT = {"connect_timeout": datetime.timedelta(seconds=5), "read_timeout": datetime.timedelta(seconds=30),
           "timeout": datetime.timedelta(seconds=600)}
_RETRY: dict[str, Any] = {"max_retries": 3, "retry_timeout": datetime.timedelta(seconds=20)}
#: The schemes OBJECT_STORE_URL may name.
SCHEMES = ("s3", "gs", "file")


class BlobMissing(LookupError):
    """No object under that key (deleted, or never written)."""


class BlobUnavailable(RuntimeError):
    """The object store failed or did not answer in time; the object may be there."""


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, (FileNotFoundError, NotFoundError))


def _call(what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function`` off the hub, its faults turned into our two errors."""
    try:
        return offhub.call(function, *args, **kwargs)
    except (BaseError, OSError) as exc:
        if _missing(exc):
            raise BlobMissing(what) from exc
        raise BlobUnavailable(f"{what}: {exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") \
            from exc


class BlobStore:
    """One bucket (or directory) and prefix; keys are relative to the prefix."""

    def __init__(self, url: str, store: Any):
        self.url = url
        self._store = store
        #: Whether :meth:`sign` can make a URL (S3, GCS); a directory cannot.
        self.signs = url.split("://", 1)[0] in ("s3", "gs")
        #: Connections for :meth:`read` (made once a read needs them: a worker process's own).
        self._http: Any = None

    def __repr__(self) -> str:
        return f"BlobStore({self.url!r})"

    def put(self, key: str, data: bytes, content_type: str) -> None:
        """Write ``data`` whole (obstore's put is atomic: no reader sees half).
        A bucket keeps ``content_type`` too, for whoever follows a signed URL
        (a directory cannot; the pointer in Redis has it for the collect)."""
        attributes = {"Content-Type": content_type or "application/octet-stream"} if self.signs else None
        _call(f"put {key}", obstore.put, self._store, key, data, attributes=attributes, use_multipart=False)

    def read(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` to ``end`` (exclusive) of ``key``, a chunk at a time.
        Opening raises :class:`BlobMissing` or :class:`BlobUnavailable` at once;
        a later chunk's failure raises :class:`BlobUnavailable` from the iteration.
        A store that signs is read by GETting a signed URL (:mod:`signed_get`),
        a directory through obstore."""
        if end <= start:
            return iter(())
        if not self.signs:
            result = _call(f"get {key}", obstore.get, self._store, key, options={"range": (start, end)})
            return self._chunks(key, result.stream(min_chunk_size=CHUNK_BYTES))
        url = self.sign(key, READ_URL_SECONDS)
        if self._http is None:
            self._http = signed_get.pool()
        try:
            return self._signed_chunks(key, signed_get.chunks(self._http, str(url), start, end, CHUNK_BYTES))
        except signed_get.ObjectGone:
            raise BlobMissing(f"get {key}") from None
        except signed_get.ReadFailed as exc:
            raise BlobUnavailable(f"get {key}: {exc}") from exc

    @staticmethod
    def _signed_chunks(key: str, chunks: Iterator[bytes]) -> Iterator[bytes]:
        try:
            yield from chunks
        except signed_get.ReadFailed as exc:
            raise BlobUnavailable(f"read {key}: {exc}") from exc

    def _chunks(self, key: str, stream: Any) -> Iterator[bytes]:
        while True:
            try:
                chunk = _call(f"read {key}", next, stream)
            except BlobUnavailable as exc:
                if isinstance(exc.__cause__, StopIteration):
                    return
                raise
            except StopIteration:
                return
            view = memoryview(chunk)  # the transport may hand over more than a chunk: pass it on in pieces
            for at in range(0, len(view), CHUNK_BYTES):
                yield bytes(view[at:at + CHUNK_BYTES])

    def read_all(self, key: str) -> bytes:
        """The whole object (small ones, and tests)."""
        return bytes(_call(f"get {key}", lambda: obstore.get(self._store, key).bytes()))

    def sign(self, key: str, seconds: int) -> str | None:
        """A URL that GETs ``key`` without credentials for ``seconds``; None
        where the store cannot sign (a directory)."""
        if not self.signs:
            return None
        return str(_call(f"sign {key}", obstore.sign, self._store, "GET", key,
                         datetime.timedelta(seconds=seconds)))

    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (missing ones are no error), a batch per call."""
        for at in range(0, len(keys), DELETE_BATCH):
            batch = list(keys[at:at + DELETE_BATCH])
            try:
                _call(f"delete {len(batch)} objects", obstore.delete, self._store, batch)
            except BlobMissing:  # a local store deleting one already gone
                for key in batch:
                    try:
                        _call(f"delete {key}", obstore.delete, self._store, key)
                    except BlobMissing:
                        pass

    def folders(self, prefix: str) -> list[str]:
        """The "folders" directly under ``prefix`` (S3's common prefixes)."""
        listed = _call(f"list {prefix}", obstore.list_with_delimiter, self._store, prefix)
        return sorted(str(p) for p in listed["common_prefixes"])

    def keys_under(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (one listing, page by page)."""
        def listing() -> list[str]:
            return [str(meta["path"]) for page in obstore.list(self._store, prefix) for meta in page]
        return list(_call(f"list {prefix}", listing))


def open_blob_store(url: str, *, allow_http: bool = False) -> BlobStore | None:
    """The store ``url`` names (``OBJECT_STORE_URL``), or None when it is empty.
    ``allow_http``: the endpoint may be plain http (``AWS_ALLOW_HTTP``; the
    client options given here replace the ones obstore would read from it)."""
    if not url:
        return None
    scheme = url.split("://", 1)[0]
    if scheme not in SCHEMES:
        raise ValueError("OBJECT_STORE_URL must be s3://bucket/prefix, gs://bucket/prefix or file:///path, "
                         f"got {url!r}")
    client = {**_CLIENT, "allow_http": allow_http}
    extra: dict[str, Any] = {"mkdir": True} if scheme == "file" else {"client_options": client, "retry_config": _RETRY}
    return BlobStore(url, from_url(url, **extra))
