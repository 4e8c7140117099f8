"""The synchronous route (same admission, waits on a notification) and the
discovery routes (catalog pages, per-model and whole-API OpenAPI documents)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from router_queue.web.app import create_app
from tests.unit.sync_support import NATIVE, FinishingDispatcher, run

FLUX = "/v2/models/bfl/flux-2-pro"


@pytest.fixture
def sync_app(settings, services):
    def build(**kwargs):
        own, dispatcher = FinishingDispatcher.serving(dataclasses.replace(settings, sync_deadline_s=2.0),
                                                      services.redis, **kwargs)
        services.settings = own.settings
        return create_app(own.settings, services=own).test_client(), dispatcher
    return build


def test_the_sync_route_answers_the_native_output_once_the_request_completes(sync_app, auth, services, workspace):
    http, dispatcher = sync_app()
    started = time.monotonic()
    response = run(http, auth)
    assert response.status_code == 200
    assert response.get_data() == NATIVE
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["X-Comfy-Request-Id"] == dispatcher.published[0]
    assert time.monotonic() - started < 1.5  # woken by the notification, not the deadline
    assert services.accounts.get(workspace).credits == 1000 - 60


def test_the_sync_route_is_not_gated_by_queued_delivery(sync_app, services):
    workspace = services.accounts.create_workspace("off", queue_enabled=False, credits=100)
    http, _ = sync_app()
    assert run(http, {"X-API-Key": services.accounts.mint_key(workspace)}).status_code == 200


def test_a_failed_sync_run_answers_its_bucket(sync_app, auth):
    http, _ = sync_app(outcome={"error_type": "content_policy_violation", "detail": "refused"})
    response = run(http, auth)
    assert response.status_code == 400
    assert response.headers["X-Comfy-Error-Type"] == "content_policy_violation"


def test_past_the_deadline_504_then_the_same_key_reattaches(sync_app, auth):
    http, dispatcher = sync_app(delay_s=None)  # nothing finishes it yet
    first = run(http, auth, headers={"Idempotency-Key": "k"})
    assert first.status_code == 504
    assert first.headers["X-Comfy-Error-Type"] == "deadline_exceeded"
    assert int(first.headers["Retry-After"]) >= 1
    request_id = first.headers["X-Comfy-Request-Id"]

    dispatcher.delay_s = 0.3
    threading.Thread(target=lambda: (time.sleep(0.1), dispatcher.publish(request_id, "bfl")), daemon=True).start()
    again = run(http, auth, headers={"Idempotency-Key": "k"})
    assert again.status_code == 200
    assert again.get_data() == NATIVE
    assert again.headers["X-Comfy-Request-Id"] == request_id
    assert dispatcher.published == [request_id, request_id]  # no second admission


def test_sync_and_queued_admission_validate_the_same_way(sync_app, auth):
    http, dispatcher = sync_app()
    response = run(http, auth, {"prompt": 5})
    assert response.status_code == 422
    assert response.json["detail"][0]["loc"] == ["body", "prompt"]
    assert dispatcher.published == []


def test_the_catalog_pages_with_a_cursor_and_clamps_the_limit(http):
    first = http.get("/v2/models?limit=2")
    assert first.status_code == 200
    page = first.json
    assert [m["id"] for m in page["data"]] == ["bfl/flux-2-pro", "openai/gpt-4o-mini-tts"]
    assert page["has_more"] is True and page["limit"] == 2
    assert page["data"][0]["billing"] == {"charges_on_policy_rejection": False}
    second = http.get(f"/v2/models?limit=2&cursor={page['next_cursor']}").json
    assert [m["id"] for m in second["data"]] == ["vertexai/gemini-2.5-flash-image", "vertexai/gemini-3.1-flash-image"]
    assert second["has_more"] is False and second["next_cursor"] is None
    assert http.get("/v2/models?limit=500").json["limit"] == 100
    for bad in ("limit=0", "limit=x", "cursor=%%%"):
        response = http.get(f"/v2/models?{bad}")
        assert response.status_code == 400 and response.headers["X-Comfy-Error-Type"] == "invalid_input"


def test_a_models_openapi_document_carries_its_schema_with_an_etag(http):
    response = http.get("/v2/models/bfl/flux-2-pro/openapi.json")
    assert response.status_code == 200
    document = response.json
    assert document["openapi"].startswith("3.")
    schemas = document["components"]["schemas"]
    assert schemas["BflFlux2ProInput"]["required"] == ["prompt"]
    assert schemas["BflFlux2ProInput"]["properties"]["width"] == {"type": "integer", "minimum": 64, "maximum": 2048}
    etag = response.headers["ETag"]
    unchanged = http.get("/v2/models/bfl/flux-2-pro/openapi.json", headers={"If-None-Match": etag})
    assert unchanged.status_code == 304 and unchanged.get_data() == b""
    audio = http.get("/v2/models/openai/gpt-4o-mini-tts/openapi.json").json
    post = audio["paths"]["/v2/models/openai/gpt-4o-mini-tts"]["post"]
    assert post["responses"]["200"]["content"]["audio/mpeg"]["schema"] == {"type": "string", "format": "binary"}
    # the submit headers docs/API.md names, every one
    submit = document["paths"]["/v2/models/bfl/flux-2-pro/requests"]["post"]
    assert {p["name"] for p in submit["parameters"] if p["in"] == "header"} == {
        "Idempotency-Key", "X-Comfy-Priority", "X-Comfy-Webhook-Url", "X-Comfy-Webhook-Events",
        "X-Comfy-Start-Deadline", "X-Comfy-Deadline", "X-Comfy-Fallback-Models", "traceparent"}


def test_an_unknown_models_document_is_404_with_suggestions(http):
    response = http.get("/v2/models/bfl/flux-2/openapi.json")
    assert response.status_code == 404
    assert response.headers["X-Comfy-Error-Type"] == "model_not_found"
    assert "bfl/flux-2-pro" in response.json["detail"]


def test_the_whole_api_document_and_its_docs_page(http):
    document = http.get("/v2/openapi.json").json
    assert "/v2/models/bfl/flux-2-pro/requests/{request_id}/status" in document["paths"]
    assert "/v2/models" in document["paths"]
    page = http.get("/v2/docs")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert "/v2/models/vertexai/gemini-3.1-flash-image/requests" in html
    assert "http://" not in html.replace('href="/v2/openapi.json"', "")  # nothing fetched from elsewhere
