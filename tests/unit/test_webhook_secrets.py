"""A webhook needs its workspace's signing secret: a submit naming one (its own
``X-Comfy-Webhook-Url``, or the workspace's default) is refused with
``400 invalid_input`` saying how to create the secret, on the queued route
(the lane and Flask alike) and the synchronous one, and nothing is admitted,
held or charged."""

from __future__ import annotations

import dataclasses

import pytest
from werkzeug.test import Client

from router_queue.store import keys
from router_queue.webhooks import event as webhook_event
from tests.unit.route_support import FLUX, assert_error

HOOK = "http://127.0.0.1:9/hook"
BODY = {"prompt": "a red teapot"}


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, webhook_allow_loopback_http=True)


@pytest.fixture
def flask_only(app) -> Client:
    """The same app with the lane bypassed."""
    return Client(app.wsgi_app.flask)


def _queued(client, auth, headers=None):
    return client.post(f"{FLUX}/requests", json=BODY, headers={**auth, **(headers or {})})


def _synchronous(client, auth, headers=None):
    return client.post(FLUX, json=BODY, headers={**auth, **(headers or {})})


def _nothing_admitted(services, workspace):
    ws = services.accounts.get(workspace)
    assert (ws.queued, ws.held, ws.credits) == (0, 0, 1000)
    assert services.accounts.ledger(workspace) == []
    assert list(services.redis.scan_iter(keys.request("*"))) == []


@pytest.mark.parametrize("route", [_queued, _synchronous], ids=["queued", "synchronous"])
@pytest.mark.parametrize("door", ["lane", "flask"])
def test_a_webhook_header_without_a_secret_is_refused_saying_how_to_make_one(
        http, flask_only, auth, services, workspace, route, door):
    client = http if door == "lane" else flask_only
    response = route(client, auth, {"X-Comfy-Webhook-Url": HOOK, "Idempotency-Key": "hook-1"})
    assert_error(response, 400, "invalid_input")
    detail = response.json["detail"]
    assert detail.startswith("X-Comfy-Webhook-Url names a webhook")
    assert f"router-queue workspace webhook-secret {workspace}" in detail
    _nothing_admitted(services, workspace)

    # the key was not bound: once the secret exists, the same submit is admitted
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    if route is _queued:
        again = _queued(client, auth, {"X-Comfy-Webhook-Url": HOOK, "Idempotency-Key": "hook-1"})
        assert again.status_code == 201
        assert services.redis.hget(keys.request(again.json["request_id"]), "webhook_url").decode() == HOOK


def test_the_workspace_default_without_a_secret_is_refused_too(http, ops_http, auth, services, workspace):
    services.accounts.set_webhook_url(workspace, HOOK)
    for route in (_queued, _synchronous):
        response = route(http, auth)
        assert_error(response, 400, "invalid_input")
        assert response.json["detail"].startswith("the workspace has a default webhook URL")
        assert f"webhook-secret {workspace}" in response.json["detail"]
    _nothing_admitted(services, workspace)
    metrics = ops_http.get("/metrics").get_data(as_text=True)
    assert 'reason="no_webhook_secret"' in metrics


def test_without_a_webhook_nothing_changes(http, auth, services, workspace):
    assert _queued(http, auth).status_code == 201


def test_a_legacy_key_naming_a_webhook_is_told_it_has_no_workspace(http, services):
    legacy = {"X-API-Key": services.accounts.mint_legacy_key()}
    response = _synchronous(http, legacy, {"X-Comfy-Webhook-Url": HOOK})
    assert_error(response, 400, "invalid_input")
    assert "belongs to no workspace" in response.json["detail"]
