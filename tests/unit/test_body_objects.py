"""Issue 33, items 6 and 7: a body over BODY_INLINE_MAX_BYTES is written to
the object store before its 201 and Redis keeps a pointer; the worker gets
the exact bytes; the object goes when its last referrer does. A workspace's
stored bytes count its results too (Redis's and the store's) until they
expire. On one Redis and a split store, fakeredis and a real Redis."""

from __future__ import annotations

import json
import time

import pytest

from router_queue.blobs import pointers
from router_queue.blobs.pointers import BodyPointer
from router_queue.blobs.store import BlobUnavailable, open_blob_store
from router_queue.requests.record import Submission
from router_queue.services import Services
from router_queue.store import keys
from router_queue.web.app import create_app
from tests.unit import delivery_support
from tests.unit.conftest import RecordingDispatcher
from tests.unit.delivery_support import admitted, deliver_until_done
from tests.unit.route_support import LEASE, assert_error, retry, submit
from tests.unit.support import context_of, record_of
from workers.bodies import native_body
from workers.sweeper import sweep

stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)

#: A BFL edit with a 2 MB input_image: over the old 1 MiB MAX_BODY_BYTES.
BIG = {"prompt": "a teapot, as in the picture", "input_image": "A" * 2_000_000}
BIG_RAW = json.dumps(BIG).encode()
GEMINI = "vertexai/gemini-3.1-flash-image"
TWO_MB = 2_000_000


@pytest.fixture(params=[False, True], ids=["one step", "split"])
def services(client, settings, request) -> Services:
    return Services.build(settings, client, dispatcher=RecordingDispatcher(), split=request.param)


@pytest.fixture
def stored(worker_services, tmp_path):
    """The services with an object store (a directory)."""
    worker_services.blobs = open_blob_store(f"file://{tmp_path}/objects")
    return worker_services


@pytest.fixture
def http(stored):
    return create_app(stored.settings, services=stored).test_client()


def objects(services, prefix=pointers.BODIES) -> list[str]:
    return services.blobs.keys_under(prefix)


def pointer_of(services, request_id: str) -> BodyPointer | None:
    return BodyPointer.parse(services.redis.get(keys.body(request_id)))


def test_a_large_body_goes_to_the_store_and_redis_keeps_a_pointer(stored, http, auth, workspace):
    response = submit(http, auth, BIG)
    assert response.status_code == 201, response.get_data(as_text=True)
    request_id = response.json["request_id"]
    pointer = pointer_of(stored, request_id)
    assert pointer is not None and pointer.size == len(BIG_RAW)
    assert stored.redis.strlen(keys.body(request_id)) < 200  # a pointer, not 2 MB
    assert objects(stored) == [pointer.key] and stored.blobs.read_all(pointer.key) == BIG_RAW
    assert stored.accounts.get(workspace).queued_bytes == len(BIG_RAW)  # the body's bytes, wherever kept
    # the worker is handed the exact bytes
    assert native_body(stored.blobs, stored.metrics, request_id, stored.store.load(request_id)[1]) == BIG_RAW
    assert deliver_until_done(context_of(stored), request_id) == "completed"
    assert stored.redis.exists(keys.body(request_id)) == 0
    assert objects(stored) == [pointer.key]  # the sweeper deletes it ...
    sweep(context_of(stored))
    assert objects(stored) == []  # ... once its pointer is gone
    assert stored.redis.zcard(keys.result_objects("bfl")) == 0
    small = submit(http, auth, {"prompt": "a red teapot"}).json["request_id"]  # a small one stays in Redis
    assert stored.redis.get(keys.body(small)) == json.dumps({"prompt": "a red teapot"}).encode()


def test_a_kept_body_is_shared_by_its_retries_and_deleted_once_the_last_referrer_expires(stored, http, auth,
                                                                                           workspace):
    original = submit(http, auth, BIG).json["request_id"]
    store = stored.store
    store.claim(record_of(stored, original, "bfl"), LEASE)
    store.complete(record_of(stored, original, "bfl"), error_type="provider_error", detail="it broke")
    (key,) = objects(stored)
    assert (stored.accounts.get(workspace).stored_bytes, stored.accounts.get(workspace).queued_bytes) \
        == (len(BIG_RAW), 0)
    first = retry(http, auth, original)
    assert first.status_code == 201, first.get_data(as_text=True)
    first_id = first.json["request_id"]
    assert objects(stored) == [key]  # shared, not copied
    assert native_body(stored.blobs, stored.metrics, first_id, store.load(first_id)[1]) == BIG_RAW
    assert sweep(context_of(stored)).objects_deleted == 0  # a retry waits on it
    store.claim(record_of(stored, first_id, "bfl"), LEASE)
    store.complete(record_of(stored, first_id, "bfl"), output=b"{}", content_type="application/json")
    later = time.time() + stored.settings.result_retention_s + 60  # the worker's clock says it expired
    assert sweep(context_of(stored), now=later).objects_deleted == 0  # kept until its pointer expires
    assert objects(stored) == [key]
    assert stored.accounts.get(workspace).stored_bytes == len(BIG_RAW) + 2  # the body once, and the result
    (score,) = [s for _, s in stored.redis.zrange(keys.result_objects("bfl"), 0, -1, withscores=True)]
    assert score > later  # looked at again when the pointer really expires
    stored.redis.delete(keys.body(original))  # as Redis expires it, after the last referrer's retention
    assert sweep(context_of(stored), now=score + 1).objects_deleted == 1
    assert objects(stored) == []


def test_an_admission_refused_after_the_put_deletes_the_object_at_once(stored, http, auth, workspace):
    stored.accounts.set_limits(workspace, max_queued_bytes=len(BIG_RAW) - 1)
    assert_error(submit(http, auth, BIG), 429, "queued_bytes_full")
    assert objects(stored) == []


def test_a_large_body_past_its_callers_rate_is_refused_before_the_store_is_sent_it(stored, http, auth, workspace,
                                                                                     monkeypatch):
    """Its allowance is spent as the call opens: past the rate, 429 and no put,
    whichever path serves it; a small body's allowance stays carried into the script."""
    puts: list[str] = []
    put = stored.blobs.put
    monkeypatch.setattr(stored.blobs, "put", lambda key, *args, **kwargs: (puts.append(key), put(key, *args, **kwargs)))
    stored.accounts.set_limits(workspace, rate_limit="1/minute")
    assert submit(http, auth, BIG).status_code == 201  # the window's one call
    assert len(puts) == 1
    for path in ("/v2/models/bfl/flux-2-pro/requests", "/v2/models/bfl/flux-2-pro"):  # queued; synchronous
        refused = http.post(path, data=BIG_RAW, headers={**auth, "Content-Type": "application/json"})
        assert_error(refused, 429, "rate_limited")
    assert len(puts) == 1 and len(objects(stored)) == 1  # no put for the refused ones


def test_an_unpointed_body_object_is_found_by_the_hourly_pass(stored):
    from workers.object_expiry import ORPHAN_GRACE_S, expire_objects

    now = time.time()
    crashed = BodyPointer.of("crashed-before-admit", b"{}", now=now - ORPHAN_GRACE_S - 7200)
    young = BodyPointer.of("being-admitted", b"{}", now=now - 60)
    for pointer in (crashed, young):
        stored.blobs.put(pointer.key, b"{}", "application/json")
    assert expire_objects(context_of(stored), now) == (0, 1)
    assert objects(stored) == [young.key]


def test_a_live_body_object_survives_the_hourly_pass(stored, workspace):
    from workers.object_expiry import ORPHAN_GRACE_S, expire_objects

    request_id = stored.ids.mint(workspace, "bfl/flux-2-pro")
    old = BodyPointer.of(request_id, BIG_RAW, now=time.time() - ORPHAN_GRACE_S - 7200)
    stored.blobs.put(old.key, BIG_RAW, "application/json")
    outcome = stored.store.admit(Submission(request_id=request_id, workspace=workspace, model="bfl/flux-2-pro",
                                 provider="bfl", body=old.text()))
    assert outcome.outcome == "ADMITTED"
    assert expire_objects(context_of(stored), time.time()) == (0, 0)
    assert objects(stored) == [old.key]


def test_a_store_away_at_admission_answers_503_and_charges_nothing(stored, http, auth, workspace, monkeypatch):
    def away(*args, **kwargs):
        raise BlobUnavailable("put: connection refused")

    monkeypatch.setattr(stored.blobs, "put", away)
    before = stored.accounts.get(workspace)
    response = submit(http, auth, BIG)
    assert_error(response, 503, "service_unavailable")
    assert int(response.headers["Retry-After"]) > 0
    after = stored.accounts.get(workspace)
    assert (after.queued, after.queued_bytes, after.held, after.credits) == (0, 0, before.held, before.credits)
    assert list(stored.redis.scan_iter(match="*:req:*")) == []


def test_bodies_are_accepted_to_the_new_limit_and_refused_past_it(stored, http, auth):
    limit = stored.settings.max_body_bytes
    assert limit == 20_000_000  # Vertex AI Gemini's 20 MB request limit
    prompt = {"prompt": "a teapot", "input_image": ""}
    prompt["input_image"] = "A" * (limit - len(json.dumps(prompt)))
    at_limit = json.dumps(prompt)
    assert len(at_limit) == limit
    response = submit(http, auth, raw=at_limit)
    assert response.status_code == 201, response.get_data(as_text=True)[:300]
    assert_error(submit(http, auth, raw=at_limit + " "), 413, "invalid_input")


def test_validating_a_hostile_body_at_the_limit_stays_bounded(stored, http, auth):
    """Millions of keys are refused from byte counts, before any parse."""
    hostile = "{" + ",".join(f'"k{i}":1' for i in range(1_500_000)) + "}"
    assert len(hostile) < stored.settings.max_body_bytes
    response = submit(http, auth, raw=hostile)
    assert_error(response, 422, "invalid_input")
    assert response.json["detail"][0]["type"] == "too_long"


# -- item 7: results count in the stored bytes -------------------------------------

def gemini(text: str) -> dict:
    return {"contents": [{"parts": [{"text": text}]}]}


def generated(services, workspace, text: str) -> str:
    request_id, _ = admitted(services, workspace, GEMINI, gemini(text))
    assert deliver_until_done(context_of(services), request_id) == "completed"
    return request_id


def result_bytes(services, request_id: str) -> int:
    result = services.store.result(request_id)
    return result.size if isinstance(result, pointers.ResultPointer) else len(result)


@pytest.mark.parametrize("where", ["object store", "redis"])
def test_a_2mb_result_counts_in_stored_bytes_until_it_expires(worker_services, workspace, tmp_path, where):
    services = worker_services
    if where == "object store":
        services.blobs = open_blob_store(f"file://{tmp_path}/objects")
    request_id = generated(services, workspace, f"a big one [stub:size={TWO_MB}]")
    assert isinstance(services.store.result(request_id), pointers.ResultPointer) == (where == "object store")
    size = result_bytes(services, request_id)
    assert size > TWO_MB  # base64 in Vertex's JSON
    assert services.accounts.get(workspace).stored_bytes == size
    past = time.time() + services.settings.result_retention_s + 120  # past the record's expiry (and its minute)
    other = services.ids.mint(workspace, GEMINI)
    assert services.store.admit(Submission(request_id=other, workspace=workspace, model=GEMINI, provider="vertexai",
                                body=json.dumps(gemini("next")), now=past)).outcome == "ADMITTED"
    assert services.accounts.get(workspace).stored_bytes == 0


def test_results_fill_the_quota_then_a_submit_waits_until_they_expire(stored, workspace, auth):
    services = stored
    http = create_app(services.settings, services=services).test_client()
    quota = 2 * TWO_MB
    services.accounts.set_limits(workspace, max_stored_bytes=quota)
    for n in range(2):  # a result is never refused: the second carries the workspace over
        generated(services, workspace, f"result {n} [stub:size={TWO_MB}]")
    assert services.accounts.get(workspace).stored_bytes > quota
    refused = http.post(f"/v2/models/{GEMINI}/requests", data=json.dumps(gemini("more")),
                        headers={**auth, "Content-Type": "application/json"})
    assert_error(refused, 429, "stored_bytes_full")
    assert 0 < int(refused.headers["Retry-After"]) <= 3600
    assert services.accounts.get(workspace).queued == 0  # nothing queued
    past = time.time() + services.settings.result_retention_s + 120
    later = services.ids.mint(workspace, GEMINI)
    assert services.store.admit(Submission(request_id=later, workspace=workspace, model=GEMINI, provider="vertexai",
                                body=json.dumps(gemini("more")), now=past)).outcome == "ADMITTED"
