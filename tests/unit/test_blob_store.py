"""The object-store client against a directory and a real S3-compatible server
(moto's, in a subprocess): put, ranged streaming reads, signed URLs, deletes."""

from __future__ import annotations

import hashlib
import itertools
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from router_queue.blobs import offhub, pointers
from router_queue.blobs.store import CHUNK_BYTES, BlobMissing, BlobUnavailable, open_blob_store
from tests.object_stores import BUCKET, env_set

BIG = bytes(itertools.islice(itertools.cycle(range(251)), 2_000_000))  # 2 MB, no period of a power of two


@pytest.fixture(params=["file", "s3"])
def blobs(request, tmp_path):
    if request.param == "file":
        yield open_blob_store(f"file://{tmp_path}/objects")
        return
    server = request.getfixturevalue("s3")
    prefix = f"unit-{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]}"
    with env_set(server.env()):
        yield open_blob_store(f"s3://{BUCKET}/{prefix}", allow_http=True)


def test_put_then_read_streams_in_chunks_byte_for_byte(blobs):
    key = pointers.result_key("r1")
    blobs.put(key, BIG, "image/png")
    chunks = list(blobs.read(key, 0, len(BIG)))
    assert b"".join(chunks) == BIG
    assert max(len(c) for c in chunks) <= CHUNK_BYTES and len(chunks) > 1  # never the whole object at once
    assert b"".join(blobs.read(key, 1000, 1010)) == BIG[1000:1010]
    assert b"".join(blobs.read(key, len(BIG) - 5, len(BIG))) == BIG[-5:]
    assert list(blobs.read(key, 10, 10)) == []


def test_missing_objects_and_deletes(blobs):
    with pytest.raises(BlobMissing):
        blobs.read("results/2000010100/none-0", 0, 5)
    keys = [pointers.result_key(f"r{n}") for n in range(3)]
    for key in keys:
        blobs.put(key, b"x" * 10, "text/plain")
    blobs.delete([*keys[:2], "results/2000010100/never-written"])
    assert blobs.keys_under(pointers.RESULTS) == [keys[2]]
    with pytest.raises(BlobMissing):
        blobs.read(keys[0], 0, 10)


def test_folders_list_the_hours_written(blobs):
    blobs.put(pointers.result_key("a", now=0.0), b"1", "text/plain")
    blobs.put(pointers.result_key("b", now=7200.0), b"2", "text/plain")
    hours = blobs.folders(pointers.RESULTS)
    assert hours == ["results/1970010100", "results/1970010102"]
    assert [pointers.hour_of(h) for h in hours] == [0.0, 7200.0]
    assert pointers.hour_of("results/junk") is None


def test_signed_url_serves_the_object_without_credentials(blobs):
    key = pointers.result_key("signed")
    blobs.put(key, BIG[:70_000], "audio/mpeg")
    url = blobs.sign(key, 300)
    if blobs.url.startswith("file://"):
        assert url is None and not blobs.signs  # a directory cannot sign: the link route answers response_url
        return
    with urllib.request.urlopen(url) as answer:
        assert answer.read() == BIG[:70_000]
        assert answer.headers["Content-Type"] == "audio/mpeg"


def test_a_store_that_does_not_answer_is_unavailable(tmp_path):
    with env_set({"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
                  "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ALLOW_HTTP": "true"}):
        store = open_blob_store("s3://nowhere/p", allow_http=True)
    with pytest.raises(BlobUnavailable):
        store.put("k", b"1", "text/plain")


def test_urls_the_setting_may_name():
    assert open_blob_store("") is None
    with pytest.raises(ValueError, match="OBJECT_STORE_URL"):
        open_blob_store("ftp://host/x")


def test_calls_run_on_the_threadpool_only_on_a_patched_hub(monkeypatch):
    assert not offhub.on_hub()  # pytest is no gevent worker
    assert offhub.call(lambda a, b=0: a + b, 1, b=2) == 3

    monkeypatch.setattr(offhub, "on_hub", lambda: True)  # as in a monkey-patched gevent worker
    import threading

    caller = threading.get_ident()
    assert offhub.call(threading.get_ident) != caller  # ran on gevent's pool thread


class _FaultyStore(BaseHTTPRequestHandler):
    """An S3 endpoint whose GET answers ``status``, or 206 with half the body it announces, then hangs up."""

    status = 500

    def do_GET(self):
        if self.status != 206:
            self.send_response(self.status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        want = int(self.headers["Range"].split("=")[1].split("-")[1]) + 1
        self.send_response(206)
        self.send_header("Content-Length", str(want))
        self.end_headers()
        self.wfile.write(b"x" * (want // 2))
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [500, 403, 206])
def test_a_store_that_fails_a_read_or_cuts_it_short_is_unavailable(status):
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Store", (_FaultyStore,), {"status": status}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with env_set({"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
                      "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}", "AWS_ALLOW_HTTP": "true"}):
            store = open_blob_store("s3://bucket/p", allow_http=True)
        with pytest.raises(BlobUnavailable):  # opening fails, or a later chunk: never a short body taken as whole
            b"".join(store.read("results/2026010100/r-0", 0, 200_000))
    finally:
        server.shutdown()
        server.server_close()
