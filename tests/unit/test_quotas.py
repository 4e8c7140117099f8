"""Per-workspace quotas (``store/quotas.py``), on fakeredis and on a real Redis:
held connections, stored body bytes, pending webhook events. Each refuses at
its cap with a 429 and ``Retry-After``, is freed when what it counts ends, and
never drifts whatever mix of endings happens."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from router_queue.services import Services
from router_queue.store import keys
from router_queue.store.held import HeldSlots
from router_queue.store.quotas import DEFAULT_MAX_HELD, DEFAULT_MAX_PENDING_WEBHOOKS, DEFAULT_MAX_QUEUED_BYTES
from router_queue.store.record import Submission
from router_queue.store.requests_values import Lease
from router_queue.web import routes
from router_queue.web.app import create_app
from router_queue.web.front import EXTENSION
from router_queue.webhooks import event as webhook_event
from tests.unit.conftest import RecordingDispatcher
from tests.unit.support import cli_runner, record_of

MODEL = "bfl/flux-2-pro"
FLUX = f"/v2/models/{MODEL}"
HOOK = "http://127.0.0.1:9/hook"


def assert_429(response, bucket):
    assert response.status_code == 429, response.get_data(as_text=True)
    assert response.headers["X-Comfy-Error-Type"] == bucket == response.json["error_type"]
    assert response.json["detail"]
    assert int(response.headers["Retry-After"]) >= 1


def counters(services, workspace):
    ws = services.accounts.get(workspace)
    return ws.queued_bytes, ws.webhooks_pending


def admit(services, workspace, body='{"prompt": "x"}', webhook_url=""):
    request_id = services.ids.mint(workspace, MODEL)
    outcome = services.store.admit(Submission(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl",
                                   body=body, webhook_url=webhook_url))
    return request_id, outcome.outcome


def lease(token="t", queue_timeout_s=3600.0, max_takeovers=3):
    return Lease(token=token, lease_s=30.0, queue_timeout_s=queue_timeout_s, max_takeovers=max_takeovers)


@pytest.fixture
def hooked(services, workspace, settings):
    """Webhooks to loopback allowed, and the workspace has its signing secret."""
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    return services


def test_defaults_are_generous_and_set_limits_stores_each_quota(app, services, workspace):
    assert (DEFAULT_MAX_HELD, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_PENDING_WEBHOOKS) == (100, 256 << 20, 1000)
    from router_queue.cli import main
    done = cli_runner(app).invoke(main, ["workspace", "set-limits", workspace, "--max-held", "3",
                                               "--max-queued-bytes", "4096", "--max-pending-webhooks", "7"])
    assert done.exit_code == 0, done.output
    ws = services.accounts.get(workspace)
    assert (ws.max_held, ws.max_queued_bytes, ws.max_pending_webhooks) == (3, 4096, 7)
    refused = cli_runner(app).invoke(main, ["workspace", "set-limits", workspace, "--max-held", "-1"])
    assert refused.exit_code == 2


# -- stored body bytes ----------------------------------------------------------------


def test_the_byte_quota_refuses_the_body_that_would_pass_it_and_frees_at_completion(services, workspace):
    body = json.dumps({"prompt": "x" * 30})  # 44 bytes
    services.accounts.set_limits(workspace, max_queued_bytes=2 * len(body) + 20)
    first, ok1 = admit(services, workspace, body)
    _, ok2 = admit(services, workspace, body)
    assert (ok1, ok2) == ("ADMITTED", "ADMITTED")
    assert counters(services, workspace)[0] == 2 * len(body)
    refused_id, refused = admit(services, workspace, body)
    assert refused == "QUEUED_BYTES_FULL"
    assert services.store.status_view(refused_id, "bfl").record is None  # nothing written
    assert admit(services, workspace, '{"prompt":"y"}')[1] == "ADMITTED"  # a smaller one still fits
    record = record_of(services, first, "bfl")
    services.store.claim(record, lease())
    assert counters(services, workspace)[0] == 2 * len(body) + 14  # running: its body is still stored
    services.store.complete(record, output=b"{}", content_type="application/json")
    assert counters(services, workspace)[0] == len(body) + 14
    services.store.complete(record, output=b"{}", content_type="application/json")  # a duplicate gives nothing back
    assert counters(services, workspace)[0] == len(body) + 14
    assert admit(services, workspace, body)[1] == "ADMITTED"


def test_the_byte_quota_answers_429_queued_bytes_full(http, services, workspace, auth, dispatcher):
    services.accounts.set_limits(workspace, max_queued_bytes=30)
    assert http.post(f"{FLUX}/requests", json={"prompt": "short"}, headers=auth).status_code == 201
    refused = http.post(f"{FLUX}/requests", json={"prompt": "a longer prompt than that"}, headers=auth)
    assert_429(refused, "queued_bytes_full")
    assert len(dispatcher.published) == 1
    assert services.accounts.get(workspace).queued == 1  # nothing else admitted


def test_body_bytes_never_drift_whatever_ends_the_requests(services, workspace):
    """Completed, failed, cancelled while queued or while granted, flagged while
    running, timed out in the queue, given up after its workers died: each
    gives its bytes back once, and the counter ends at zero."""
    store = services.store
    ids = [admit(services, workspace, json.dumps({"prompt": "p" * n}))[0] for n in range(1, 9)]
    total = sum(len(json.dumps({"prompt": "p" * n})) for n in range(1, 9))
    assert counters(services, workspace)[0] == total
    done, failed, cancel_granted, cancel_running, timed_out, exhausted, expired, late = ids
    for request_id in (done, failed, cancel_running):
        store.claim(record_of(services, request_id, "bfl"), lease())
    store.complete(record_of(services, done, "bfl"), output=b"{}", content_type="application/json")
    store.complete(record_of(services, failed, "bfl"), error_type="provider_error", detail="x")
    for request_id in (cancel_granted, cancel_running):
        store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")
    store.complete(record_of(services, cancel_running, "bfl"), error_type="cancelled", detail="stopped")
    # a queue timeout noticed by the claim, and one by the sweeper
    store.claim(record_of(services, timed_out, "bfl"), lease(queue_timeout_s=0))
    record = services.store.status_view(expired, "bfl").record
    assert store.expire_queued(expired, "bfl", workspace, queue_timeout_s=0, now=record.created_at + 1)
    # a request whose workers kept dying: taken over past the limit
    store.claim(record_of(services, exhausted, "bfl"), lease("a", max_takeovers=0))
    services.redis.hset(keys.request(exhausted), "lease_until", 0)
    store.claim(record_of(services, exhausted, "bfl"), lease("b", max_takeovers=0))
    store.claim(record_of(services, late, "bfl"), lease())
    store.complete(record_of(services, late, "bfl"), output=b"{}", content_type="application/json")
    # every ending again, as duplicates and races would
    store.complete(record_of(services, done, "bfl"), error_type="provider_error", detail="again")
    store.cancel(request_id=cancel_granted, workspace=workspace, model=MODEL, provider="bfl")
    assert store.expire_queued(expired, "bfl", workspace, queue_timeout_s=0, now=time.time() + 10) is False
    statuses = {store.status_view(i, "bfl").record.status for i in ids}
    assert statuses == {"COMPLETED"}
    assert counters(services, workspace)[0] == 0
    # successes delete their body; a failed request keeps it (no longer
    # counted) for its retention, so that it can be retried
    assert [services.redis.exists(keys.body(i)) for i in (done, late)] == [0, 0]
    for request_id in (failed, cancel_granted, cancel_running, timed_out, exhausted, expired):
        assert 0 < services.redis.ttl(keys.body(request_id)) <= services.settings.result_retention_s


def test_racing_admissions_never_pass_the_byte_quota(services, workspace):
    body = json.dumps({"prompt": "r" * 86})  # 100 bytes
    assert len(body) == 100
    services.accounts.set_limits(workspace, max_queued_bytes=1000)
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda _: admit(services, workspace, body)[1], range(30)))
    assert outcomes.count("ADMITTED") == 10 and outcomes.count("QUEUED_BYTES_FULL") == 20
    assert counters(services, workspace)[0] == 1000


# -- pending webhook events -----------------------------------------------------------


def deliver(services, request_id, outcome="delivered", next_at=None):
    now = time.time()
    taken = services.webhooks.take(request_id, now=now, lease_s=30, token="t")
    assert taken.outcome == "TAKEN"
    return services.webhooks.record(taken.event, token="t", now=now, outcome=outcome,
                                    status=204 if outcome == "delivered" else 500, error="",
                                    seconds=0.01, next_at=next_at)


def test_pending_webhooks_are_held_from_admission_to_delivery(hooked, workspace):
    services = hooked
    services.accounts.set_limits(workspace, max_pending_webhooks=2)
    first, _ = admit(services, workspace, webhook_url=HOOK)
    second, _ = admit(services, workspace, webhook_url=HOOK)
    assert counters(services, workspace)[1] == 2
    assert admit(services, workspace, webhook_url=HOOK)[1] == "PENDING_WEBHOOKS_FULL"
    assert admit(services, workspace)[1] == "ADMITTED"  # without a webhook it is not counted
    # a cancel owes the event at once: it still counts until delivered
    services.store.cancel(request_id=first, workspace=workspace, model=MODEL, provider="bfl")
    assert services.webhooks.event(first)["state"] == "pending"
    assert admit(services, workspace, webhook_url=HOOK)[1] == "PENDING_WEBHOOKS_FULL"
    assert deliver(services, first, "failed", next_at=time.time()) == "RETRY"  # a retry is still pending
    assert counters(services, workspace)[1] == 2
    assert deliver(services, first) == "DELIVERED"
    assert counters(services, workspace)[1] == 1
    assert admit(services, workspace, webhook_url=HOOK)[1] == "ADMITTED"


def test_the_workspace_default_webhook_counts_too_and_429_pending_webhooks_full(hooked, http, auth, workspace):
    services = hooked
    services.accounts.set_limits(workspace, max_pending_webhooks=1)
    assert http.post(f"{FLUX}/requests", json={"prompt": "a"}, headers={**auth, "X-Comfy-Webhook-Url": HOOK}
                     ).status_code == 201
    assert_429(http.post(f"{FLUX}/requests", json={"prompt": "b"}, headers={**auth, "X-Comfy-Webhook-Url": HOOK}),
               "pending_webhooks_full")
    services.accounts.set_webhook_url(workspace, "http://127.0.0.1:9/default")
    assert_429(http.post(f"{FLUX}/requests", json={"prompt": "c"}, headers=auth), "pending_webhooks_full")
    assert_429(http.post(FLUX, json={"prompt": "d"}, headers=auth), "pending_webhooks_full")  # the sync route too
    assert services.accounts.get(workspace).queued == 1


@pytest.mark.parametrize("split", [False, True], ids=["one step", "split"])
def test_pending_webhooks_never_drift(hooked, workspace, client, split):
    """Delivered, gone, given up, a stale attempt's report and a duplicate
    report: each event gives its count back once, in the step or, on a
    store split into per-slot steps, through the provider's owed set."""
    services = hooked
    if split:
        services = Services.build(services.settings, client, dispatcher=RecordingDispatcher(), split=True)
    ids = [admit(services, workspace, webhook_url=HOOK)[0] for _ in range(5)]
    legacy, _ = admit(services, workspace)  # no webhook: never counted
    assert counters(services, workspace)[1] == 5
    for request_id in ids[:3]:
        services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")
    for request_id in ids[3:]:
        services.store.claim(record_of(services, request_id, "bfl"), lease())
        services.store.complete(record_of(services, request_id, "bfl"), output=b"{}",
                                content_type="application/json")
    services.store.cancel(request_id=legacy, workspace=workspace, model=MODEL, provider="bfl")
    assert counters(services, workspace)[1] == 5
    assert deliver(services, ids[0]) == "DELIVERED"
    assert deliver(services, ids[1], "gone") == "GONE"
    assert deliver(services, ids[2], "failed", next_at=None) == "GAVE_UP"
    # an attempt whose lease was taken by another reports late: only the live one ends it
    now = time.time()
    stale = services.webhooks.take(ids[3], now=now, lease_s=30, token="old")
    live = services.webhooks.take(ids[3], now=now + 31, lease_s=30, token="new")
    assert services.webhooks.record(stale.event, token="old", now=now + 32, outcome="failed", status=500, error="",
                                    seconds=1, next_at=now + 40) == "STALE"
    assert counters(services, workspace)[1] == 2
    assert services.webhooks.record(live.event, token="new", now=now + 33, outcome="delivered", status=204,
                                    error="", seconds=1, next_at=None) == "DELIVERED"
    assert services.webhooks.record(live.event, token="new", now=now + 34, outcome="delivered", status=204,
                                    error="", seconds=1, next_at=None) == "DONE"
    assert deliver(services, ids[4]) == "DELIVERED"
    assert counters(services, workspace)[1] == 0
    assert services.redis.zcard(keys.owed("bfl")) == 0
    assert services.redis.hlen(keys.open_requests(workspace)) == 0


def test_an_event_owed_before_the_count_existed_gives_nothing_back(hooked, workspace):
    services = hooked
    request_id, _ = admit(services, workspace, webhook_url=HOOK)
    services.redis.hdel(keys.request(request_id), "webhook_counted")  # as admitted by an older version
    services.redis.hset(keys.workspace(workspace), "webhooks_pending", 0)
    services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")
    assert deliver(services, request_id) == "DELIVERED"
    assert counters(services, workspace)[1] == 0


# -- held connections -----------------------------------------------------------------


def test_held_slots_are_one_cap_across_processes_and_lapse_unless_renewed(services, workspace):
    clock = [1000.0]
    one = HeldSlots(services.redis, default_max=3, lease_s=60, clock=lambda: clock[0])
    two = HeldSlots(services.redis, default_max=3, lease_s=60, clock=lambda: clock[0])
    slots = [one.take(workspace), two.take(workspace), one.take(workspace)]
    assert all(slots)
    assert two.take(workspace) is None and one.take(workspace) is None
    assert one.take("ws_other") is not None  # another workspace's cap is its own
    one.release(slots[0])
    one.release(slots[0])  # twice: no effect
    assert two.held(workspace) == 2
    slot = two.take(workspace)
    assert slot and two.take(workspace) is None
    # process one is killed: its slot lapses at its lease's end; two renews its own
    clock[0] += 40
    two.renew()
    clock[0] += 30
    assert two.held(workspace) == 2
    assert two.take(workspace) is not None
    assert two.take(workspace) is None
    services.accounts.set_limits(workspace, max_held=4)  # the workspace's own cap wins
    assert two.take(workspace) is not None
    for door in (one, two):  # so their renewers end
        for held in list(door._held):
            door.release(held)
    assert one.holding() == two.holding() == 0


def test_racing_takes_never_pass_the_held_cap(services, workspace):
    services.accounts.set_limits(workspace, max_held=5)
    doors = [HeldSlots(services.redis) for _ in range(3)]
    with ThreadPoolExecutor(8) as pool:
        slots = list(pool.map(lambda n: doors[n % 3].take(workspace), range(30)))
    assert sum(1 for slot in slots if slot) == 5
    assert services.redis.zcard(keys.held(workspace)) == 5
    for n, slot in enumerate(slots):
        if slot:
            doors[n % 3].release(slot)
    assert services.redis.zcard(keys.held(workspace)) == 0


def test_the_renewer_runs_while_slots_are_held(services, workspace):
    held = HeldSlots(services.redis, lease_s=0.6)
    slot = held.take(workspace)
    time.sleep(1.0)  # past the first lease: renewed every 0.2 s
    assert held.held(workspace) == 1
    held.release(slot)
    assert held.held(workspace) == 0 and held.holding() == 0


@pytest.fixture
def held_app(settings, services):
    services.settings = dataclasses.replace(settings, sync_deadline_s=1.0)
    app = create_app(services.settings, services=services)
    return app


def fill(services, workspace, count):
    """Another front door's held connections, ``count`` of them."""
    other = HeldSlots(services.redis)
    return other, [other.take(workspace) for _ in range(count)]


def test_a_sync_call_past_the_cap_is_429_and_admits_nothing(held_app, services, workspace, auth):
    services.accounts.set_limits(workspace, max_held=2)
    other, slots = fill(services, workspace, 2)
    http = held_app.test_client()
    refused = http.post(FLUX, json={"prompt": "x"}, headers=auth)
    assert_429(refused, "held_calls_full")
    assert services.accounts.get(workspace).queued == 0 and services.store.queue_depth("bfl") == 0
    other.release(slots[0])
    answered = http.post(FLUX, json={"prompt": "x"}, headers=auth)
    assert answered.status_code == 504  # held until the deadline, then its slot given back
    assert held_app.extensions[EXTENSION].held.holding() == 0 and other.held(workspace) == 1
    other.release(slots[1])


def test_a_refused_sync_admission_gives_its_slot_back(held_app, services, workspace, auth):
    http = held_app.test_client()
    assert http.post(FLUX, json={"prompt": 5}, headers=auth).status_code == 422
    assert held_app.extensions[EXTENSION].held.holding() == 0
    assert services.redis.zcard(keys.held(workspace)) == 0


def test_an_event_stream_holds_a_slot_until_it_is_closed(held_app, services, workspace, auth):
    services.accounts.set_limits(workspace, max_held=1)
    http = held_app.test_client()
    request_id = http.post(f"{FLUX}/requests", json={"prompt": "x"}, headers=auth).json["request_id"]
    events = f"{FLUX}/requests/{request_id}/events"
    stream = http.get(events, headers=auth, buffered=False)
    assert stream.status_code == 200
    assert_429(http.get(events, headers=auth, buffered=False), "held_calls_full")
    assert_429(http.post(FLUX, json={"prompt": "y"}, headers=auth), "held_calls_full")  # one cap for both
    stream.close()  # never read: the server's close() still gives the slot back
    assert services.redis.zcard(keys.held(workspace)) == 0
    again = http.get(events, headers=auth, buffered=False)
    assert again.status_code == 200
    first = next(iter(again.response))
    assert "in_queue" in (first.decode() if isinstance(first, bytes) else first)
    again.close()
    assert services.redis.zcard(keys.held(workspace)) == 0


def test_held_sync_calls_share_the_process_subscription(held_app, services, workspace, auth):
    """Every held call follows its request on the one EventHub: no
    subscription of its own, and a completion wakes exactly its caller."""
    services.accounts.set_limits(workspace, max_held=10)
    front = held_app.extensions[EXTENSION]
    services.settings = dataclasses.replace(services.settings, sync_deadline_s=30.0)
    answers = {}

    def call(n):
        answers[n] = held_app.test_client().post(FLUX, json={"prompt": f"p{n}"}, headers=auth)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while front.events.following() < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert front.events.following() == 4 and front.held.holding() == 4
    for request_id in services.redis.zrange(keys.queue("bfl"), 0, -1):
        record = record_of(services, request_id.decode(), "bfl")
        services.store.claim(record, lease())
        services.store.complete(record, output=b'{"ok":1}', content_type="application/json")
    for thread in threads:
        thread.join(10)
    assert [answers[n].status_code for n in range(4)] == [200] * 4
    assert front.events.following() == 0 and front.held.holding() == 0


def test_refused_event_streams_give_their_slots_back(settings, services, workspace, auth, monkeypatch):
    """A stream refused after it was found (a Host the front door does not
    answer for, a fault before its response starts) holds no slot afterwards."""
    services.settings = dataclasses.replace(settings, public_base_url="", trusted_hosts=("router.test",))
    held_app = create_app(services.settings, services=services)
    services.accounts.set_limits(workspace, max_held=2)
    http = held_app.test_client()
    request_id = http.post(f"{FLUX}/requests", json={"prompt": "x"}, headers=auth,
                           base_url="http://router.test").json["request_id"]
    events = f"{FLUX}/requests/{request_id}/events"
    for _ in range(5):  # more than the cap
        refused = http.get(events, headers=auth, base_url="http://evil.test", buffered=False)
        assert refused.status_code == 400 and refused.json["error_type"] == "invalid_input"
    assert services.redis.zcard(keys.held(workspace)) == 0

    def broken(*args, **kwargs):
        raise RuntimeError("a fault as the stream starts")

    with monkeypatch.context() as patched:
        patched.setattr(routes, "stream", broken)
        for _ in range(3):
            assert http.get(events, headers=auth, base_url="http://router.test").status_code == 500
    assert services.redis.zcard(keys.held(workspace)) == 0
    stream = http.get(events, headers=auth, base_url="http://router.test", buffered=False)
    assert stream.status_code == 200
    stream.close()
    assert services.redis.zcard(keys.held(workspace)) == 0 and held_app.extensions[EXTENSION].held.holding() == 0
