"""The poll lane (``web/poll_lane.py``) answers status reads exactly as the
Flask route does: same status, body and headers, the call counted once, and
everything it does not serve left to Flask before anything was counted."""

from __future__ import annotations

import logging

import pytest
from werkzeug.test import Client

from router_queue.store import keys
from router_queue.store.requests import Lease
from tests.unit.support import record_of
from tests.unit.test_routes import FLUX, assert_error, submit

LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)
#: Headers that differ between any two answers: a fresh call id each, the date.
VOLATILE = {"X-Comfy-Request-Id", "Date"}


@pytest.fixture
def flask_only(app) -> Client:
    """The same app with the lane bypassed: Flask's own WSGI callable."""
    return Client(app.wsgi_app.flask)


@pytest.fixture
def served_by_flask(app) -> list[str]:
    """Paths of the calls that reached Flask's request handling."""
    reached: list[str] = []

    @app.before_request
    def _note() -> None:
        from flask import request

        reached.append(request.path)

    return reached


def _answer(response) -> tuple:
    headers = sorted((k, v) for k, v in response.headers.items() if k not in VOLATILE)
    return response.status, headers, response.get_data()


def test_every_status_answer_matches_the_flask_route(http, flask_only, auth, api_key, services):
    queued, running, done, failed, gone = (submit(http, auth, {"prompt": f"p{i}"}).json["request_id"]
                                           for i in range(5))
    services.store.claim(record_of(services, running, "bfl"), LEASE)
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


@pytest.mark.parametrize("through", ["lane", "flask"])
def test_each_poll_is_counted_once_whoever_answers_it(http, auth, services, workspace, through):
    services.accounts.set_limits(workspace, rate_limit="4/minute")
    request_id = submit(http, auth).json["request_id"]  # the window now holds 1
    path = f"{FLUX}/requests/{request_id if through == 'lane' else 'not-an-id'}/status"
    expected = 200 if through == "lane" else 404
    assert [http.get(path, headers=auth).status_code for _ in range(3)] == [expected] * 3
    refused = http.get(path, headers=auth)
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

    import redis

    def unreachable(*args, **kwargs):
        raise redis.exceptions.ConnectionError("refused")

    monkeypatch.setattr(services.store, "status_view", unreachable)
    down = http.get(status, headers=auth)
    assert_error(down, 503, "service_unavailable")
    assert int(down.headers["Retry-After"]) >= 1
