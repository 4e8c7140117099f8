"""A slow object-store call must not stall a gevent hub: in a monkey-patched
process (what a gunicorn gevent worker is), one greenlet's read waits on a
store that does not answer while another greenlet keeps running."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The gevent worker's side: a read that opens on the held store, and a
#: greenlet doing the small work a status read does, announcing when done.
_WORKER = """
from gevent import monkey; monkey.patch_all()
import sys, gevent
from router_queue.blobs.store import BlobMissing, open_blob_store
blobs = open_blob_store(sys.argv[1], allow_http=True)
def collect():
    try:
        list(blobs.read("results/2026010100/slow-0", 0, 10))
    except BlobMissing:
        pass
    print("collect answered", flush=True)
def status_reads():
    for _ in range(20):
        gevent.sleep(0.001)
    print("status reads answered", flush=True)
gevent.joinall([gevent.spawn(collect), gevent.spawn(status_reads)])
"""


class _HeldStore(BaseHTTPRequestHandler):
    """An S3 endpoint whose GET is held until the test releases it (or 10 s pass: under the client's 30 s read timeout), then 404s."""

    release = threading.Event()
    released_by_test = False

    def do_GET(self):
        type(self).released_by_test = self.release.wait(10)
        body = b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>"
        self.send_response(404)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def held_store():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HeldStore)
    _HeldStore.release.clear()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _HeldStore.release.set()
        server.shutdown()
        server.server_close()


def test_other_greenlets_run_while_a_store_read_waits(held_store):
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": held_store, "AWS_ALLOW_HTTP": "true",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, "s3://bucket/p"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().strip()
        _HeldStore.release.set()  # the read may answer now: the status reads came first, or the hub was stalled
        rest, errors = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, errors
    assert [first, rest.strip()] == ["status reads answered", "collect answered"]
    assert _HeldStore.released_by_test  # the store was still holding the read when the status reads were done
