"""What the front door decides before queueing: credits, gating, backlog,
rate limits, and that every refusal leaves the Idempotency-Key free."""

from __future__ import annotations

import dataclasses
import json

import pytest

from router_queue.services import Services
from router_queue.settings import DEFAULT_CATALOG
from router_queue.web.app import create_app
from tests.unit.conftest import RecordingDispatcher
from tests.unit.route_support import assert_refusal

FLUX = "/v2/models/bfl/flux-2-pro"
PRICE = 60


def submit(http, key, body=None, *, path=FLUX, headers=None):
    return http.post(f"{path}/requests", data=json.dumps(body or {"prompt": "teapot"}),
                     headers={"X-API-Key": key, "Content-Type": "application/json", **(headers or {})})


def key_for(services, *, credits=10_000, queue_enabled=True, **limits):
    workspace = services.accounts.create_workspace("w", queue_enabled=queue_enabled, credits=credits)
    if limits:
        services.accounts.set_limits(workspace, **limits)
    return workspace, services.accounts.mint_key(workspace)


def test_402_when_the_workspace_cannot_fund_the_run_and_the_key_can_be_resent(http, services, dispatcher):
    workspace, key = key_for(services, credits=PRICE - 1)
    refused = submit(http, key, headers={"Idempotency-Key": "k1"})
    assert_refusal(refused, 402, "insufficient_credits")
    assert dispatcher.published == []
    services.accounts.set_credits(workspace, PRICE)
    admitted = submit(http, key, headers={"Idempotency-Key": "k1"})
    assert admitted.status_code == 201
    assert "Idempotent-Replayed" not in admitted.headers


@pytest.mark.parametrize("status,body,headers", [
    (422, {"prompt": 5}, {}),
    (403, None, {"X-Provider-Api-Key": "sk-mine"}),
])
def test_refusals_before_queueing_release_the_idempotency_key(http, services, status, body, headers):
    _, key = key_for(services)
    first = submit(http, key, body, headers={"Idempotency-Key": "same", **headers})
    assert first.status_code == status
    assert submit(http, key, {"prompt": "fixed"}, headers={"Idempotency-Key": "same"}).status_code == 201


def test_a_legacy_key_is_not_enabled_for_queued_delivery(http, services):
    key = services.accounts.mint_legacy_key()
    assert_refusal(submit(http, key), 403, "not_enabled")
    assert_refusal(http.get(f"{FLUX}/requests/{services.ids.mint('-', 'bfl/flux-2-pro')}/status",
                          headers={"X-API-Key": key}), 403, "not_enabled")


def test_a_bring_your_own_key_request_is_not_enabled(http, services, dispatcher):
    _, key = key_for(services)
    response = submit(http, key, headers={"X-Provider-Api-Key": "sk-mine"})
    assert_refusal(response, 403, "not_enabled")
    assert "synchronous" in response.json["detail"]
    assert dispatcher.published == []


def test_a_model_the_queue_cannot_run_is_not_enabled(settings, client, tmp_path):
    catalog = json.loads(DEFAULT_CATALOG.read_text())
    catalog["models"]["bfl/flux-2-pro"]["queueable"] = False
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog))
    settings = dataclasses.replace(settings, catalog_path=str(path))
    services = Services.build(settings, client, dispatcher=RecordingDispatcher())
    http = create_app(settings, services=services).test_client()
    _, key = key_for(services)
    assert_refusal(submit(http, key), 403, "not_enabled")


def test_429_queue_backlog_full_past_the_workspace_cap(http, services, dispatcher):
    _, key = key_for(services, max_queued=2)
    assert [submit(http, key, {"prompt": f"p{i}"}).status_code for i in range(2)] == [201, 201]
    full = submit(http, key, {"prompt": "p3"}, headers={"Idempotency-Key": "k"})
    assert_refusal(full, 429, "queue_backlog_full", retry_after=True)
    assert len(dispatcher.published) == 2
    first = dispatcher.published[0][0]
    http.put(f"{FLUX}/requests/{first}/cancel", headers={"X-API-Key": key})
    assert submit(http, key, {"prompt": "p3"}, headers={"Idempotency-Key": "k"}).status_code == 201


def test_429_rate_limited_counts_every_route_per_workspace(http, services):
    _, key = key_for(services, rate_limit="5/minute")
    request_id = submit(http, key).json["request_id"]
    answers = [http.get(f"{FLUX}/requests/{request_id}/status", headers={"X-API-Key": key}).status_code
               for _ in range(5)]
    assert answers == [200, 200, 200, 200, 429]
    limited = http.get(f"{FLUX}/requests/{request_id}", headers={"X-API-Key": key})
    assert_refusal(limited, 429, "rate_limited", retry_after=True)
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    assert limited.headers["X-Comfy-Request-Id"]
    _, other = key_for(services)
    assert submit(http, other).status_code == 201  # another workspace has its own allowance


def test_calls_refused_before_their_route_reaches_redis_still_count(http, services, dispatcher):
    """Submits and status reads count the call inside their own script; one that
    is refused before that (a malformed id, a body the schema refuses, a model
    that does not exist) is counted all the same, and a spent window wins."""
    workspace, key = key_for(services, rate_limit="4/minute")
    auth = {"X-API-Key": key}
    assert http.get(f"{FLUX}/requests/not-an-id/status", headers=auth).status_code == 404
    assert submit(http, key, {"prompt": 5}).status_code == 422
    assert submit(http, key, path="/v2/models/bfl/flux-9").status_code == 404
    request_id = submit(http, key).json["request_id"]  # the fourth call

    assert_refusal(http.get(f"{FLUX}/requests/not-an-id/status", headers=auth), 429, "rate_limited", retry_after=True)
    assert_refusal(submit(http, key, {"prompt": 5}), 429, "rate_limited", retry_after=True)
    assert_refusal(submit(http, key), 429, "rate_limited", retry_after=True)
    assert_refusal(http.get(f"{FLUX}/requests/{request_id}", headers=auth), 429, "rate_limited", retry_after=True)
    assert [p[0] for p in dispatcher.published] == [request_id]  # a refused submit queued nothing
    assert services.accounts.get(workspace).queued == 1


def test_health_is_never_rate_limited(http, services):
    _, key = key_for(services, rate_limit="1/minute")
    assert [http.get("/healthz", headers={"X-API-Key": key}).status_code for _ in range(3)] == [200] * 3
