"""The wire contract (docs/API.md) with plain ``requests`` against gunicorn.

The seed's cURL walkthrough first, then the details: headers on every answer,
result and cancel semantics, the indistinguishable 404s, queue positions,
idempotency, malformed bodies, timestamps, and the 410 after retention: API.md's
"Routes", "Status", "Headers", "Errors", "Idempotency" and "Billing,
retention, limits".
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta

import pytest
import requests

from router_queue.settings import Settings
from router_queue.store import keys
from tests.object_stores import BUCKET

from .harness import (
    FLUX,
    GEMINI,
    TTS,
    ApiClient,
    Stub,
    broker_drained,
    forget_pace,
    saturated_worker,
    unique_prompt,
    wait_for,
)

JSON = "application/json"
#: MAX_BODY_BYTES as the stack runs it (the default: the harness does not set it).
MAX_BODY_BYTES = Settings.max_body_bytes
RETENTION_S = 86_400  # RESULT_RETENTION_SECONDS default: the stack does not set it


def _retry_after(response: requests.Response, *, least: int = 1) -> int:
    raw = response.headers.get("Retry-After")
    assert raw is not None, f"no Retry-After on {response.request.method} {response.url}"
    assert raw.isdigit(), f"Retry-After is not whole seconds: {raw!r}"
    assert int(raw) >= least
    return int(raw)


def _assert_error(response: requests.Response, status: int, bucket: str) -> dict:
    """An error answer: status, bucket in body and header, request id header."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith(JSON)
    body = response.json()
    assert body["error_type"] == bucket
    assert response.headers.get("X-Comfy-Error-Type") == bucket
    assert response.headers.get("X-Comfy-Request-Id")
    assert "detail" in body
    return body


def _iso(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    assert parsed.tzinfo is not None, f"{value!r} carries no UTC offset"
    return parsed


# -- the seed's walkthrough ----------------------------------------------------------


def test_curl_walkthrough(caller: ApiClient) -> None:
    prompt = unique_prompt("a red teapot on a windowsill, morning light", "[stub:latency=1]")
    submitted = requests.post(
        caller.url(FLUX), data=json.dumps({"prompt": prompt}),
        headers={"X-API-Key": caller.api_key, "Idempotency-Key": str(uuid.uuid4()), "Content-Type": JSON},
        timeout=10,
    )

    assert submitted.status_code == 201, submitted.text
    handle = submitted.json()
    request_id = handle["request_id"]
    assert submitted.headers["X-Comfy-Request-Id"] == request_id
    assert handle["status"] == "IN_QUEUE"
    assert isinstance(handle["queue_position"], int) and handle["queue_position"] >= 0
    root = f"{caller.base_url}/v2/models/{FLUX}/requests/{request_id}"
    assert handle["status_url"] == f"{root}/status"
    assert handle["response_url"] == root
    assert handle["cancel_url"] == f"{root}/cancel"

    auth = {"X-API-Key": caller.api_key}
    early = requests.get(handle["response_url"], headers=auth, timeout=10)
    assert early.status_code == 202, early.text
    assert early.json()["request_id"] == request_id
    assert early.json()["status"] in ("IN_QUEUE", "IN_PROGRESS")
    _retry_after(early)

    def completed() -> dict | None:
        status = requests.get(handle["status_url"], headers=auth, timeout=10)
        assert status.status_code == 200
        if status.json()["status"] == "COMPLETED":
            assert status.headers["Retry-After"] == "0"  # named, and nothing to wait for
            return status.json()
        _retry_after(status)
        return None

    final = wait_for(completed, what="COMPLETED")
    assert "error_type" not in final

    result = requests.get(handle["response_url"], headers=auth, timeout=10)
    assert result.status_code == 200
    assert result.headers["Content-Type"] == JSON
    assert result.json()["status"] == "Ready"
    assert result.json()["result"]["prompt"] == prompt

    late_cancel = requests.put(handle["cancel_url"], headers=auth, timeout=10)
    assert late_cancel.status_code == 409
    assert late_cancel.json()["status"] == "ALREADY_COMPLETED"
    assert late_cancel.headers.get("X-Comfy-Error-Type", "already_completed") == "already_completed"


# -- headers ---------------------------------------------------------------------------


def test_request_id_header_on_every_answer(caller: ApiClient, other_caller: ApiClient) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("headers")})
    caller.wait_status(FLUX, request_id)
    answers = {
        "status": caller.status(FLUX, request_id),
        "result": caller.result(FLUX, request_id),
        "cancel 409": caller.cancel(FLUX, request_id),
        "401": requests.get(caller.url(FLUX, request_id, "/status"), timeout=10),
        "404 model": caller.status("bfl/nope", request_id),
        "404 request": other_caller.status(FLUX, request_id),
        "404 route": requests.get(f"{caller.base_url}/nowhere", timeout=10),
        "400": requests.post(caller.url(FLUX), data=b"{", headers=caller.headers(), timeout=10),
        "422": caller.submit(FLUX, {"prompt": 5}),
    }
    answers["submit"] = caller.submit(FLUX, {"prompt": unique_prompt("headers again")})
    for name, response in answers.items():
        assert response.headers.get("X-Comfy-Request-Id"), f"{name}: no X-Comfy-Request-Id"
        if response.status_code >= 400 and response.status_code != 409:
            assert response.headers.get("X-Comfy-Error-Type"), f"{name}: no X-Comfy-Error-Type"
        # every one counted against its caller's rate (the keyless ones per address): docs/API.md, "Headers"
        assert response.headers.get("RateLimit-Policy") == '"second";q=2000;w=1', name
        assert re.fullmatch(r'"second";r=\d+;t=[01]', response.headers.get("RateLimit", "")), name
    assert "RateLimit" not in requests.get(f"{caller.base_url}/healthz", timeout=10).headers


@pytest.mark.parametrize("bearer", [False, True], ids=["x-api-key", "authorization-bearer"])
def test_both_key_headers_are_accepted(caller: ApiClient, bearer: bool) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("key header")}, bearer=bearer)

    assert caller.status(FLUX, request_id, bearer=bearer).status_code == 200
    assert caller.result(FLUX, request_id, bearer=bearer).status_code in (200, 202)


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "rq_wrong"}, {"Authorization": "Bearer rq_wrong"},
                                     {"Authorization": "Basic dXNlcjpwYXNz"}],
                         ids=["none", "wrong-x-api-key", "wrong-bearer", "basic"])
def test_missing_or_wrong_key_is_401(caller: ApiClient, headers: dict[str, str]) -> None:
    response = requests.post(caller.url(FLUX), json={"prompt": unique_prompt("no key")}, headers=headers,
                             timeout=10)
    _assert_error(response, 401, "unauthorized")


# -- status, result, cancel -------------------------------------------------------------------


def test_status_timestamps_and_retry_after_through_the_lifecycle(caller: ApiClient) -> None:
    with saturated_worker(caller):
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("timestamps", "[stub:latency=1]")})
        queued = caller.status(FLUX, request_id)
        _retry_after(queued)
        body = queued.json()
        assert body["status"] == "IN_QUEUE"
        assert body["queue_position"] == 0
        created = _iso(body["created_at"])
        assert not {"started_at", "completed_at", "expires_at", "error_type", "detail"} & body.keys()

    running = caller.wait_status(FLUX, request_id, "IN_PROGRESS")
    assert running["queue_position"] == 0
    started = _iso(running["started_at"])
    assert "completed_at" not in running and "error_type" not in running
    _retry_after(caller.status(FLUX, request_id))

    done = caller.wait_status(FLUX, request_id)
    assert _retry_after(caller.status(FLUX, request_id), least=0) == 0
    assert done["progress"] == 1.0
    assert "queue_position" not in done
    assert "error_type" not in done and "detail" not in done
    assert _iso(done["created_at"]) == created and _iso(done["started_at"]) == started
    completed = _iso(done["completed_at"])
    assert created <= started <= completed
    assert _iso(done["expires_at"]) - completed == timedelta(seconds=RETENTION_S)


def test_result_of_raw_bytes_model_is_the_native_bytes(caller: ApiClient, stub: Stub) -> None:
    body = {"input": unique_prompt("bytes over http"), "voice": "nova", "response_format": "wav"}
    request_id = caller.submit_ok(TTS, body)
    caller.wait_status(TTS, request_id)

    result = caller.result(TTS, request_id)

    assert result.status_code == 200
    assert result.headers["Content-Type"] == "audio/wav"
    direct = requests.post(f"{stub.base_url}/v1/audio/speech", json={"model": "gpt-4o-mini-tts", **body},
                           headers={"Authorization": "Bearer stub"}, timeout=10)
    assert result.content == direct.content
    assert result.content.startswith(b"RIFF")


def _body_for(model: str, text: str) -> dict:
    if model == GEMINI:
        return {"contents": [{"role": "user", "parts": [{"text": text}]}]}
    if model == TTS:
        return {"input": text, "voice": "alloy"}
    return {"prompt": text}


@pytest.mark.parametrize(("model", "directive", "status", "bucket"), [
    (FLUX, "[stub:refuse]", 400, "content_policy_violation"),
    (FLUX, "[stub:reject]", 422, "invalid_input"),
    (FLUX, "[stub:status=500]", 502, "provider_error"),
    (GEMINI, "[stub:refuse]", 400, "content_policy_violation"),
    (GEMINI, "[stub:reject]", 422, "invalid_input"),
    (TTS, "[stub:refuse]", 400, "content_policy_violation"),
    (TTS, "[stub:reject]", 422, "invalid_input"),
])
def test_failed_result_is_an_error_response(caller: ApiClient, model: str, directive: str, status: int,
                                            bucket: str) -> None:
    request_id = caller.submit_ok(model, _body_for(model, unique_prompt("failed result", directive)))
    final = caller.wait_status(model, request_id)
    assert final["error_type"] == bucket
    assert isinstance(final["detail"], str)

    _assert_error(caller.result(model, request_id), status, bucket)


def test_cancel_of_a_queued_request(caller: ApiClient, stub: Stub, services) -> None:
    body = {"prompt": unique_prompt("cancel while queued")}
    with saturated_worker(caller):
        request_id = caller.submit_ok(FLUX, body)
        assert caller.status_body(FLUX, request_id)["status"] == "IN_QUEUE"

        cancel = caller.cancel(FLUX, request_id)

        assert cancel.status_code == 202, cancel.text
        assert cancel.json()["status"] == "CANCELLATION_REQUESTED"
        assert cancel.json()["request_id"] == request_id
        assert cancel.headers["X-Comfy-Request-Id"]
        final = caller.status_body(FLUX, request_id)  # a queued request is cancelled at once
        assert final["status"] == "COMPLETED"
        assert final["error_type"] == "cancelled"
        assert "started_at" not in final
        _assert_error(caller.result(FLUX, request_id), 409, "cancelled")
        assert caller.cancel(FLUX, request_id).status_code == 409

    # Its message is still in the broker: once the worker frees up it is dropped, never run.
    wait_for(lambda: broker_drained(services, "bfl"), what="the cancelled request's delivery consumed")
    assert stub.submits("bfl_submit", body) == 0
    assert caller.status_body(FLUX, request_id)["error_type"] == "cancelled"


def test_cancel_of_a_running_request(caller: ApiClient) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("cancel running", "[stub:latency=30]")})
    caller.wait_status(FLUX, request_id, "IN_PROGRESS")

    cancel = caller.cancel(FLUX, request_id)

    assert cancel.status_code == 202
    assert cancel.json()["status"] == "CANCELLATION_REQUESTED"
    final = caller.wait_status(FLUX, request_id, timeout_s=10)
    assert final["error_type"] == "cancelled"
    assert "started_at" in final


def test_another_workspace_cannot_cancel(caller: ApiClient, other_caller: ApiClient) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("not yours", "[stub:latency=1]")})

    _assert_error(other_caller.cancel(FLUX, request_id), 404, "request_not_found")
    _assert_error(caller.cancel(GEMINI, request_id), 404, "request_not_found")

    final = caller.wait_status(FLUX, request_id)
    assert "error_type" not in final
    assert caller.result(FLUX, request_id).status_code == 200


def test_request_not_found_is_indistinguishable(caller: ApiClient, other_caller: ApiClient, services) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("indistinguishable")})
    caller.wait_status(FLUX, request_id)
    probes = {
        "unknown id": (caller, FLUX, str(uuid.uuid4())),
        "unknown id shaped like ours": (caller, FLUX, services.ids.mint("ws_nobody", FLUX)),
        "malformed id": (caller, FLUX, "not-a-request-id"),
        "right id, wrong model": (caller, GEMINI, request_id),
        "another workspace's id": (other_caller, FLUX, request_id),
    }
    bodies = {}
    for name, (who, model, rid) in probes.items():
        for route in (who.status, who.result, who.cancel):
            response = route(model, rid)
            bodies[(name, route.__name__)] = _assert_error(response, 404, "request_not_found")
    assert len({json.dumps(b, sort_keys=True) for b in bodies.values()}) == 1, bodies


def test_unknown_model_is_model_not_found(caller: ApiClient) -> None:
    body = _assert_error(caller.submit("bfl/flux-2-pr0", {"prompt": "x"}), 404, "model_not_found")
    assert "bfl/flux-2-pro" in body["detail"]  # the close id is suggested


def test_queue_positions_count_down_and_never_go_up(caller: ApiClient, services) -> None:
    count = 4
    with saturated_worker(caller) as running_ids:
        forget_pace(services)  # nothing can complete while saturated: the pace stays at its defaults
        running = caller.status(FLUX, running_ids[0])
        handles = [caller.submit(FLUX, {"prompt": unique_prompt(f"queued {n}")}) for n in range(count)]
        ids = [h.json()["request_id"] for h in handles]
        assert [h.json()["queue_position"] for h in handles] == list(range(count))

        reads = [caller.status(FLUX, rid) for rid in ids]
        assert [r.json()["queue_position"] for r in reads] == list(range(count))
        hints = [_retry_after(r) for r in reads]
        assert hints == sorted(hints), f"Retry-After shrinks towards the back of the queue: {hints}"
        assert hints[-1] > _retry_after(running), "the back of the queue is told to wait no longer than a run"

        assert caller.cancel(FLUX, ids[1]).status_code == 202
        after = [caller.status_body(FLUX, rid) for rid in (ids[0], ids[2], ids[3])]
        assert [b["queue_position"] for b in after] == [0, 1, 2]
        last = {rid: b["queue_position"] for rid, b in zip((ids[0], ids[2], ids[3]), after)}

    # Released: every one moves forward only, positions never up, status never back.
    order = {"IN_QUEUE": 0, "IN_PROGRESS": 1, "COMPLETED": 2}
    seen = {rid: "IN_QUEUE" for rid in last}

    def all_completed() -> bool:
        for rid in last:
            body = caller.status_body(FLUX, rid)
            assert order[body["status"]] >= order[seen[rid]], (rid, seen[rid], body)
            seen[rid] = body["status"]
            if body["status"] == "IN_QUEUE":
                assert body["queue_position"] <= last[rid], (rid, last[rid], body)
                last[rid] = body["queue_position"]
        return all(s == "COMPLETED" for s in seen.values())

    wait_for(all_completed, interval_s=0.05, what="queued requests COMPLETED")


# -- idempotency -----------------------------------------------------------------------


def test_idempotency_key_replays_the_original(caller: ApiClient, other_caller: ApiClient, stub: Stub) -> None:
    key = str(uuid.uuid4())
    body = {"prompt": unique_prompt("idempotent")}
    first = caller.submit(FLUX, body, headers={"Idempotency-Key": key})
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    request_id = first.json()["request_id"]

    again = caller.submit(FLUX, body, headers={"Idempotency-Key": key})

    assert again.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json()["request_id"] == request_id
    assert again.headers["X-Comfy-Request-Id"] == request_id
    caller.wait_status(FLUX, request_id)
    after_completion = caller.submit(FLUX, body, headers={"Idempotency-Key": key})
    assert after_completion.status_code == 201
    assert after_completion.json()["request_id"] == request_id
    assert after_completion.headers.get("Idempotent-Replayed") == "true"
    assert stub.submits("bfl_submit", body) == 1

    elsewhere = other_caller.submit(FLUX, body, headers={"Idempotency-Key": key})  # keys are per workspace
    assert elsewhere.status_code == 201
    assert elsewhere.json()["request_id"] != request_id
    assert "Idempotent-Replayed" not in elsewhere.headers

    other_body = caller.submit(FLUX, {"prompt": unique_prompt("another body")}, headers={"Idempotency-Key": key})
    _assert_error(other_body, 409, "invalid_input")
    other_model = caller.submit(GEMINI,
                                {"contents": [{"parts": [{"text": "x"}]}]}, headers={"Idempotency-Key": key})
    _assert_error(other_model, 409, "invalid_input")


def test_concurrent_submits_under_one_key_make_one_request(caller: ApiClient, stub: Stub) -> None:
    key = str(uuid.uuid4())
    body = {"prompt": unique_prompt("racing submits")}
    barrier = threading.Barrier(8)

    def submit(_: int) -> requests.Response:
        barrier.wait()
        return requests.post(caller.url(FLUX), json=body, headers=caller.headers({"Idempotency-Key": key}),
                             timeout=10)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(submit, range(8)))

    assert {a.status_code for a in answers} <= {201, 409}
    created = [a for a in answers if a.status_code == 201]
    for other in (a for a in answers if a.status_code == 409):  # still being admitted: retry later
        _assert_error(other, 409, "concurrency_limit_exceeded")
        _retry_after(other)
    assert len({a.json()["request_id"] for a in created}) == 1
    assert sum(a.headers.get("Idempotent-Replayed") != "true" for a in created) == 1
    caller.wait_status(FLUX, created[0].json()["request_id"])
    assert stub.submits("bfl_submit", body) == 1


def test_a_refused_submit_releases_its_key(caller: ApiClient) -> None:
    key = str(uuid.uuid4())
    refused = caller.submit(FLUX, {"prompt": 5}, headers={"Idempotency-Key": key})
    _assert_error(refused, 422, "invalid_input")

    accepted = caller.submit(FLUX, {"prompt": unique_prompt("after a 422")}, headers={"Idempotency-Key": key})

    assert accepted.status_code == 201
    assert "Idempotent-Replayed" not in accepted.headers


# -- bodies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'["prompt"]', b'"a string"', b"42", b"null"],
                         ids=["broken", "empty", "not-utf8", "array", "string", "number", "null"])
def test_a_body_that_is_not_a_json_object_is_400(caller: ApiClient, raw: bytes) -> None:
    response = requests.post(caller.url(FLUX), data=raw, headers=caller.headers({"Content-Type": JSON}), timeout=10)
    _assert_error(response, 400, "invalid_input")


def test_schema_violation_is_422_with_per_field_detail(caller: ApiClient) -> None:
    body = _assert_error(caller.submit(FLUX, {"prompt": 5, "colour": "red"}), 422, "invalid_input")

    by_loc = {tuple(entry["loc"]): entry for entry in body["detail"]}
    assert by_loc[("body", "prompt")]["type"] == "string_type"
    assert by_loc[("body", "colour")]["type"] == "extra_forbidden"
    assert all(isinstance(entry["msg"], str) and entry["msg"] for entry in body["detail"])


def test_a_body_over_the_limit_is_413(caller: ApiClient) -> None:
    big = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()
    response = requests.post(caller.url(FLUX), data=big, headers=caller.headers({"Content-Type": JSON}), timeout=10)
    _assert_error(response, 413, "invalid_input")


def test_a_chunked_body_over_the_limit_is_413(caller: ApiClient) -> None:
    head = json.dumps({"prompt": unique_prompt("padded past the limit")}).encode()

    def chunks():
        yield head
        for _ in range(MAX_BODY_BYTES // 65536 + 1):  # past the limit in insignificant whitespace
            yield b" " * 65536

    response = requests.post(caller.url(FLUX), data=chunks(), headers=caller.headers({"Content-Type": JSON}),
                             timeout=10)
    _assert_error(response, 413, "invalid_input")


# -- retention -------------------------------------------------------------------------------


def test_past_retention_is_410_for_the_owner_and_404_for_others(caller: ApiClient, other_caller: ApiClient,
                                                                services) -> None:
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("expires")})
    caller.wait_status(FLUX, request_id)
    assert caller.result(FLUX, request_id).status_code == 200
    # What Redis does when the retention TTL runs out.
    assert services.redis.delete(keys.request(request_id), keys.result(request_id)) == 2

    for route in (caller.status, caller.result, caller.cancel):
        gone = route(FLUX, request_id)
        assert gone.status_code == 410, (route.__name__, gone.status_code, gone.text)
        assert "X-Comfy-Error-Type" not in gone.headers
        assert gone.headers.get("X-Comfy-Request-Id")
    for route in (other_caller.status, other_caller.result, other_caller.cancel):
        _assert_error(route(FLUX, request_id), 404, "request_not_found")
    _assert_error(caller.status(GEMINI, request_id), 404, "request_not_found")


# -- outputs of a real size, from the object store ------------------------------------


def test_a_2_mb_output_is_collected_from_the_object_store_byte_for_byte(caller: ApiClient, stack, s3) -> None:
    """Through gunicorn's gevent workers and a real S3 server: the output is
    streamed back whole, under its ETag; ranges resume it; the link downloads
    it without the key; and Redis holds a pointer, not the bytes."""
    import hashlib

    body = {"contents": [{"parts": [{"text": f"a real size {unique_prompt('big')} [stub:size=2000000]"}]}]}
    request_id = caller.submit_ok(GEMINI, body)
    caller.wait_status(GEMINI, request_id)
    whole = caller.result(GEMINI, request_id)
    assert whole.status_code == 200 and whole.headers["Content-Type"].startswith(JSON)
    digest = hashlib.sha256(whole.content).hexdigest()
    assert whole.headers["ETag"] == f'"sha256:{digest}"' and int(whole.headers["Content-Length"]) == len(whole.content)
    image = whole.json()["candidates"][0]["content"]["parts"][0]["inlineData"]["data"]
    assert len(image) > 2_600_000  # 2 MB decoded, base64
    assert stack.services.redis.get(keys.result(request_id)) is None  # Redis keeps only the pointer
    assert any(key.endswith(request_id) or request_id in key for key in s3.keys("session-stack/results/"))
    part = caller.session.get(caller.url(GEMINI, request_id), timeout=10,
                              headers=caller.headers({"Range": "bytes=1000000-"}))
    assert part.status_code == 206 and part.content == whole.content[1_000_000:]
    same = caller.session.get(caller.url(GEMINI, request_id), timeout=10,
                              headers=caller.headers({"If-None-Match": whole.headers["ETag"]}))
    assert same.status_code == 304
    link = caller.session.get(caller.url(GEMINI, request_id, "/link"), headers=caller.headers(), timeout=10).json()
    assert (link["size"], link["sha256"]) == (len(whole.content), digest)
    assert requests.get(link["url"], timeout=10).content == whole.content  # signed: no key sent


def test_a_corrupted_object_cuts_the_connection_short(caller: ApiClient, stack, s3) -> None:
    body = {"contents": [{"parts": [{"text": f"corrupt {unique_prompt('big')} [stub:size=2000000]"}]}]}
    request_id = caller.submit_ok(GEMINI, body)
    caller.wait_status(GEMINI, request_id)
    (key,) = [k for k in s3.keys("session-stack/results/") if request_id in k]
    damaged = bytearray(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    damaged[-100] ^= 0xFF
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=bytes(damaged))
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # fewer bytes than Content-Length, then closed
        assert not caller.result(GEMINI, request_id).content  # never reached: the body is cut short
