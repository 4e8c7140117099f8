"""The lane (``web/lane.py``) answers status reads and submits exactly as the
Flask routes do: same status, body and headers, the call counted once, and
everything it does not serve left to Flask before anything was counted."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
import redis
from werkzeug.test import Client

from router_queue.store import keys
from router_queue.store.requests_values import Lease
from tests.unit import route_support
from tests.unit.route_support import FLUX, assert_error, submit
from tests.unit.support import record_of

served_by_flask = route_support.served_by_flask  # a fixture (route_support)

LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)
#: Headers that differ between any two answers: a fresh call id each, the date.
VOLATILE = {"X-Comfy-Request-Id", "Date"}


@pytest.fixture
def flask_only(app) -> Client:
    """The same app with the lane bypassed: Flask's own WSGI callable."""
    return Client(app.wsgi_app.flask)


def _answer(response) -> tuple:
    headers = sorted((k, _counted(k, v)) for k, v in response.headers.items() if k not in VOLATILE)
    return response.status, headers, response.get_data()


def _counted(name: str, value: str) -> str:
    """A header as both paths must answer it: the RateLimit field's figures
    blanked (each call is counted, so the second finds one fewer left)."""
    return re.sub(r";r=\d+;t=\d+", ";r=_;t=_", value) if name == "RateLimit" else value


def test_every_status_answer_matches_the_flask_route(http, flask_only, auth, api_key, services):
    queued, running, done, failed, gone = (submit(http, auth, {"prompt": f"p{i}"}).json["request_id"]
                                           for i in range(5))
    # started long ago, so its Retry-After does not depend on the second the read lands in
    services.store.claim(record_of(services, running, "bfl"), LEASE, now=time.time() - 100)
    for request_id, error in ((done, None), (failed, "provider_error")):
        services.store.claim(record_of(services, request_id, "bfl"), LEASE)
        services.store.complete(record_of(services, request_id, "bfl"), output=b"x", content_type="image/png",
                                error_type=error or "", detail="upstream said no" if error else "")
    services.redis.delete(keys.request(gone), keys.result(gone))
    stranger = services.accounts.mint_key(services.accounts.create_workspace("eve", queue_enabled=True))
    legacy = services.accounts.mint_legacy_key()
    cases = [
        (f"{FLUX}/requests/{queued}/status", auth),
        (f"{FLUX}/requests/{running}/status", {"Authorization": f"Bearer {api_key}"}),
        (f"{FLUX}/requests/{done}/status", auth),
        (f"{FLUX}/requests/{failed}/status", auth),
        (f"{FLUX}/requests/{gone}/status", auth),
        (f"{FLUX}/requests/{queued}/status", {"X-API-Key": stranger}),
        (f"/v2/models/vertexai/gemini-3.1-flash-image/requests/{queued}/status", auth),
        (f"/v2/models/bfl/no-such-model/requests/{queued}/status", auth),
        (f"{FLUX}/requests/not-an-id/status", auth),
        (f"{FLUX}/requests/{queued}/status", {}),
        (f"{FLUX}/requests/{queued}/status", {"X-API-Key": "rq_nope"}),
        (f"{FLUX}/requests/{queued}/status", {"X-API-Key": legacy}),
        (f"{FLUX}/requests/{queued}/status/", auth),
        (f"{FLUX}/requests/{queued}//status", auth),
        (f"{FLUX}/requests/{queued}%2Fstatus", auth),
        (f"{FLUX}/requests/{queued}/status?x=1", auth),
        (f"/v2/models/bfl/flux-2-pr\u00f6/requests/{queued}/status", auth),
    ]
    for path, headers in cases:
        lane, plain = http.get(path, headers=headers), flask_only.get(path, headers=headers)
        assert _answer(lane) == _answer(plain), path
        assert lane.headers["X-Comfy-Request-Id"]
    for method in ("head", "options", "post", "delete"):
        path = f"{FLUX}/requests/{queued}/status"
        lane = getattr(http, method)(path, headers=auth)
        assert _answer(lane) == _answer(getattr(flask_only, method)(path, headers=auth)), method


def _same_shape(response, request_ids: set[str]) -> tuple:
    """An answer with the ids it admitted blanked (two submits admit two ids)."""
    status, headers, data = _answer(response)
    text = data.decode()
    for request_id in request_ids:
        text = text.replace(request_id, "ID")
    body = json.loads(text)
    if isinstance(body, dict):
        body.pop("queue_position", None)
    return status, headers, body


def test_every_submit_answer_matches_the_flask_route(http, flask_only, auth, services):
    poor = services.accounts.mint_key(services.accounts.create_workspace("poor", queue_enabled=True, credits=0))
    off = services.accounts.mint_key(services.accounts.create_workspace("off", queue_enabled=False, credits=99))
    legacy = services.accounts.mint_legacy_key()
    good = json.dumps({"prompt": "a red teapot"})
    cases = [
        (FLUX, good, auth),
        (FLUX, good, {**auth, "X-Comfy-Priority": "high"}),
        (FLUX, good, {**auth, "Idempotency-Key": "same"}),
        (FLUX, json.dumps({"prompt": "another"}), {**auth, "Idempotency-Key": "same"}),
        (FLUX, good, {**auth, "Idempotency-Key": "k" * 300}),
        (FLUX, good, {**auth, "X-Comfy-Priority": "urgent"}),
        (FLUX, good, {**auth, "X-Provider-Api-Key": "sk-mine"}),
        (FLUX, good, {**auth, "X-Comfy-Webhook-Url": "http://10.0.0.1/hook"}),
        (FLUX, good, {**auth, "X-Comfy-Webhook-Events": "started, bogus"}),
        (FLUX, good, {**auth, "X-Comfy-Webhook-Events": " , "}),
        (FLUX, good, {**auth, "X-Comfy-Webhook-Events": "started,completed"}),  # and no webhook
        (FLUX, "not json", auth),
        (FLUX, "[1, 2]", auth),
        (FLUX, b"\xff\xfe", auth),
        (FLUX, json.dumps({"prompt": 7}), auth),
        (FLUX, json.dumps({"prompt": "p", "unknown_field": 1}), auth),
        (FLUX, "x" * (services.settings.max_body_bytes + 1), auth),  # one byte over the limit
        (FLUX, good, {"X-API-Key": poor}),
        (FLUX, good, {"X-API-Key": off}),
        (FLUX, good, {"X-API-Key": legacy}),
        (FLUX, good, {}),
        (FLUX, good, {"X-API-Key": "rq_nope"}),
        ("/v2/models/bfl/no-such-model", good, auth),
        ("/v2/models/openai/gpt-4o-mini-tts", json.dumps({"input": "hi", "voice": "alloy"}), auth),
    ]
    answers = []
    for side, client in enumerate((http, flask_only)):  # each side its own Idempotency-Keys
        answers.append([])
        for path, data, headers in cases:
            if "Idempotency-Key" in headers:
                headers = {**headers, "Idempotency-Key": f"{headers['Idempotency-Key']}-{side}"}
            response = client.post(f"{path}/requests", data=data,
                                   headers={"Content-Type": "application/json", **headers})
            admitted = {response.headers.get("X-Comfy-Request-Id", "")} if response.status_code == 201 else set()
            answers[side].append(_same_shape(response, admitted))
    for case, lane, plain in zip(cases, *answers):
        assert lane == plain, case[:2]
    assert [status for status, _, _ in answers[0]] == [
        "201 CREATED", "201 CREATED", "201 CREATED", "409 CONFLICT", "400 BAD REQUEST", "400 BAD REQUEST",
        "403 FORBIDDEN", "400 BAD REQUEST", "400 BAD REQUEST", "400 BAD REQUEST", "400 BAD REQUEST",
        "400 BAD REQUEST", "400 BAD REQUEST", "400 BAD REQUEST", "422 UNPROCESSABLE ENTITY", "422 UNPROCESSABLE ENTITY", "413 REQUEST ENTITY TOO LARGE",
        "402 PAYMENT REQUIRED", "403 FORBIDDEN", "403 FORBIDDEN", "401 UNAUTHORIZED", "401 UNAUTHORIZED",
        "404 NOT FOUND", "201 CREATED"]


def test_plain_polls_skip_flask_and_the_rest_reach_it(http, auth, served_by_flask):
    request_id = submit(http, auth).json["request_id"]
    served_by_flask.clear()
    status = f"{FLUX}/requests/{request_id}/status"
    assert http.get(status, headers=auth).json["status"] == "IN_QUEUE"
    assert served_by_flask == []  # the lane answered it
    for path, headers in ((status, {}), (f"{FLUX}/requests/nope/status", auth),
                          (f"{FLUX}/requests/{request_id}", auth)):
        http.get(path, headers=headers)
    assert served_by_flask == [status, f"{FLUX}/requests/nope/status", f"{FLUX}/requests/{request_id}"]
    served_by_flask.clear()
    assert submit(http, auth).status_code == 201
    assert submit(http, auth, raw="not json").status_code == 400
    assert served_by_flask == []
    assert submit(http, {}).status_code == 401
    assert served_by_flask == [f"{FLUX}/requests"]


@pytest.mark.parametrize("call, expected", [
    ("poll", 200),  # the lane, counted in status.lua
    ("poll a malformed id", 404),  # Flask
    ("submit", 201),  # the lane, counted in admit.lua
    ("submit a broken body", 400),  # the lane, counted after the refusal
])
def test_each_call_is_counted_once_whoever_answers_it(http, auth, services, workspace, call, expected):
    services.accounts.set_limits(workspace, rate_limit="4/minute")
    request_id = submit(http, auth).json["request_id"]  # the window now holds 1

    def send():
        if call.startswith("poll"):
            return http.get(f"{FLUX}/requests/{'nope' if 'malformed' in call else request_id}/status", headers=auth)
        return submit(http, auth, raw="{" if "broken" in call else None)

    assert [send().status_code for _ in range(3)] == [expected] * 3
    refused = send()
    assert_error(refused, 429, "rate_limited")
    assert 1 <= int(refused.headers["Retry-After"]) <= 61


def test_a_fault_after_the_read_answers_in_the_contract_shape(http, auth, services, monkeypatch, caplog):
    request_id = submit(http, auth).json["request_id"]
    status = f"{FLUX}/requests/{request_id}/status"

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(services.store, "status_view", broken)
    with caplog.at_level(logging.ERROR):
        assert_error(http.get(status, headers=auth), 500, "internal_error")
    assert "unhandled error" in caplog.text

    def unreachable(*args, **kwargs):
        raise redis.exceptions.ConnectionError("refused")

    monkeypatch.setattr(services.store, "status_view", unreachable)
    down = http.get(status, headers=auth)
    assert_error(down, 503, "service_unavailable")
    assert int(down.headers["Retry-After"]) >= 1


def test_deadline_headers_are_answered_alike_by_the_lane_and_flask(http, flask_only, auth, services):
    good = json.dumps({"prompt": "a red teapot"})
    cases = [{"X-Comfy-Start-Deadline": "30"}, {"X-Comfy-Deadline": "90.5"},
             {"X-Comfy-Start-Deadline": "30", "X-Comfy-Deadline": "60"}, {"X-Comfy-Start-Deadline": "nan"},
             {"X-Comfy-Deadline": "-1"}, {"X-Comfy-Deadline": "0"}, {"X-Comfy-Deadline": "1e9"},
             {"X-Comfy-Start-Deadline": "86401"}, {"X-Comfy-Deadline": "999999999"}]
    answers = []
    for client in (http, flask_only):
        answers.append([])
        for extra in cases:
            response = client.post(f"{FLUX}/requests", data=good,
                                   headers={"Content-Type": "application/json", **auth, **extra})
            admitted = {response.headers.get("X-Comfy-Request-Id", "")} if response.status_code == 201 else set()
            answers[-1].append(_same_shape(response, admitted))
            if response.status_code == 201:  # the status shows them alike too
                request_id = response.json["request_id"]
                polled = [_answer(c.get(f"{FLUX}/requests/{request_id}/status", headers=auth))
                          for c in (http, flask_only)]
                assert polled[0] == polled[1]
                shown = json.loads(polled[0][2])
                assert ("start_deadline_at" in shown, "deadline_at" in shown) == (
                    "X-Comfy-Start-Deadline" in extra, "X-Comfy-Deadline" in extra)
    for case, lane, plain in zip(cases, *answers):
        assert lane == plain, case
    assert [status for status, _, _ in answers[0]] == ["201 CREATED"] * 3 + ["400 BAD REQUEST"] * 6
