"""Results larger than RESULT_INLINE_MAX_BYTES live in the object store (a
directory, and moto's S3 server in a subprocess): the worker writes the object
before the request completes, Redis keeps a pointer, and the collect streams
it back byte for byte with its sha256, ETag and ranges."""

from __future__ import annotations

import dataclasses
import hashlib
import time

import pytest

from router_queue.blobs import pointers
from router_queue.blobs.store import open_blob_store
from router_queue.states import COMPLETED
from router_queue.store import keys
from router_queue.web.app import create_app
from router_queue.web.collect import CorruptResult
from tests.object_stores import BUCKET, env_set
from tests.unit import delivery_support
from tests.unit.delivery_support import admitted, deliver_until_done
from tests.unit.support import context_of

# The delivery tests' stub provider and worker services, as fixtures of this module too.
stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)

GEMINI = "vertexai/gemini-3.1-flash-image"
TWO_MB = 2_000_000


@pytest.fixture(params=["file", "s3"])
def stored(request, worker_services, tmp_path):
    """The services with an object store: a directory, or a bucket on moto's server."""
    if request.param == "file":
        blobs = open_blob_store(f"file://{tmp_path}/objects")
    else:
        server = request.getfixturevalue("s3")
        with env_set(server.env()):
            blobs = open_blob_store(f"s3://{BUCKET}/{tmp_path.name}", allow_http=True)
    worker_services.blobs = blobs
    return worker_services


@pytest.fixture
def http(stored):
    return create_app(stored.settings, services=stored).test_client()


def gemini(text: str) -> dict:
    return {"contents": [{"parts": [{"text": text}]}]}


def generated(services, workspace, text: str) -> str:
    request_id, _ = admitted(services, workspace, GEMINI, gemini(text))
    assert deliver_until_done(context_of(services), request_id) == "completed"
    return request_id


def test_a_large_output_goes_to_the_object_store_and_redis_keeps_a_pointer(stored, workspace):
    request_id = generated(stored, workspace, f"a big one [stub:size={TWO_MB}]")
    record = stored.store.status_view(request_id, "vertexai").record
    assert record.status == COMPLETED
    assert stored.redis.get(keys.result(request_id)) is None  # no output bytes in Redis
    pointer = stored.store.result(request_id)
    assert isinstance(pointer, pointers.ResultPointer)
    assert pointer.size > TWO_MB and pointer.content_type == "application/json"
    kept = stored.blobs.read_all(pointer.key)
    assert hashlib.sha256(kept).hexdigest() == pointer.sha256 and len(kept) == pointer.size
    due = stored.redis.zrange(keys.result_objects("vertexai"), 0, -1, withscores=True)
    assert [member for member, _ in due] == [f"{request_id} {pointer.key}".encode()]
    assert due[0][1] == pytest.approx(record.completed_at + stored.settings.result_retention_s, abs=1)


def test_a_small_output_stays_in_redis(stored, workspace):
    request_id = generated(stored, workspace, "a small one")
    assert stored.redis.get(keys.result(request_id)) is not None
    assert stored.blobs.keys_under(pointers.RESULTS) == []


def test_without_an_object_store_every_output_stays_in_redis(worker_services, workspace):
    request_id = generated(worker_services, workspace, f"big, no store [stub:size={TWO_MB}]")
    assert len(worker_services.redis.get(keys.result(request_id))) > TWO_MB


def url_of(request_id: str) -> str:
    return f"/v2/models/{GEMINI}/requests/{request_id}"


def test_the_collect_streams_the_object_byte_for_byte_with_its_sha256(stored, workspace, http, auth):
    request_id = generated(stored, workspace, f"collect me [stub:size={TWO_MB}]")
    pointer = stored.store.result(request_id)
    answer = http.get(url_of(request_id), headers=auth)
    assert answer.status_code == 200 and answer.headers["Content-Type"] == "application/json"
    assert answer.is_streamed  # chunks from the store, not one buffer
    body = answer.get_data()
    assert hashlib.sha256(body).hexdigest() == pointer.sha256 == stored.store.result(request_id).sha256
    assert int(answer.headers["Content-Length"]) == len(body) == pointer.size
    assert answer.headers["ETag"] == f'"sha256:{pointer.sha256}"'
    assert answer.headers["Accept-Ranges"] == "bytes" and answer.headers["X-Comfy-Cost-State"] == "charged"
    assert answer.get_json()["candidates"][0]["finishReason"] == "STOP"


@pytest.mark.parametrize("size", [TWO_MB, 0], ids=["object", "inline"])
def test_etag_answers_304_and_ranges_206_or_416_on_every_result(stored, workspace, http, auth, size):
    request_id = generated(stored, workspace, f"ranges [stub:size={size}]" if size else "ranges, inline")
    whole = http.get(url_of(request_id), headers=auth)
    body, tag = whole.get_data(), whole.headers["ETag"]
    assert tag == f'"sha256:{hashlib.sha256(body).hexdigest()}"'
    same = http.get(url_of(request_id), headers={**auth, "If-None-Match": tag})
    assert (same.status_code, same.get_data(), same.headers["ETag"]) == (304, b"", tag)
    assert http.get(url_of(request_id), headers={**auth, "If-None-Match": '"sha256:00"'}).status_code == 200
    part = http.get(url_of(request_id), headers={**auth, "Range": "bytes=100-299"})
    assert (part.status_code, part.get_data()) == (206, body[100:300])
    assert part.headers["Content-Range"] == f"bytes 100-299/{len(body)}" and part.headers["Content-Length"] == "200"
    tail = http.get(url_of(request_id), headers={**auth, "Range": f"bytes={len(body) - 10}-"})
    assert (tail.status_code, tail.get_data()) == (206, body[-10:])
    suffix = http.get(url_of(request_id), headers={**auth, "Range": "bytes=-7"})
    assert suffix.get_data() == body[-7:]
    stale = http.get(url_of(request_id), headers={**auth, "Range": "bytes=0-9", "If-Range": '"sha256:00"'})
    assert (stale.status_code, stale.get_data()) == (200, body)  # the range was for another version: all of it
    beyond = http.get(url_of(request_id), headers={**auth, "Range": f"bytes={len(body)}-"})
    assert beyond.status_code == 416 and beyond.headers["X-Comfy-Error-Type"] == "invalid_input"
    assert beyond.headers["Content-Range"] == f"bytes */{len(body)}"
    assert beyond.get_json()["error_type"] == "invalid_input"


def test_a_corrupted_object_aborts_the_collect_and_is_counted(stored, workspace, http, auth, caplog):
    from router_queue import metrics

    request_id = generated(stored, workspace, f"corrupt me [stub:size={TWO_MB}]")
    pointer = stored.store.result(request_id)
    data = bytearray(stored.blobs.read_all(pointer.key))
    data[TWO_MB // 2] ^= 0xFF  # one bit flipped at rest, same size
    stored.blobs.put(pointer.key, bytes(data), pointer.content_type)
    before = metrics.REGISTRY.get_sample_value("router_queue_result_objects_total", {"event": "sha256_mismatch"})
    answer = http.get(url_of(request_id), headers=auth)
    assert answer.status_code == 200  # the headers left before the digest could be known ...
    received = b""
    with pytest.raises(CorruptResult):  # ... and the body never arrives whole: the connection is cut
        for chunk in answer.response:
            received += chunk
    assert len(received) < pointer.size
    after = metrics.REGISTRY.get_sample_value("router_queue_result_objects_total", {"event": "sha256_mismatch"})
    assert after == before + 1
    assert "does not match" in caplog.text or "collect aborted" in caplog.text


def test_a_deleted_object_reads_as_expired(stored, workspace, http, auth):
    request_id = generated(stored, workspace, f"gone [stub:size={TWO_MB}]")
    stored.blobs.delete([stored.store.result(request_id).key])
    assert http.get(url_of(request_id), headers=auth).status_code == 410


def test_redis_memory_per_finished_request_does_not_grow_with_the_output(stored, workspace):
    """2 MB outputs cost Redis about what 1 KB outputs do (the issue's target:
    at most 1.05x): every key a finished request leaves, summed."""
    def redis_bytes(request_id: str) -> int:
        names = [keys.request(request_id), keys.result(request_id), keys.body(request_id)]
        used = sum(stored.redis.memory_usage(name) or 0 for name in names)
        member = next(m for m in stored.redis.zrange(keys.result_objects("vertexai"), 0, -1)
                      if m.startswith(request_id.encode())) if size == TWO_MB else b""
        return used + (len(member) + 16 if member else 0)  # a zset entry: the member and its score

    if stored.redis.connection_pool.connection_class.__module__.startswith("fakeredis"):
        pytest.skip("MEMORY USAGE needs a real Redis")
    costs = {}
    for size in (1000, TWO_MB):
        request_id = generated(stored, workspace, f"memory [stub:size={size}]")
        costs[size] = redis_bytes(request_id)
    assert costs[TWO_MB] <= 1.05 * costs[1000], costs


def test_settings_default_keeps_64_kib_inline():
    from router_queue.settings import Settings

    assert Settings().result_inline_max_bytes == 65_536
    assert dataclasses.replace(Settings(), object_store_url="file:///x").result_link_s == 300


def test_the_link_is_a_signed_url_where_the_store_signs_else_the_response_url(stored, workspace, http, auth):
    import urllib.request

    request_id = generated(stored, workspace, f"link me [stub:size={TWO_MB}]")
    pointer = stored.store.result(request_id)
    answer = http.get(f"{url_of(request_id)}/link", headers=auth)
    assert answer.status_code == 200
    link = answer.get_json()
    assert {k: link[k] for k in ("size", "content_type", "sha256")} == {
        "size": pointer.size, "content_type": "application/json", "sha256": pointer.sha256}
    if stored.blobs.signs:
        assert link["url"].startswith("http://127.0.0.1:") and "X-Amz-Signature=" in link["url"]
        with urllib.request.urlopen(link["url"]) as download:  # no API key: the signature is the credential
            assert hashlib.sha256(download.read()).hexdigest() == pointer.sha256
    else:
        assert link["url"] == f"{stored.settings.public_base_url}{url_of(request_id)}"
    assert link["expires_at"].endswith("Z")


def test_the_link_answers_like_a_collect_while_running_and_once_failed(stored, workspace, http, auth):
    running, _ = admitted(stored, workspace, GEMINI, gemini("still queued"))
    waiting = http.get(f"{url_of(running)}/link", headers=auth)
    assert waiting.status_code == 202 and waiting.get_json()["status"] == "IN_QUEUE"
    failed, _ = admitted(stored, workspace, GEMINI, gemini("no [stub:reject]"))
    deliver_until_done(context_of(stored), failed)
    refused = http.get(f"{url_of(failed)}/link", headers=auth)
    assert refused.status_code == http.get(url_of(failed), headers=auth).status_code == 422
    assert refused.headers["X-Comfy-Error-Type"] == "invalid_input"
    small = generated(stored, workspace, "a small one, linked")
    inline = http.get(f"{url_of(small)}/link", headers=auth).get_json()
    assert inline["url"].endswith(url_of(small))  # kept in Redis: the response_url is the link
    assert inline["size"] == len(http.get(url_of(small), headers=auth).get_data())


def test_the_sweeper_deletes_an_object_only_once_its_record_has_expired(stored, workspace):
    from workers.sweeper import sweep

    context = context_of(stored)
    request_id = generated(stored, workspace, f"expire me [stub:size={TWO_MB}]")
    pointer = stored.store.result(request_id)
    retention = stored.settings.result_retention_s
    later = time.time() + retention + 5  # past the index's score: the worker's clock says expired
    assert sweep(context, now=later).objects_deleted == 0  # ... but Redis still holds the record
    assert stored.blobs.keys_under(pointers.RESULTS) == [pointer.key]
    (score,) = [s for _, s in stored.redis.zrange(keys.result_objects("vertexai"), 0, -1, withscores=True)]
    assert score > later  # looked at again when the record really expires
    stored.redis.delete(keys.request(request_id))  # as Redis expires it
    assert sweep(context, now=score + 1).objects_deleted == 1
    assert stored.blobs.keys_under(pointers.RESULTS) == []
    assert stored.redis.zcard(keys.result_objects("vertexai")) == 0


def test_the_hourly_pass_deletes_orphans_past_retention_and_nothing_newer(stored):
    from workers.object_expiry import ORPHAN_GRACE_S, expire_objects

    now = time.time()
    retention = stored.settings.result_retention_s
    old = pointers.result_key("crashed-before-complete", now=now - retention - ORPHAN_GRACE_S - 7200)
    recent = pointers.result_key("just-written", now=now - 60)
    for key in (old, recent):
        stored.blobs.put(key, b"orphan", "text/plain")
    assert expire_objects(context_of(stored), now) == (0, 1)
    assert stored.blobs.keys_under(pointers.RESULTS) == [recent]
    stored.blobs.put(old, b"orphan again", "text/plain")
    assert expire_objects(context_of(stored), now) == (0, 0)  # one pass an hour, fleet-wide
