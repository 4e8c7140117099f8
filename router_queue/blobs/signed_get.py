"""Stream an object by GETting its signed URL over sockets gevent patches.

obstore's reader hands a collect its bytes in pieces of 400-500 KiB whatever
``min_chunk_size`` says, each one a gevent threadpool hand-off, and the Rust
side buffers ahead of the caller; with 64 collects at once that was the front
door's memory. A signed URL is a credential-free GET, so urllib3 (pure Python:
its sockets are gevent's in a patched worker, nothing blocks the hub) reads it
at most a chunk at a time, and a stream holds a chunk and its socket's buffer.
"""

from __future__ import annotations

from typing import Any, Iterator

import urllib3

#: A store's patience, as the obstore client's (blobs/store.py): connect, and a stalled read.
TIMEOUT = urllib3.Timeout(connect=5.0, read=30.0)
#: Retries of the GET before any byte is passed on: dropped connections and 5xx, briefly.
RETRIES = urllib3.Retry(total=2, connect=2, read=2, status=2, redirect=0, backoff_factor=0.1,
                        status_forcelist=(500, 502, 503, 504), raise_on_status=False)
#: Connections a process keeps open to the store between collects (more are opened when needed).
KEPT_CONNECTIONS = 64


class ReadFailed(RuntimeError):
    """The store did not answer, answered an error, or cut the body short."""


class ObjectGone(LookupError):
    """The store answered 404: no object under that URL."""


def pool() -> urllib3.PoolManager:
    """A process's connections to its store (TLS checked against certifi's roots, as requests does)."""
    extra: dict[str, Any] = {}
    try:
        import certifi

        extra["ca_certs"] = certifi.where()
    except ImportError:  # urllib3 then trusts the system's roots
        pass
    return urllib3.PoolManager(num_pools=4, maxsize=KEPT_CONNECTIONS, block=False, timeout=TIMEOUT,
                               retries=RETRIES, cert_reqs="CERT_REQUIRED", **extra)


def chunks(http: urllib3.PoolManager, url: str, start: int, end: int, chunk_bytes: int) -> Iterator[bytes]:
    """Bytes ``start`` to ``end`` (exclusive, ``end > start``) of the object at
    ``url``, ``chunk_bytes`` at a time. The GET is sent at once (its failure
    raises here); a failure later raises :class:`ReadFailed` from the iteration."""
    try:
        answer = http.request("GET", url, headers={"Range": f"bytes={start}-{end - 1}"}, preload_content=False)
    except urllib3.exceptions.HTTPError as exc:
        raise ReadFailed(f"GET: {exc.__class__.__name__}: {exc}") from exc
    want = end - start
    if answer.status == 404:
        answer.release_conn()
        raise ObjectGone(url.split("?", 1)[0])
    if answer.status not in (200, 206) or answer.headers.get("Content-Length") != str(want):
        answer.close()
        answer.release_conn()
        raise ReadFailed(f"GET answered {answer.status} with Content-Length {answer.headers.get('Content-Length')}, "
                         f"asked for {want} bytes")
    return _body(answer, want, chunk_bytes)


def _body(answer: urllib3.BaseHTTPResponse, want: int, chunk_bytes: int) -> Iterator[bytes]:
    got = 0
    try:
        while got < want:
            try:
                # read1: what one recv brings, up to the chunk (read() would loop and copy to fill it)
                chunk = answer.read1(min(chunk_bytes, want - got), decode_content=False)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise ReadFailed(f"read after {got} of {want} bytes: {exc.__class__.__name__}: {exc}") from exc
            if not chunk:
                raise ReadFailed(f"the store sent {got} of {want} bytes")
            got += len(chunk)
            yield chunk
    finally:
        if got < want:  # cut short (the caller left, or the store did): the connection is not reused
            answer.close()
        answer.release_conn()
