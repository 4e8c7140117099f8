"""The worker's delivery: real adapters over real HTTP against the stub provider.

The stub runs in a thread of the test process (werkzeug), so these stay fast;
the integration suite runs the same paths through real Celery workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading

import pytest
import requests
from werkzeug.serving import make_server

from router_queue.admission import fingerprint
from router_queue.settings import Secret
from router_queue.states import COMPLETED
from stub_provider import create_app as create_stub
from workers.delivery import deliver, republish_unpublished


@pytest.fixture(scope="module")
def stub_origin():
    server = make_server("127.0.0.1", 0, create_stub(), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def worker_services(services, stub_origin):
    services.settings = dataclasses.replace(
        services.settings, provider_origin_override=stub_origin, bfl_api_key=Secret("k"),
        vertexai_access_token=Secret("k"), openai_api_key=Secret("k"),
    )
    return services


def admitted(services, workspace, model, body):
    provider = model.split("/")[0]
    request_id = services.ids.mint(workspace, model)
    outcome = services.store.admit(request_id=request_id, workspace=workspace, model=model, provider=provider,
                                   body=json.dumps(body), fingerprint=fingerprint(model, body))
    assert outcome.outcome == "ADMITTED"
    return request_id, provider


def run(services, workspace, model, body):
    request_id, provider = admitted(services, workspace, model, body)
    with requests.Session() as session:
        outcome = deliver(services, session, request_id)
    return outcome, services.store.status_view(request_id, provider).record, request_id


def test_bfl_is_submitted_then_polled_until_ready(worker_services, workspace, stub_origin):
    outcome, record, request_id = run(worker_services, workspace, "bfl/flux-2-pro",
                                      {"prompt": "teapot [stub:latency=0.3]"})
    assert (outcome, record.status, record.error_type) == ("completed", COMPLETED, None)
    output = json.loads(worker_services.store.result(request_id))
    assert output["status"] == "Ready"
    assert output["result"]["sample"].startswith(stub_origin)


def test_vertex_answers_inline_image_data(worker_services, workspace):
    body = {"contents": [{"role": "user", "parts": [{"text": "a teapot"}]}]}
    outcome, record, request_id = run(worker_services, workspace, "vertexai/gemini-3.1-flash-image", body)
    assert outcome == "completed"
    part = json.loads(worker_services.store.result(request_id))["candidates"][0]["content"]["parts"][0]
    assert part["inlineData"]["mimeType"] == "image/png"


def test_speech_bytes_are_stored_byte_for_byte(worker_services, workspace, stub_origin):
    body = {"input": "hello there", "voice": "alloy"}
    outcome, record, request_id = run(worker_services, workspace, "openai/gpt-4o-mini-tts", body)
    direct = requests.post(f"{stub_origin}/v1/audio/speech", json={"model": "gpt-4o-mini-tts", **body},
                           headers={"Authorization": "Bearer k"})
    assert record.content_type == "audio/mpeg"
    assert worker_services.store.result(request_id) == direct.content


@pytest.mark.parametrize("model,body,bucket", [
    ("bfl/flux-2-pro", {"prompt": "no [stub:refuse]"}, "content_policy_violation"),
    ("bfl/flux-2-pro", {"prompt": "no [stub:reject]"}, "invalid_input"),
    ("bfl/flux-2-pro", {"prompt": "no [stub:status=500]"}, "provider_error"),
    ("vertexai/gemini-3.1-flash-image", {"contents": [{"parts": [{"text": "[stub:refuse]"}]}]},
     "content_policy_violation"),
    ("vertexai/gemini-3.1-flash-image", {"contents": [{"parts": [{"text": "[stub:reject]"}]}]}, "invalid_input"),
    ("openai/gpt-4o-mini-tts", {"input": "[stub:refuse]", "voice": "alloy"}, "content_policy_violation"),
    ("openai/gpt-4o-mini-tts", {"input": "[stub:status=503]", "voice": "alloy"}, "provider_error"),
])
def test_provider_failures_map_to_their_bucket(worker_services, workspace, model, body, bucket):
    outcome, record, _ = run(worker_services, workspace, model, body)
    assert (outcome, record.status, record.error_type) == (bucket, COMPLETED, bucket)
    assert record.detail


def test_a_hung_provider_ends_in_provider_timeout(worker_services, workspace, monkeypatch):
    from router_queue.catalog import CallPolicy

    entry = worker_services.catalog.by_id("openai/gpt-4o-mini-tts")
    fast = dataclasses.replace(entry, policy=CallPolicy(read_timeout_s=0.3))
    monkeypatch.setattr(worker_services.catalog, "by_id", lambda model_id: fast)
    outcome, record, _ = run(worker_services, workspace, "openai/gpt-4o-mini-tts",
                             {"input": "[stub:hang=3]", "voice": "alloy"})
    assert (record.status, record.error_type) == (COMPLETED, "provider_timeout")


def test_a_cancel_while_polling_stops_the_generation(worker_services, workspace):
    request_id, provider = admitted(worker_services, workspace, "bfl/flux-2-pro",
                                    {"prompt": "slow [stub:latency=30]"})
    store = worker_services.store
    real_claim = store.claim

    def claim_then_cancel(*args):
        result = real_claim(*args)
        store.cancel(request_id=request_id, workspace=workspace, model="bfl/flux-2-pro", provider=provider)
        return result

    store.claim = claim_then_cancel
    with requests.Session() as session:
        assert deliver(worker_services, session, request_id) == "cancelled"
    record = store.status_view(request_id, provider).record
    assert (record.status, record.error_type) == (COMPLETED, "cancelled")


def test_a_second_delivery_of_one_request_does_nothing(worker_services, workspace, stub_origin):
    requests.post(f"{stub_origin}/stub/reset")
    body = {"prompt": "once only"}
    request_id, _ = admitted(worker_services, workspace, "bfl/flux-2-pro", body)
    with requests.Session() as session:
        assert deliver(worker_services, session, request_id) == "completed"
        assert deliver(worker_services, session, request_id) == "completed"  # found COMPLETED: dropped
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    calls = requests.get(f"{stub_origin}/stub/calls").json()["submits"]
    assert calls[f"bfl_submit:{digest}"] == 1


def test_a_missing_record_is_dropped(worker_services):
    with requests.Session() as session:
        assert deliver(worker_services, session, worker_services.ids.mint("ws_x", "bfl/flux-2-pro")) == "missing"


def test_the_sweeper_republishes_what_was_never_published(worker_services, workspace):
    stranded, _ = admitted(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "stranded"})
    published = []

    class Recorder:
        def publish(self, request_id, provider):
            published.append((request_id, provider))
            worker_services.store.mark_published(request_id)

    assert republish_unpublished(worker_services, Recorder()) == 1
    assert published == [(stranded, "bfl")]
    assert republish_unpublished(worker_services, Recorder()) == 0
