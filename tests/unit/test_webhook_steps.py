"""Webhooks for each step (issue 21, item 5), on fakeredis and a real Redis:
choosing the events (``X-Comfy-Webhook-Events``, the workspace's default),
each event's own stable ``webhook-id``, a request's events delivered one at a
time in the order owed, progress throttled and coalesced, and the workspace's
pending-webhook count, one per request, never drifting."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from standardwebhooks import Webhook
from werkzeug.test import Client

from router_queue.services import Services
from router_queue.store import keys
from router_queue.store.requests_values import WEBHOOK_DUE, Lease
from router_queue.store.webhooks import DeliveryLimits, WebhookStore
from router_queue.web.app import create_app
from router_queue.webhooks import event as webhook_event
from tests.unit.conftest import RecordingDispatcher
from tests.unit.support import cli_runner, context_of, deliver_webhook, record_of
from tests.unit.webhook_support import Receiver

FLUX = "bfl/flux-2-pro"
LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)
HOOK = "http://127.0.0.1:9/hook"
ALL = "started,progress,completed"


@pytest.fixture
def hooked(services, workspace, settings):
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    return services


def submit(http, auth, *, url: str | None = HOOK, events: str | None = ALL):
    headers = dict(auth)
    if url is not None:
        headers["X-Comfy-Webhook-Url"] = url
    if events is not None:
        headers["X-Comfy-Webhook-Events"] = events
    return http.post(f"/v2/models/{FLUX}/requests", json={"prompt": "a teapot"}, headers=headers)


def admitted(http, auth, **kwargs) -> str:
    response = submit(http, auth, **kwargs)
    assert response.status_code == 201, response.json
    return response.json["request_id"]


def claim(services, request_id: str, now: float | None = None) -> None:
    assert services.store.claim(record_of(services, request_id, "bfl"), LEASE, now=now) == "CLAIMED"


def complete(services, request_id: str) -> None:
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")


def deliver(services, request_id: str, now: float, outcome: str = "delivered", token: str | None = None,
            next_at: float | None = None) -> str:
    """One attempt at the request's event being delivered, recorded as ``outcome``."""
    token = token or f"t{now}"
    taken = services.webhooks.take(request_id, now=now, lease_s=30, token=token)
    assert taken.outcome == "TAKEN", taken
    return services.webhooks.record(taken.event, token=token, now=now, outcome=outcome,
                                    status=204 if outcome == "delivered" else 500, error="", seconds=0.01,
                                    next_at=next_at)


def head(services, request_id: str) -> tuple[str, str, str]:
    event = services.webhooks.event(request_id)
    return event.get("type", ""), event.get("msg_id", ""), event.get("state", "")


def pending(services, workspace: str) -> int:
    return services.accounts.get(workspace).webhooks_pending


# -- choosing the events --------------------------------------------------------------------------


@pytest.mark.parametrize("raw, canonical", [
    ("completed", "completed"), ("started,progress,completed", ALL), (" completed , started ,started", "started,completed"),
    ("progress", "progress"), ("progress,,started", "started,progress"),
])
def test_the_events_header_is_read_in_any_order_and_spacing(raw, canonical):
    assert webhook_event.parse_events(raw) == canonical


@pytest.mark.parametrize("raw", ["", " , ", "started,finished", "request.started", "STARTED", "logs"])
def test_an_unknown_event_or_none_is_refused(raw):
    with pytest.raises(webhook_event.UnknownEvents):
        webhook_event.parse_events(raw)


def test_the_submit_refuses_bad_events_and_events_without_a_webhook(hooked, http, auth, workspace):
    for raw in ("started,finished", "", " , "):
        response = submit(http, auth, events=raw)
        assert response.status_code == 400 and response.json["error_type"] == "invalid_input", raw
        assert "X-Comfy-Webhook-Events" in response.json["detail"]
    response = submit(http, auth, url=None, events="started")
    assert response.status_code == 400 and response.json["error_type"] == "invalid_input"
    assert "no webhook" in response.json["detail"] and "X-Comfy-Webhook-Url" in response.json["detail"]
    assert pending(hooked, workspace) == 0
    # on the synchronous route alike, before anything is held or admitted
    response = http.post(f"/v2/models/{FLUX}", json={"prompt": "p"}, headers={**auth, "X-Comfy-Webhook-Events": "x"})
    assert response.status_code == 400 and "X-Comfy-Webhook-Events" in response.json["detail"]


def test_the_workspace_default_chooses_unless_the_request_does(hooked, http, auth, workspace):
    hooked.accounts.set_webhook_url(workspace, "http://127.0.0.1:9/default")
    hooked.accounts.set_webhook_events(workspace, "started,completed")
    by_default = admitted(http, auth, url=None, events=None)
    own_url = admitted(http, auth, events=None)
    own_events = admitted(http, auth, url=None, events="progress")
    stored = {rid: hooked.redis.hget(keys.request(rid), "webhook_events") for rid in (by_default, own_url, own_events)}
    assert stored == {by_default: b"started,completed", own_url: b"started,completed", own_events: b"progress"}
    hooked.accounts.set_webhook_events(workspace, None)
    plain = admitted(http, auth, url=None, events=None)
    assert hooked.redis.hget(keys.request(plain), "webhook_events") is None  # "completed", as before
    # the default URL makes the header valid without X-Comfy-Webhook-Url
    claim(hooked, own_events)
    assert hooked.webhooks.event(own_events) == {}  # progress only: nothing at the start


def test_the_lane_and_flask_admit_the_header_alike(hooked, app, http, auth):
    flask_only = Client(app.wsgi_app.flask)
    ids = []
    for client in (http, flask_only):
        response = client.post(f"/v2/models/{FLUX}/requests", json={"prompt": "p"},
                               headers={**auth, "X-Comfy-Webhook-Url": HOOK,
                                        "X-Comfy-Webhook-Events": "completed, started"})
        assert response.status_code == 201, response.get_data()
        ids.append(response.json["request_id"])
    assert [hooked.redis.hget(keys.request(i), "webhook_events") for i in ids] == [b"started,completed"] * 2


def test_the_cli_sets_the_default_events(app, hooked, workspace):
    from router_queue.cli import main
    runner = cli_runner(app)
    done = runner.invoke(main, ["workspace", "set-webhook", workspace, "--events", "progress, started"])
    assert done.exit_code == 0, done.output
    assert hooked.accounts.webhook_events(workspace) == "started,progress"
    refused = runner.invoke(main, ["workspace", "set-webhook", workspace, "--events", "begun"])
    assert refused.exit_code == 2 and "begun" in refused.output
    assert runner.invoke(main, ["workspace", "set-webhook", workspace, "--off"]).exit_code == 0
    assert hooked.accounts.webhook_events(workspace) is None


# -- ids and order ----------------------------------------------------------------------------------


def test_each_event_has_its_own_id_and_they_are_delivered_in_order(hooked, http, auth, workspace):
    request_id = admitted(http, auth)
    t0 = time.time()
    claim(hooked, request_id, now=t0)
    assert head(hooked, request_id) == ("started", f"msg_{request_id}_started", "pending")
    assert hooked.webhooks.owed(request_id)
    # behind the started event not yet delivered: queued, then a newer value coalesced into it
    assert hooked.store.record_progress(request_id, LEASE.token, 0.2, now=t0 + 0.1) == 1
    assert hooked.store.record_progress(request_id, LEASE.token, 0.3, now=t0 + 0.5) == 1
    complete(hooked, request_id)
    queued = hooked.webhooks.queued(request_id)
    assert [(e["type"], e["msg_id"], e["progress"]) for e in queued] == [
        ("progress", f"msg_{request_id}_progress_1", "0.3"), ("completed", f"msg_{request_id}", "")]

    now = time.time() + 1
    # only the head is ever taken: the next events wait for it to end
    assert deliver(hooked, request_id, now, outcome="failed", next_at=now + 5) == "RETRY"
    assert head(hooked, request_id)[0] == "started"
    assert hooked.webhooks.take(request_id, now=now + 1, lease_s=30, token="x").outcome == "NOT_DUE"
    assert deliver(hooked, request_id, now + 5) == "DELIVERED"
    assert head(hooked, request_id) == ("progress", f"msg_{request_id}_progress_1", "pending")
    assert hooked.webhooks.owed(request_id)  # due at once
    event = hooked.webhooks.event(request_id)
    assert event["attempts"] == "0" and event["status"] == "IN_PROGRESS" and event["progress"] == "0.3"
    assert deliver(hooked, request_id, now + 6) == "DELIVERED"
    assert head(hooked, request_id) == ("completed", f"msg_{request_id}", "pending")
    assert deliver(hooked, request_id, now + 7) == "DELIVERED"
    assert head(hooked, request_id) == ("completed", f"msg_{request_id}", "delivered")
    assert hooked.webhooks.pending() == 0 and hooked.webhooks.queued(request_id) == []
    assert pending(hooked, workspace) == 0
    assert [(a.request_id, a.outcome) for a in hooked.webhooks.attempts(workspace)][::-1] == [
        (request_id, "failed"), (request_id, "delivered"), (request_id, "delivered"), (request_id, "delivered")]


def test_a_worker_delivers_each_event_signed_in_order_after_a_failed_started(hooked, http, auth, workspace):
    secret = webhook_event.new_secret()
    hooked.accounts.webhook_secret(workspace, secret, rotate=True)
    hook = Receiver([500])
    try:
        request_id = admitted(http, auth, url=hook.url)
        context = context_of(hooked)
        claim(hooked, request_id)
        assert deliver_webhook(context, request_id) == "retry"  # the started event fails once
        assert hooked.store.record_progress(request_id, LEASE.token, 0.4) == 1  # queued behind it
        complete(hooked, request_id)
        assert deliver_webhook(context, request_id) == "not_due"
        hooked.redis.hset(keys.webhook_event(request_id), "next_at", 0)
        published = context.dispatcher.published
        for _ in range(3):
            before = len(published)
            assert deliver_webhook(context, request_id) == "delivered"
        assert published[before:] == []  # nothing left to publish after the last
        assert published.count((request_id, "webhook")) == 2  # each next event, published at once
        assert deliver_webhook(context, request_id) == "done"
    finally:
        hook.close()
    events = [(headers["webhook-id"], Webhook(secret).verify(body, headers)) for headers, body in hook.got]
    assert [(msg_id, e["type"]) for msg_id, e in events] == [
        (f"msg_{request_id}_started", "request.started"), (f"msg_{request_id}_started", "request.started"),
        (f"msg_{request_id}_progress_1", "request.progress"), (f"msg_{request_id}", "request.completed")]
    started, _, progress, completed = (e for _, e in events)
    assert started["status"] == "IN_PROGRESS" and started["started_at"] and started["completed_at"] is None
    assert "progress" not in started and progress["progress"] == 0.4 and progress["status"] == "IN_PROGRESS"
    assert completed["status"] == "COMPLETED" and completed["error_type"] is None and "progress" not in completed
    assert hook.got[0][1] == hook.got[1][1]  # the same bytes on every attempt of one event


def test_a_late_attempt_at_an_ended_event_does_not_end_the_next(hooked, http, auth):
    request_id = admitted(http, auth, events="started,completed")
    claim(hooked, request_id)
    complete(hooked, request_id)
    now = time.time()
    late = hooked.webhooks.take(request_id, now=now, lease_s=1, token="late")  # its lease runs out
    assert deliver(hooked, request_id, now + 2, token="second") == "DELIVERED"  # another delivered started
    assert head(hooked, request_id) == ("completed", f"msg_{request_id}", "pending")
    # the first attempt's 2xx arrives now: the started event is over, the completed one stays owed
    assert hooked.webhooks.record(late.event, token="late", now=now + 3, outcome="delivered", status=204, error="",
                                  seconds=3, next_at=None) == "DONE"
    assert head(hooked, request_id)[2] == "pending" and hooked.webhooks.owed(request_id)


# -- progress: throttled, coalesced ----------------------------------------------------------------


def test_progress_events_are_throttled_and_the_latest_value_wins(hooked, http, auth):
    request_id = admitted(http, auth, events="progress")
    t0 = time.time()
    claim(hooked, request_id, now=t0)
    assert hooked.store.record_progress(request_id, LEASE.token, 0.1, now=t0) == WEBHOOK_DUE
    # not yet attempted: a newer value replaces it, whenever it comes
    assert hooked.store.record_progress(request_id, LEASE.token, 0.2, now=t0 + 0.5) == 1
    assert hooked.webhooks.event(request_id)["progress"] == "0.2"
    hooked.webhooks.take(request_id, now=t0 + 0.6, lease_s=30, token="a")  # on its way
    # within 2 s of the last one owed: no new event
    assert hooked.store.record_progress(request_id, LEASE.token, 0.3, now=t0 + 1.9) == 1
    assert hooked.webhooks.queued(request_id) == []
    # past 2 s: a new one, behind the one on its way, which later values coalesce into
    assert hooked.store.record_progress(request_id, LEASE.token, 0.4, now=t0 + 2.1) == 1
    assert hooked.store.record_progress(request_id, LEASE.token, 0.5, now=t0 + 2.3) == 1
    assert hooked.store.record_progress(request_id, LEASE.token, 0.6, now=t0 + 5.0) == 1
    assert [(e["msg_id"], e["progress"]) for e in hooked.webhooks.queued(request_id)] == [
        (f"msg_{request_id}_progress_2", "0.6")]
    event = hooked.webhooks.event(request_id)
    assert (event["msg_id"], event["progress"]) == (f"msg_{request_id}_progress_1", "0.2")  # its bytes unchanged


def test_the_progress_interval_is_the_setting(client, settings):
    """WEBHOOK_PROGRESS_EVERY_SECONDS reaches progress.lua through ``Services.build``."""
    settings = dataclasses.replace(settings, webhook_allow_loopback_http=True, webhook_progress_every_s=10.0)
    services = Services.build(settings, client, dispatcher=RecordingDispatcher())
    workspace = services.accounts.create_workspace("acme", queue_enabled=True, credits=1000)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    auth = {"X-API-Key": services.accounts.mint_key(workspace)}
    request_id = admitted(create_app(settings, services=services).test_client(), auth, events="progress")
    t0 = time.time()
    claim(services, request_id, now=t0)
    assert services.store.record_progress(request_id, LEASE.token, 0.1, now=t0) == WEBHOOK_DUE
    services.webhooks.take(request_id, now=t0 + 0.1, lease_s=30, token="a")  # on its way
    assert services.store.record_progress(request_id, LEASE.token, 0.2, now=t0 + 5.0) == 1
    assert services.webhooks.queued(request_id) == []  # past the default 2 s, within the setting's 10
    services.store.record_progress(request_id, LEASE.token, 0.3, now=t0 + 10.5)
    assert [e["msg_id"] for e in services.webhooks.queued(request_id)] == [f"msg_{request_id}_progress_2"]


def test_requests_without_the_progress_event_owe_none(hooked, http, auth):
    request_id = admitted(http, auth, events="completed")
    claim(hooked, request_id)
    assert hooked.store.record_progress(request_id, LEASE.token, 0.5) == 1
    assert hooked.webhooks.event(request_id) == {} and hooked.webhooks.pending() == 0


# -- the pending-webhook count: one per request, from admission to its last event's end ------------


def test_the_count_is_held_until_the_last_event_ends(hooked, http, auth, workspace):
    request_id = admitted(http, auth)
    assert pending(hooked, workspace) == 1
    claim(hooked, request_id)
    now = time.time() + 1
    assert deliver(hooked, request_id, now) == "DELIVERED"  # started, while it runs
    assert pending(hooked, workspace) == 1
    hooked.store.record_progress(request_id, LEASE.token, 0.5, now=now)
    complete(hooked, request_id)
    assert pending(hooked, workspace) == 1
    assert deliver(hooked, request_id, now + 1) == "DELIVERED"  # progress
    assert pending(hooked, workspace) == 1
    assert deliver(hooked, request_id, now + 2) == "DELIVERED"  # completed, its last
    assert pending(hooked, workspace) == 0


def test_without_the_completed_event_the_count_ends_with_the_request_or_its_last_event(hooked, http, auth, workspace):
    # its started event delivered while it ran: given back when it completes
    ran = admitted(http, auth, events="started")
    claim(hooked, ran)
    assert deliver(hooked, ran, time.time() + 1) == "DELIVERED"
    assert pending(hooked, workspace) == 1
    complete(hooked, ran)
    assert pending(hooked, workspace) == 0
    # cancelled while queued: never started, nothing owed, given back at once
    cancelled = admitted(http, auth, events="started,progress")
    assert http.put(f"/v2/models/{FLUX}/requests/{cancelled}/cancel", headers=auth).status_code == 202
    assert pending(hooked, workspace) == 0 and hooked.webhooks.event(cancelled) == {}
    # completed while its started event is still owed: given back when that one ends (here, given up)
    slow = admitted(http, auth, events="started")
    claim(hooked, slow)
    complete(hooked, slow)
    assert pending(hooked, workspace) == 1
    assert deliver(hooked, slow, time.time() + 1, outcome="failed", next_at=None) == "GAVE_UP"
    assert pending(hooked, workspace) == 0


def test_the_count_never_drifts_whatever_the_events_and_outcomes(hooked, http, auth, workspace):
    hooked.accounts.set_credits(workspace, 100_000)
    # neither a circuit nor a cap in the way: every event may be tried at any time
    hooked.webhooks = WebhookStore(hooked.redis, keep_s=600,
                                   limits=DeliveryLimits(max_in_flight_per_workspace=0, circuit_failures=0),
                                   providers=hooked.webhooks.providers)
    rand = random.Random(21)
    choices = ["completed", "started", "progress", "started,completed", "progress,completed", ALL]
    live = []
    for n in range(24):
        request_id = admitted(http, auth, events=rand.choice(choices))
        if rand.random() < 0.2:
            http.put(f"/v2/models/{FLUX}/requests/{request_id}/cancel", headers=auth)
        else:
            claim(hooked, request_id)
            for step in range(rand.randint(0, 3)):
                hooked.store.record_progress(request_id, LEASE.token, 0.2 * (step + 1), now=time.time() + 3 * step)
            complete(hooked, request_id)
        live.append(request_id)
    now = time.time() + 10
    for _ in range(200):  # deliver, fail or give up every event, in a random order of requests
        owed = [rid for rid in live if hooked.webhooks.owed(rid)]
        if not owed:
            break
        request_id = rand.choice(owed)
        hooked.redis.hset(keys.webhook_event(request_id), "next_at", 0)
        outcome = rand.choice(["delivered", "gone", "failed", "failed"])
        next_at = None if outcome != "failed" or rand.random() < 0.5 else now
        deliver(hooked, request_id, now, outcome=outcome, next_at=next_at)
        now += 0.01
        still = sum(1 for rid in live if hooked.webhooks.owed(rid))
        assert pending(hooked, workspace) == still  # every completed request with an event owed, and only those
    assert pending(hooked, workspace) == 0 and hooked.webhooks.pending() == 0
