"""The queue routes as a caller sees them: statuses, bodies, headers, buckets."""

from __future__ import annotations

import json
import re

import pytest
from werkzeug.test import Client

from router_queue.store import keys
from router_queue.store.outcomes import Admit
from router_queue.store.requests_values import Admission
from tests.unit.route_support import FLUX, LEASE, assert_error, submit
from tests.unit.support import record_of

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def test_submit_answers_the_handle_with_absolute_urls(http, auth, dispatcher):
    response = submit(http, auth)
    assert response.status_code == 201
    body = response.json
    request_id = body["request_id"]
    assert response.headers["X-Comfy-Request-Id"] == request_id
    assert body["status"] == "IN_QUEUE"
    assert body["queue_position"] == 0
    root = f"http://router.test{FLUX}/requests/{request_id}"
    assert body["status_url"] == f"{root}/status"
    assert body["response_url"] == root
    assert body["cancel_url"] == f"{root}/cancel"
    assert dispatcher.published == [(request_id, "bfl")]


def test_bearer_and_x_api_key_both_authenticate(http, api_key):
    assert submit(http, {"Authorization": f"Bearer {api_key}"}).status_code == 201
    assert submit(http, {"X-API-Key": api_key}).status_code == 201


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "rq_nope"}, {"Authorization": "Bearer "},
                                     {"Authorization": "Basic abc"}, {"X-API-Key": "k" * 5000}])
def test_missing_or_unknown_keys_are_unauthorized(http, headers, dispatcher):
    assert_error(submit(http, headers), 401, "unauthorized")
    assert_error(http.get(f"{FLUX}/requests/x/status", headers=headers), 401, "unauthorized")
    assert dispatcher.published == []


def test_unknown_model_suggests_close_ids(http, auth):
    response = submit(http, auth, path="/v2/models/bfl/flux-2-pr")
    assert_error(response, 404, "model_not_found")
    assert "bfl/flux-2-pro" in response.json["detail"]


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'"text"', b"", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_invalid_input(http, auth, raw, dispatcher):
    assert_error(submit(http, auth, raw=raw), 400, "invalid_input")
    assert dispatcher.published == []


def test_a_schema_violation_answers_the_per_field_detail(http, auth, dispatcher):
    response = submit(http, auth, {"prompt": 5, "width": 10, "colour": "red"})
    assert_error(response, 422, "invalid_input")
    by_loc = {tuple(entry["loc"]): entry for entry in response.json["detail"]}
    assert by_loc[("body", "prompt")]["type"] == "string_type"
    assert by_loc[("body", "width")]["type"] == "out_of_range"
    assert by_loc[("body", "colour")]["type"] == "extra_forbidden"
    assert all(entry["msg"] for entry in response.json["detail"])
    assert dispatcher.published == []


def test_nested_schema_errors_carry_their_path(http, auth):
    body = {"contents": [{"parts": [{"text": 1}]}]}
    response = submit(http, auth, body, path="/v2/models/vertexai/gemini-3.1-flash-image")
    assert_error(response, 422, "invalid_input")
    assert response.json["detail"][0]["loc"] == ["body", "contents", 0, "parts", 0, "text"]


def test_an_oversized_body_is_413(http, auth):
    response = submit(http, auth, {"prompt": "x" * 20_000_000})  # MAX_BODY_BYTES: 20,000,000
    assert_error(response, 413, "invalid_input")


def test_a_workspace_without_queued_delivery_is_not_enabled(http, services, dispatcher):
    workspace = services.accounts.create_workspace("off", queue_enabled=False)
    key = services.accounts.mint_key(workspace)
    assert_error(submit(http, {"X-API-Key": key}), 403, "not_enabled")
    assert dispatcher.published == []


def test_idempotency_key_replays_the_handle_and_refuses_another_body(http, auth, dispatcher):
    first = submit(http, auth, headers={"Idempotency-Key": "abc"})
    again = submit(http, auth, headers={"Idempotency-Key": "abc"})
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["request_id"] == first.json["request_id"]
    assert again.headers["X-Comfy-Request-Id"] == first.json["request_id"]
    assert "Idempotent-Replayed" not in first.headers
    assert_error(submit(http, auth, {"prompt": "another"}, headers={"Idempotency-Key": "abc"}),
                 409, "invalid_input")
    assert len(dispatcher.published) == 1


def test_a_malformed_idempotency_key_is_refused(http, auth):
    assert_error(submit(http, auth, headers={"Idempotency-Key": "k" * 300}), 400, "invalid_input")


@pytest.mark.parametrize("route", ["queued", "synchronous"])
@pytest.mark.parametrize("priority", ["urgent", "HIGH", "", "high "])
def test_an_unknown_priority_is_invalid_input_and_admits_nothing(http, auth, services, priority, route):
    path = f"{FLUX}/requests" if route == "queued" else FLUX
    response = http.post(path, data=json.dumps({"prompt": "p"}),
                         headers={**auth, "Content-Type": "application/json", "X-Comfy-Priority": priority})
    assert_error(response, 400, "invalid_input")
    assert "X-Comfy-Priority" in response.json["detail"]
    assert services.store.queue_depth("bfl") == 0


def test_a_high_priority_request_passes_its_own_workspaces_waiting_ones(http, auth, services):
    services.store.max_in_flight = lambda provider: 1
    normal = [submit(http, auth, {"prompt": f"p{i}"}).json for i in range(3)]
    high = submit(http, auth, {"prompt": "urgent"}, headers={"X-Comfy-Priority": "high"}).json
    assert [n["queue_position"] for n in normal] == [0, 1, 2]
    assert high["queue_position"] == 1  # behind the one granted the slot, ahead of the other two
    assert [http.get(f"{FLUX}/requests/{n['request_id']}/status", headers=auth).json["queue_position"]
            for n in normal] == [0, 2, 3]
    assert services.redis.hget(keys.request(high["request_id"]), "priority") == b"high"


def test_status_reports_queue_position_times_and_retry_after(http, auth, services):
    ids = [submit(http, auth, {"prompt": f"p{i}"}).json["request_id"] for i in range(3)]
    response = http.get(f"{FLUX}/requests/{ids[2]}/status", headers=auth)
    assert response.status_code == 200
    body = response.json
    assert (body["status"], body["queue_position"]) == ("IN_QUEUE", 2)
    assert ISO.match(body["created_at"])
    assert "started_at" not in body and "error_type" not in body
    assert int(response.headers["Retry-After"]) >= 1

    services.store.claim(record_of(services, ids[0], "bfl"), LEASE)
    running = http.get(f"{FLUX}/requests/{ids[0]}/status", headers=auth)
    assert (running.json["status"], running.json["queue_position"]) == ("IN_PROGRESS", 0)
    assert ISO.match(running.json["started_at"])
    assert http.get(f"{FLUX}/requests/{ids[2]}/status", headers=auth).json["queue_position"] == 1


@pytest.mark.parametrize("outcome", ["success", "provider_error"])
def test_status_carries_progress_from_its_first_report_and_it_never_falls(http, auth, services, outcome):
    request_id = submit(http, auth).json["request_id"]
    url = f"{FLUX}/requests/{request_id}/status"
    assert "progress" not in http.get(url, headers=auth).json
    services.store.claim(record_of(services, request_id, "bfl"), LEASE)
    assert "progress" not in http.get(url, headers=auth).json  # the provider has said nothing yet
    services.store.record_progress(request_id, LEASE.token, 0.4)
    assert http.get(url, headers=auth).json["progress"] == 0.4
    services.store.record_progress(request_id, LEASE.token, 0.3)
    assert http.get(url, headers=auth).json["progress"] == 0.4
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json",
                            error_type="" if outcome == "success" else outcome)
    finished = http.get(url, headers=auth).json
    assert finished["status"] == "COMPLETED"
    assert finished["progress"] == (1.0 if outcome == "success" else 0.4)


@pytest.mark.parametrize("outcome", ["success", "provider_error", "cancelled"])
def test_a_completed_status_says_nothing_to_wait_for_and_a_fast_success_is_whole(http, auth, services, outcome):
    """A request the provider finished before it ever reported progress is
    still at 1 when it succeeded, and every finished request names
    ``Retry-After: 0``: the contract's status read always carries the hint,
    and there is nothing to wait for."""
    request_id = submit(http, auth).json["request_id"]
    url = f"{FLUX}/requests/{request_id}/status"
    if outcome == "cancelled":
        assert http.put(f"{FLUX}/requests/{request_id}/cancel", headers=auth).status_code == 202
    else:
        services.store.claim(record_of(services, request_id, "bfl"), LEASE)
        services.store.complete(record_of(services, request_id, "bfl"), output=b"{}",
                                content_type="application/json", error_type="" if outcome == "success" else outcome)
    finished = http.get(url, headers=auth)
    assert finished.json["status"] == "COMPLETED"
    assert finished.headers["Retry-After"] == "0"
    if outcome == "success":
        assert finished.json["progress"] == 1.0
    else:
        assert "progress" not in finished.json


def test_result_is_202_while_unfinished_then_the_native_bytes(http, auth, services):
    request_id = submit(http, auth).json["request_id"]
    pending = http.get(f"{FLUX}/requests/{request_id}", headers=auth)
    assert pending.status_code == 202
    assert pending.json["status"] == "IN_QUEUE"
    assert int(pending.headers["Retry-After"]) >= 1

    services.store.claim(record_of(services, request_id, "bfl"), LEASE)
    native = b'{"id":"t","status":"Ready","result":{"sample":"https://x/y.jpeg"}}'
    services.store.complete(record_of(services, request_id, "bfl"), output=native, content_type="application/json")
    done = http.get(f"{FLUX}/requests/{request_id}", headers=auth)
    assert done.status_code == 200
    assert done.get_data() == native
    assert done.headers["Content-Type"] == "application/json"
    status = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json
    assert status["status"] == "COMPLETED"
    assert "error_type" not in status and "queue_position" not in status
    assert ISO.match(status["completed_at"]) and ISO.match(status["expires_at"])


def test_raw_bytes_come_back_under_the_providers_content_type(http, auth, services):
    path = "/v2/models/openai/gpt-4o-mini-tts"
    request_id = submit(http, auth, {"input": "hi", "voice": "alloy"}, path=path).json["request_id"]
    services.store.claim(record_of(services, request_id, "openai"), LEASE)
    services.store.complete(record_of(services, request_id, "openai"), output=b"ID3\x04\x00\xff\x00", content_type="audio/mpeg")
    done = http.get(f"{path}/requests/{request_id}", headers=auth)
    assert (done.status_code, done.headers["Content-Type"], done.get_data()) == (200, "audio/mpeg",
                                                                                 b"ID3\x04\x00\xff\x00")


@pytest.mark.parametrize("bucket,status", [("content_policy_violation", 400), ("provider_error", 502),
                                           ("provider_timeout", 504), ("invalid_input", 422)])
def test_a_failed_request_answers_its_bucket(http, auth, services, bucket, status):
    request_id = submit(http, auth).json["request_id"]
    services.store.claim(record_of(services, request_id, "bfl"), LEASE)
    services.store.complete(record_of(services, request_id, "bfl"), error_type=bucket, detail="what went wrong")
    assert_error(http.get(f"{FLUX}/requests/{request_id}", headers=auth), status, bucket)
    body = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json
    assert (body["status"], body["error_type"], body["detail"]) == ("COMPLETED", bucket, "what went wrong")


def test_cancel_of_a_queued_request_then_of_a_finished_one(http, auth):
    request_id = submit(http, auth).json["request_id"]
    response = http.put(f"{FLUX}/requests/{request_id}/cancel", headers=auth)
    assert response.status_code == 202
    assert response.json["status"] == "CANCELLATION_REQUESTED"
    status = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json
    assert (status["status"], status["error_type"]) == ("COMPLETED", "cancelled")
    assert_error(http.get(f"{FLUX}/requests/{request_id}", headers=auth), 409, "cancelled")
    again = http.put(f"{FLUX}/requests/{request_id}/cancel", headers=auth)
    assert again.status_code == 409
    assert again.json["status"] == "ALREADY_COMPLETED"
    assert again.headers["X-Comfy-Error-Type"] == "already_completed"


def test_other_workspaces_ids_look_exactly_like_unknown_ones(http, auth, services):
    request_id = submit(http, auth).json["request_id"]
    stranger = services.accounts.mint_key(services.accounts.create_workspace("eve", queue_enabled=True))
    unknown = services.ids.mint("ws_nobody", "bfl/flux-2-pro")
    answers = []
    for path, headers in [
        (f"{FLUX}/requests/{request_id}", {"X-API-Key": stranger}),
        (f"/v2/models/vertexai/gemini-3.1-flash-image/requests/{request_id}", auth),
        (f"{FLUX}/requests/{unknown}", auth),
        (f"{FLUX}/requests/not-an-id", auth),
        (f"{FLUX}/requests/{'a' * 300}", auth),
    ]:
        for suffix, method in (("/status", http.get), ("", http.get), ("/cancel", http.put)):
            response = method(path + suffix, headers=headers)
            assert_error(response, 404, "request_not_found")
            answers.append(response.get_data())
    assert len(set(answers)) == 1
    assert http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json["status"] == "IN_QUEUE"


def test_a_request_past_retention_is_gone_for_good(http, auth, services):
    request_id = submit(http, auth).json["request_id"]
    services.redis.delete(keys.request(request_id), keys.result(request_id))  # what expiry does
    for response in (http.get(f"{FLUX}/requests/{request_id}/status", headers=auth),
                     http.get(f"{FLUX}/requests/{request_id}", headers=auth),
                     http.put(f"{FLUX}/requests/{request_id}/cancel", headers=auth)):
        assert response.status_code == 410
        assert "X-Comfy-Error-Type" not in response.headers
        assert response.headers["X-Comfy-Request-Id"]
    stranger = services.accounts.mint_key(services.accounts.create_workspace("eve", queue_enabled=True))
    assert_error(http.get(f"{FLUX}/requests/{request_id}/status", headers={"X-API-Key": stranger}),
                 404, "request_not_found")


def test_unknown_routes_and_methods_answer_in_the_contract_shape(http, auth):
    assert_error(http.get("/nowhere", headers=auth), 404, "model_not_found")
    assert_error(http.delete(f"{FLUX}/requests", headers=auth), 405, "invalid_input")


def test_redis_down_is_503_service_unavailable(http, auth, services, request):
    if request.node.callspec.params["client"] != "fakeredis":
        pytest.skip("simulated with fakeredis")
    services.redis.connection_pool.connection_kwargs["server"].connected = False
    response = submit(http, {"X-API-Key": "rq_uncached"})
    assert_error(response, 503, "service_unavailable")
    assert int(response.headers["Retry-After"]) >= 1


def test_a_keyed_submit_the_store_does_not_answer_is_in_doubt_not_503(http, app, services, request):
    """With an Idempotency-Key a submit is about the key: an earlier send of it
    may have been admitted while its answer was lost, and a store that does
    not answer cannot say it was not. The key's in-doubt 409, which a resend
    settles, on the lane and on Flask's path alike; without a key, 503."""
    if request.node.callspec.params["client"] != "fakeredis":
        pytest.skip("simulated with fakeredis")
    services.redis.connection_pool.connection_kwargs["server"].connected = False
    for client in (http, Client(app.wsgi_app.flask)):  # the lane, then Flask alone
        keyed = submit(client, {"X-API-Key": "rq_uncached"}, headers={"Idempotency-Key": "k-down"})
        assert_error(keyed, 409, "concurrency_limit_exceeded")
        assert int(keyed.headers["Retry-After"]) >= 1
        assert_error(submit(client, {"X-API-Key": "rq_uncached"}), 503, "service_unavailable")
    status = http.get(f"{FLUX}/requests/x/status", headers={"X-API-Key": "rq_uncached", "Idempotency-Key": "k"})
    assert_error(status, 503, "service_unavailable")  # only a submit is about a key


def test_a_full_redis_is_503_with_retry_after_and_readiness_says_why(http, auth, services, request):
    """At ``maxmemory`` under noeviction Redis refuses every write
    (OutOfMemoryError): the contract's 503, never a 500, and nothing admitted."""
    if request.node.callspec.params["client"] != "redis":
        pytest.skip("a real Redis's maxmemory")
    queued = submit(http, auth, {"prompt": "before it filled"}).json["request_id"]
    limit = services.redis.config_get("maxmemory")["maxmemory"]
    services.redis.config_set("maxmemory", 1)
    try:
        refused = submit(http, auth, {"prompt": "while it is full"})
        cancel = http.put(f"{FLUX}/requests/{queued}/cancel", headers=auth)
        status = http.get(f"{FLUX}/requests/{queued}/status", headers=auth)
        ready = http.get("/readyz")
    finally:
        services.redis.config_set("maxmemory", limit)
    assert_error(refused, 503, "service_unavailable")
    assert int(refused.headers["Retry-After"]) >= 5
    assert_error(cancel, 503, "service_unavailable")
    assert status.status_code in (200, 503), status.get_data(as_text=True)
    assert_error(ready, 503, "service_unavailable")
    assert "full" in ready.json["detail"]
    assert services.store.queue_depth("bfl") == 1
    assert http.get(f"{FLUX}/requests/{queued}/status", headers=auth).json["status"] == "IN_QUEUE"
    assert http.get("/readyz").status_code == 200


def test_a_key_whose_first_request_is_still_being_admitted_is_409_with_retry_after(http, auth, services,
                                                                                   monkeypatch):
    """A split store's admission is two steps (store/admission.py): a resend of its
    Idempotency-Key between them is the contract's 409, never an id that may not exist."""
    monkeypatch.setattr(services.store, "admit", lambda *_, **__: Admission(Admit.ADMITTING))
    response = submit(http, auth, headers={"Idempotency-Key": "k-1"})
    assert_error(response, 409, "concurrency_limit_exceeded")
    assert int(response.headers["Retry-After"]) >= 1


def test_a_write_that_reaches_redis_too_late_answers_503_and_takes_no_effect(http, auth, services, monkeypatch):
    queued = submit(http, auth, {"prompt": "before"}).json["request_id"]
    monkeypatch.setattr(services.store, "_deadline", lambda now: repr(now - 1))  # as if Redis stalled past it
    late = submit(http, auth, {"prompt": "during a stall"})
    assert_error(late, 503, "service_unavailable")
    assert int(late.headers["Retry-After"]) >= 1
    assert_error(http.put(f"{FLUX}/requests/{queued}/cancel", headers=auth), 503, "service_unavailable")
    monkeypatch.undo()
    assert services.store.queue_depth("bfl") == 1
    assert http.get(f"{FLUX}/requests/{queued}/status", headers=auth).json["status"] == "IN_QUEUE"
