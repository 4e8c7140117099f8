"""The RateLimit header fields (draft-ietf-httpapi-ratelimit-headers-11):
every answer counted in a rate window says the caller's policy and what is
left of each window, on the lane and on Flask alike, told by the step that
counted the call; a 429 says r=0 and a reset no earlier than its Retry-After;
answers not counted say nothing."""

from __future__ import annotations

import re

import pytest
from werkzeug.test import Client

from router_queue.requests.record import Submission
from router_queue.services import Services
from router_queue.web import ratelimit
from tests.unit import route_support
from tests.unit.conftest import RecordingDispatcher
from tests.unit.route_support import FLUX, assert_error, submit

served_by_flask = route_support.served_by_flask  # a fixture (route_support)
FIELD = re.compile(r'^"([^"]+)";r=(\d+);t=(\d+)$')


def _left(response) -> dict[str, tuple[int, int]]:
    """The RateLimit field as {policy: (remaining, seconds to reset)}."""
    found = {}
    for item in response.headers["RateLimit"].split(", "):
        name, remaining, reset = FIELD.match(item).groups()
        found[name] = (int(remaining), int(reset))
    return found


def _window(workspace: str, spec: str, index: int = 0) -> str:
    """The counter of a workspace's window, as the front door names it."""
    return ratelimit._allowance(f"ws:{workspace}", spec).keys[index]


@pytest.fixture
def flask_only(app) -> Client:
    """The app with the lane bypassed: Flask's own WSGI callable."""
    return Client(app.wsgi_app.flask)


def test_the_lane_counts_a_window_down_and_its_429_says_r0_with_retry_after(
        http, auth, services, workspace, served_by_flask):
    services.accounts.set_limits(workspace, rate_limit="4/minute")
    created = submit(http, auth)
    assert created.status_code == 201
    assert created.headers["RateLimit-Policy"] == '"minute";q=4;w=60'
    remaining, reset = _left(created)["minute"]
    assert remaining == 3 and 1 <= reset <= 60
    status = f"{FLUX}/requests/{created.json['request_id']}/status"
    window = _window(workspace, "4/minute")
    services.redis.pexpire(window, 30_500)  # the window half over
    polled = http.get(status, headers=auth)
    assert polled.status_code == 200 and polled.headers["RateLimit-Policy"] == '"minute";q=4;w=60'
    assert _left(polled) == {"minute": (2, 31)}
    services.redis.pexpire(window, 9_200)
    assert _left(submit(http, auth)) == {"minute": (1, 10)}
    assert _left(http.get(status, headers=auth)) == {"minute": (0, 10)}
    refused = http.get(status, headers=auth)
    assert_error(refused, 429, "rate_limited")
    assert refused.headers["RateLimit-Policy"] == '"minute";q=4;w=60'
    assert _left(refused) == {"minute": (0, int(refused.headers["Retry-After"]))}
    assert 10 <= int(refused.headers["Retry-After"]) <= 11
    refused = submit(http, auth)
    assert_error(refused, 429, "rate_limited")
    assert _left(refused) == {"minute": (0, int(refused.headers["Retry-After"]))}
    assert served_by_flask == []  # every one of these the lane's


def test_flask_routes_each_count_once_and_say_so_whoever_counts_them(flask_only, auth, services, workspace):
    services.accounts.set_limits(workspace, rate_limit="7/minute")
    created = submit(flask_only, auth)  # counted in admit.lua
    request_id = created.json["request_id"]
    answers = [
        created,
        flask_only.get(f"{FLUX}/requests/{request_id}/status", headers=auth),  # status.lua
        flask_only.get(f"{FLUX}/requests/{request_id}", headers=auth),  # status.lua, for the result
        flask_only.get("/v2/requests", headers=auth),  # history.lua
        flask_only.get("/v2/models", headers=auth),  # rate.lua, as the call opens
        flask_only.get(f"{FLUX}/requests/not-an-id/status", headers=auth),  # rate.lua, apart (404)
        submit(flask_only, auth, raw="{"),  # rate.lua, after the route refused it (400)
    ]
    assert [a.status_code for a in answers] == [201, 200, 202, 200, 200, 404, 400]
    assert {a.headers["RateLimit-Policy"] for a in answers} == {'"minute";q=7;w=60'}
    assert [_left(a)["minute"][0] for a in answers] == [6, 5, 4, 3, 2, 1, 0]
    resets = [_left(a)["minute"][1] for a in answers]
    assert resets == sorted(resets, reverse=True) and 1 <= resets[-1] <= 60
    refused = flask_only.get("/v2/models", headers=auth)
    assert_error(refused, 429, "rate_limited")
    assert _left(refused) == {"minute": (0, int(refused.headers["Retry-After"]))}
    assert refused.headers["RateLimit-Policy"] == '"minute";q=7;w=60'


def test_every_window_of_a_policy_is_listed_and_the_one_spent_refuses(http, auth, services, workspace):
    services.accounts.set_limits(workspace, rate_limit="2/10seconds;10/minute")
    policy = '"10seconds";q=2;w=10, "minute";q=10;w=60'
    first, second = submit(http, auth), submit(http, auth)
    assert first.headers["RateLimit-Policy"] == second.headers["RateLimit-Policy"] == policy
    assert {name: left for name, (left, _) in _left(first).items()} == {"10seconds": 1, "minute": 9}
    assert {name: left for name, (left, _) in _left(second).items()} == {"10seconds": 0, "minute": 8}
    refused = submit(http, auth)
    assert_error(refused, 429, "rate_limited")
    assert refused.headers["RateLimit-Policy"] == policy
    assert _left(refused) == {"10seconds": (0, int(refused.headers["Retry-After"]))}


def test_a_caller_without_a_valid_key_is_told_its_address_s_window(http):
    refused = http.get("/v2/requests", headers={"X-API-Key": "rq_nope"})
    assert refused.status_code == 401
    assert refused.headers["RateLimit-Policy"] == '"second";q=1000;w=1'  # DEFAULT_RATE_LIMIT, the tests'
    assert _left(refused)["second"][0] < 1000


def test_answers_not_counted_carry_no_ratelimit_fields(http, ops_http, auth):
    answers = [http.get("/healthz", headers=auth), http.get("/readyz", headers=auth),
               ops_http.get("/metrics"), ops_http.get("/ops"), ops_http.get("/ops/summary.json"),
               http.get("/ops", headers=auth)]  # the operator page elsewhere: 404, unread
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 200, 404]
    for answer in answers:
        assert "RateLimit" not in answer.headers and "RateLimit-Policy" not in answer.headers


@pytest.fixture(params=["one step", "split"])
def store_services(request, client, settings, services):
    """The store in one step (one Redis) and split per slot (a cluster's steps)."""
    if request.param == "one step":
        return services
    return Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True)


def test_each_counting_script_tells_where_the_windows_stand(store_services):
    services = store_services
    ws = services.accounts.create_workspace("w", queue_enabled=True, credits=40)
    allowance = ratelimit._allowance(f"ws:{ws}", "5/minute;100/hour")
    told = []

    def admit(**more):
        meter = ratelimit.Meter(allowance)
        request_id = services.ids.mint(ws, "bfl/flux-2-pro")
        admission = services.store.admit(Submission(request_id=request_id, workspace=ws, model="bfl/flux-2-pro",
                                                    provider="bfl", body='{"prompt": "p"}', price=30, **more),
                                         rate=meter)
        told.append(_remaining(meter))
        return admission, request_id

    admission, request_id = admit(fingerprint="f", idempotency_key_hash="k")
    assert admission.outcome.value == "ADMITTED"
    assert admit(fingerprint="f", idempotency_key_hash="k")[0].outcome.value == "REPLAY"
    assert admit()[0].outcome.value == "INSUFFICIENT_CREDITS"  # refused after it was counted
    meter = ratelimit.Meter(allowance)
    services.store.status_view(request_id, "bfl", meter)
    told.append(_remaining(meter))
    meter = ratelimit.Meter(allowance)
    services.store.history(ws, since=0, rate=meter)
    told.append(_remaining(meter))
    assert told == [(4, 99), (3, 98), (2, 97), (1, 96), (0, 95)]
    meter = ratelimit.Meter(allowance)
    with pytest.raises(Exception) as refused:
        services.store.status_view(request_id, "bfl", meter)
    assert refused.value.headers()["RateLimit"] == f'"minute";r=0;t={refused.value.retry_after}'
    assert meter.fields() == []  # a refused call says it through its 429 alone


def _remaining(meter: ratelimit.Meter) -> tuple[int, ...]:
    fields = dict(meter.fields())
    assert fields["RateLimit-Policy"] == '"minute";q=5;w=60, "hour";q=100;w=3600'
    return tuple(int(r) for r in re.findall(r";r=(\d+);", fields["RateLimit"]))


def test_the_openapi_document_names_the_fields_on_every_counted_answer_and_no_other(http):
    document = http.get("/v2/openapi.json").json
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for code, response in operation["responses"].items():
                named = {"RateLimit", "RateLimit-Policy"} & set(response.get("headers", {}))
                assert named == (set() if path == "/healthz" else {"RateLimit", "RateLimit-Policy"}), (
                    path, method, code)
    assert "draft-ietf-httpapi-ratelimit-headers" in document["components"]["headers"]["RateLimit-Policy"][
        "description"]
