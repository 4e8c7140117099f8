"""The worker's delivery: real adapters over real HTTP against the stub provider.

The stub runs in a thread of the test process (werkzeug), so these stay fast;
the integration suite runs the same paths through real Celery workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import pytest
import redis
import requests

from router_queue import metrics
from router_queue.catalog import Catalog
from router_queue.services import Services
from router_queue.settings import DEFAULT_CATALOG, Settings
from router_queue.states import COMPLETED
from router_queue.store import keys
from router_queue.store.requests_values import Lease
from router_queue.web.app import create_app
from tests.unit import delivery_support
from tests.unit.conftest import RecordingDispatcher
from tests.unit.delivery_support import admitted, deliver_until_done, execution
from tests.unit.support import context_of, record_of
from workers.delivery import deliver
from workers.leases import LeaseKeeper
from workers.sweeper import sweep

#: The stub provider and the services pointed at it (delivery_support), fixtures here.
stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)


class KeyRecordingSession(requests.Session):
    """Remembers the ``x-key`` each provider call carried, by path."""

    def __init__(self):
        super().__init__()
        self.keys: list[tuple[str, str]] = []

    def request(self, method, url, *args, headers=None, **kwargs):
        self.keys.append((url.split("?")[0].rsplit("/", 1)[-1], (headers or {}).get("x-key", "")))
        return super().request(method, url, *args, headers=headers, **kwargs)


def run(services, workspace, model, body, waits=None):
    request_id, provider = admitted(services, workspace, model, body)
    outcome = deliver_until_done(context_of(services), request_id, waits=waits)
    return outcome, services.store.status_view(request_id, provider).record, request_id


def test_bfl_is_submitted_then_polled_until_ready(worker_services, workspace, stub_origin):
    outcome, record, request_id = run(worker_services, workspace, "bfl/flux-2-pro",
                                      {"prompt": "teapot [stub:latency=0.3]"})
    assert (outcome, record.status, record.error_type) == ("completed", COMPLETED, None)
    output = json.loads(worker_services.store.result(request_id))
    assert output["status"] == "Ready"
    assert output["result"]["sample"].startswith(stub_origin)


def test_bfls_progress_reaches_the_record_as_it_grows(worker_services, workspace, monkeypatch):
    store, reported = worker_services.store, []
    record_progress = store.record_progress

    def spy(request_id, token, progress):
        kept = record_progress(request_id, token, progress)
        reported.append((progress, kept))
        return kept

    monkeypatch.setattr(store, "record_progress", spy)
    outcome, record, _ = run(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "teapot [stub:latency=1]"})
    assert outcome == "completed"
    kept = [p for p, was_kept in reported if was_kept]
    assert len(kept) >= 2 and kept == sorted(kept) and 0 <= kept[0] < kept[-1] < 1, reported
    assert record.progress == kept[-1]


def test_a_progress_write_that_fails_loses_the_figure_not_the_run(worker_services, workspace, monkeypatch):
    def down(*_):
        raise redis.ConnectionError("the store blinked")

    monkeypatch.setattr(worker_services.store, "record_progress", down)
    outcome, record, _ = run(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "teapot [stub:latency=0.5]"})
    assert (outcome, record.status, record.error_type) == ("completed", COMPLETED, None)


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


def test_a_provider_error_is_retried_with_backoff_until_attempts_run_out(worker_services, workspace):
    waits = []
    outcome, record, _ = run(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "[stub:status=503]"}, waits)
    assert (outcome, record.error_type, record.attempts) == ("provider_error", "provider_error", 4)
    policy = worker_services.catalog.by_id("bfl/flux-2-pro").policy
    assert len(waits) == policy.max_attempts - 1
    for attempt, wait in enumerate(waits, start=1):
        ceiling = min(policy.backoff_max_s, policy.backoff_base_s * 2 ** (attempt - 1))
        assert ceiling / 2 <= wait <= ceiling


def test_a_transient_failure_recovers_on_retry(worker_services, workspace):
    outcome, record, _ = run(worker_services, workspace, "vertexai/gemini-3.1-flash-image",
                             {"contents": [{"parts": [{"text": "flaky [stub:fail_times=2]"}]}]})
    assert (outcome, record.error_type, record.attempts) == ("completed", None, 2)


def test_a_429_is_retried_no_sooner_than_its_retry_after(worker_services, workspace):
    waits = []
    outcome, record, _ = run(worker_services, workspace, "openai/gpt-4o-mini-tts",
                             {"input": "busy [stub:429=7]", "voice": "alloy"}, waits)
    assert outcome == "completed"
    assert waits == [7.0]


def test_a_hung_provider_ends_in_provider_timeout(worker_services, workspace, monkeypatch):
    from router_queue.catalog import CallPolicy

    entry = worker_services.catalog.by_id("openai/gpt-4o-mini-tts")
    fast = dataclasses.replace(entry, policy=CallPolicy(read_timeout_s=0.3, max_attempts=2, backoff_base_s=0))
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
    assert deliver(context_of(worker_services), request_id, execution()) == "cancelled"
    record = store.status_view(request_id, provider).record
    assert (record.status, record.error_type) == (COMPLETED, "cancelled")


def test_a_second_delivery_of_one_request_does_nothing(worker_services, workspace, stub_origin):
    body = {"prompt": "once only"}
    request_id, _ = admitted(worker_services, workspace, "bfl/flux-2-pro", body)
    context = context_of(worker_services)
    assert deliver(context, request_id, execution("first")) == "completed"
    assert deliver(context, request_id, execution("second")) == "completed"  # found COMPLETED: dropped
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    calls = requests.get(f"{stub_origin}/stub/calls").json()["submits"]
    assert calls[f"bfl_submit:{digest}"] == 1


def test_a_grant_whose_publish_failed_is_published_by_the_next_sweep_not_after_its_lease(worker_services, workspace,
                                                                                         monkeypatch):
    """The broker apart from the store is away at the grant: the grant is made
    due at once, so the first sweep that can publish does (issue 23: work
    resumes within seconds of the broker's return, not REPUBLISH_AFTER_SECONDS)."""
    worker_services.store.republish_after_s = 30.0
    dispatcher = worker_services.dispatcher

    def broker_away(request_id, provider):
        raise ConnectionError("the broker is away")

    monkeypatch.setattr(dispatcher, "publish", broker_away)
    unsent, _ = admitted(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "granted while the broker is away"})
    monkeypatch.undo()
    sent, _ = admitted(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "granted once it is back"})
    assert dispatcher.published == [(sent, "bfl")]
    context = context_of(worker_services)
    assert sweep(context, now=time.time() + 1).republished == 1  # long before the 30 s lease of a grant
    assert dispatcher.published == [(sent, "bfl"), (unsent, "bfl")]
    assert sweep(context, now=time.time() + 2).republished == 0


def test_a_missing_record_is_dropped(worker_services):
    missing = worker_services.ids.mint("ws_x", "bfl/flux-2-pro")
    assert deliver(context_of(worker_services), missing, execution()) == "missing"


def test_the_sweeper_republishes_what_was_never_published(worker_services, workspace):
    stranded, _ = admitted(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "stranded"})
    context = context_of(worker_services)
    context.dispatcher.published.clear()  # its grant's message is lost
    later = time.time() + worker_services.settings.republish_after_s + 1
    assert sweep(context, now=later).republished == 1
    assert context.dispatcher.published == [(stranded, "bfl")]
    assert sweep(context, now=later).republished == 0


def test_a_redelivered_message_does_not_run_beside_its_live_original(worker_services, workspace):
    request_id, provider = admitted(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "[stub:latency=5]"})
    store = worker_services.store
    original = Lease("task-1-run-a", 30, 3600, 3, resume_key="task-1:0")
    assert store.claim(record_of(worker_services, request_id, provider), original) == "CLAIMED"
    # The broker hands the same message (same task id, same retry count) out again.
    assert deliver(context_of(worker_services), request_id, execution("task-1", 0)) == "leased"


def test_a_handed_back_request_is_resumed_without_counting_a_takeover(worker_services, workspace):
    request_id, provider = admitted(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "[stub:latency=0.2]"})
    store = worker_services.store
    for n in range(worker_services.settings.max_takeovers + 2):  # more restarts than takeovers allowed
        token = f"worker-{n}"
        assert store.claim(record_of(worker_services, request_id, provider),
                           Lease(token, 30, 3600, worker_services.settings.max_takeovers)) in ("CLAIMED", "RESUMED")
        assert store.renew(request_id, provider, token, 0, hand_back=True)
    assert deliver_until_done(context_of(worker_services), request_id) == "completed"


# -- the state store failing under a running generation --------------------------------------


def test_the_outcome_is_written_through_a_redis_restart(worker_services, workspace, monkeypatch):
    store, calls = worker_services.store, []
    real_complete = store.complete

    def restarting(*args, **kwargs):
        calls.append(kwargs.get("error_type", ""))
        if len(calls) <= 2:
            raise redis.ConnectionError("Connection refused")
        return real_complete(*args, **kwargs)

    monkeypatch.setattr(store, "complete", restarting)
    monkeypatch.setattr("workers.delivery.STORE_RETRY_S", (0.01, 0.02))
    body = {"input": "said once", "voice": "alloy"}
    outcome, record, request_id = run(worker_services, workspace, "openai/gpt-4o-mini-tts", body)
    assert (outcome, record.status, record.error_type) == ("completed", COMPLETED, None)
    assert calls == ["", "", ""]  # the same success, three times: never turned into an error
    assert store.result(request_id)


def test_a_cancel_flag_that_cannot_be_read_does_not_stop_the_generation(worker_services, workspace, monkeypatch):
    def stalled(request_id):
        raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(worker_services.store, "cancel_requested", stalled)
    outcome, record, _ = run(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "stall [stub:latency=0.3]"})
    assert (outcome, record.status, record.error_type) == ("completed", COMPLETED, None)


def test_a_second_account_is_a_catalog_entry_and_a_variable(client, stub_origin, tmp_path):
    """A second BFL account: a provider entry naming its own key's variable, and
    models under it that use the bfl adapter. No code names either."""
    catalog = json.loads(DEFAULT_CATALOG.read_text())
    catalog["providers"]["bfl-eu"] = {"max_in_flight": 7, "credentials": {"kind": "api_key", "env": "BFL_EU_API_KEY"}}
    catalog["models"]["bfl-eu/flux-2-pro"] = catalog["models"]["bfl/flux-2-pro"]
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog))
    settings = Settings.from_env({"CATALOG_PATH": str(path), "BFL_API_KEY": "us-key", "BFL_EU_API_KEY": "eu-key"},
                                 provider_origin_override=stub_origin, default_rate_limit="1000/second")
    services = Services.build(settings, client, dispatcher=RecordingDispatcher())
    assert services.catalog.max_in_flight("bfl-eu") == 7 and "bfl-eu" in services.catalog.providers()
    dispatcher = services.dispatcher
    http = create_app(settings, services=services).test_client()
    workspace = services.accounts.create_workspace("eu", queue_enabled=True, credits=1000)
    auth = {"X-API-Key": services.accounts.mint_key(workspace), "Content-Type": "application/json"}
    ids = {}
    for model in ("bfl/flux-2-pro", "bfl-eu/flux-2-pro"):
        answer = http.post(f"/v2/models/{model}/requests", data=json.dumps({"prompt": f"teapot {model}"}), headers=auth)
        assert answer.status_code == 201, answer.get_data(as_text=True)
        ids[model] = answer.json["request_id"]
    assert sorted(provider for _, provider in dispatcher.published) == ["bfl", "bfl-eu"]
    for model, key in (("bfl/flux-2-pro", "us-key"), ("bfl-eu/flux-2-pro", "eu-key")):
        session = KeyRecordingSession()
        assert deliver_until_done(context_of(services, session), ids[model]) == "completed"
        assert session.keys and {sent for _, sent in session.keys} == {key}, model


def test_a_missing_key_is_a_provider_error_that_names_no_variable(services, workspace, stub_origin, caplog):
    services.settings = dataclasses.replace(services.settings, provider_origin_override=stub_origin,
                                            provider_credentials={})
    session = KeyRecordingSession()
    request_id, provider = admitted(services, workspace, "bfl/flux-2-pro", {"prompt": "teapot"})
    with caplog.at_level("ERROR", logger="workers.credentials"):
        outcome = deliver_until_done(context_of(services, session), request_id)
    record = services.store.status_view(request_id, provider).record
    assert (outcome, record.status, record.error_type) == ("provider_error", COMPLETED, "provider_error")
    assert record.attempts == services.catalog.by_id("bfl/flux-2-pro").policy.max_attempts
    assert "credential" in record.detail and "BFL_API_KEY" not in record.detail
    assert "BFL_API_KEY is not set" in caplog.text
    assert session.keys == [], "nothing was sent to the provider without a key"


def test_a_delivery_held_past_its_limit_loses_its_lease_like_a_dead_one(services, caplog):
    """The threads pool enforces no Celery time limit: the heartbeat is the
    limit. A hung execution stops being renewed; a live one keeps its lease."""
    keeper = LeaseKeeper(services.store, services.settings.lease_s)
    keeper.hold("live", "bfl", "t-live", for_s=60)
    keeper.hold("hung", "bfl", "t-hung", for_s=-1)
    with caplog.at_level("ERROR", logger="workers.leases"):
        assert keeper.held() == [("live", "bfl", "t-live")]
    assert "request hung (bfl) ran past its limit" in caplog.text
    assert keeper.held() == [("live", "bfl", "t-live")]  # said once


def test_the_limit_covers_the_run_bound_and_one_more_exchange():
    entry = Catalog.load(DEFAULT_CATALOG).by_id("vertexai/gemini-3.1-flash-image")
    policy = entry.policy
    assert policy.hung_after_s == policy.max_run_s + policy.connect_timeout_s + policy.read_timeout_s \
        + policy.backoff_max_s
    assert policy.hung_after_s > policy.max_run_s


def _sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_deliverys_metrics_are_counted_in_its_process_and_cost_redis_nothing(worker_services, workspace):
    """Claimed, the provider exchange and the completion are counted in the
    worker's memory; Redis keeps only what complete.lua writes anyway."""
    model = {"provider": "vertexai", "model": "vertexai/gemini-3.1-flash-image"}
    names = ("router_queue_wait_seconds_count", "router_queue_call_seconds_count", "router_queue_run_seconds_count")
    before = [_sample(name, **model) for name in names]
    succeeded = _sample("router_queue_completions_total", outcome="success", **model)
    body = {"contents": [{"role": "user", "parts": [{"text": "counted once"}]}]}
    outcome, _, _ = run(worker_services, workspace, "vertexai/gemini-3.1-flash-image", body)
    assert outcome == "completed"
    assert [_sample(name, **model) - was for name, was in zip(names, before)] == [1, 1, 1]
    assert _sample("router_queue_completions_total", outcome="success", **model) == succeeded + 1
    assert not list(worker_services.redis.scan_iter(keys.PREFIX + ":metrics*"))
    assert worker_services.store.delivery_totals("vertexai").completed == 1


def test_a_fresh_claim_calls_the_provider_without_reading_the_cancel_flag(worker_services, workspace, monkeypatch):
    """The claim found no cancel (a queued request's cancel ends it at once), so
    the step right after it saves the round trip."""
    reads = []
    monkeypatch.setattr(worker_services.store, "cancel_requested", lambda request_id: reads.append(request_id))
    body = {"contents": [{"role": "user", "parts": [{"text": "no flag to read"}]}]}
    outcome, _, _ = run(worker_services, workspace, "vertexai/gemini-3.1-flash-image", body)
    assert (outcome, reads) == ("completed", [])


def test_a_resumed_request_cancelled_while_it_ran_elsewhere_stops_before_calling(worker_services, workspace):
    body = {"contents": [{"role": "user", "parts": [{"text": "cancelled on the first worker"}]}]}
    request_id, provider = admitted(worker_services, workspace, "vertexai/gemini-3.1-flash-image", body)
    store = worker_services.store
    lease = Lease("first-worker", 30, 3600, worker_services.settings.max_takeovers)
    assert store.claim(record_of(worker_services, request_id, provider), lease) == "CLAIMED"
    assert store.cancel(request_id=request_id, workspace=workspace, model="vertexai/gemini-3.1-flash-image",
                        provider=provider) == "REQUESTED"
    assert store.renew(request_id, provider, "first-worker", 0, hand_back=True)  # it stopped warm
    session = KeyRecordingSession()
    assert deliver(context_of(worker_services, session), request_id, execution()) == "cancelled"
    assert session.keys == []  # the provider was never called
    assert store.status_view(request_id, provider).record.error_type == "cancelled"
