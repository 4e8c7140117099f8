"""The webhook pool shared between workspaces (store/webhooks.py, on
fakeredis and a real Redis): each workspace's cap of attempts in flight, the
circuit per endpoint (a workspace's URL origin), origins only wherever an
operator looks, the failing endpoints trimmed; and an attempt's deadline
covering its connect (router_queue/webhooks/delivery.py, against sockets on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import time

import pytest

from router_queue.store import keys
from router_queue.store.webhooks import FAILING_KEPT, DeliveryLimits, WebhookStore
from router_queue.urls import origin
from router_queue.webhooks import event as webhook_event
from router_queue.webhooks.delivery import post
from tests.unit.support import cli_runner, context_of, deliver_webhook, record_of

FLUX = "bfl/flux-2-pro"
LIMITS = DeliveryLimits(max_in_flight_per_workspace=2, wait_s=1.0, circuit_failures=3, circuit_cooling_s=10.0,
                        window_s=3600.0)
#: A receiver URL whose path and query are its credential, as chat webhooks' are.
SECRET_URL = "http://127.0.0.1:9/services/T000/B000/s3cr3t-path?sig=s3cr3t-query"


@pytest.fixture
def hooked(services, settings):
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True)
    services.webhooks = WebhookStore(services.redis, keep_s=600, limits=LIMITS, rand=random.Random(7),
                                     providers=services.webhooks.providers)
    return services


def owing(services, http, name: str):
    """A new workspace and a function that makes it owe one event to a URL."""
    workspace = services.accounts.create_workspace(name, queue_enabled=True, credits=10_000)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    headers = {"X-API-Key": services.accounts.mint_key(workspace)}

    def owe(url: str) -> str:
        response = http.post(f"/v2/models/{FLUX}/requests", json={"prompt": "a teapot"},
                             headers={**headers, "X-Comfy-Webhook-Url": url})
        assert response.status_code == 201, response.json
        request_id = response.json["request_id"]
        services.store.complete(record_of(services, request_id, "bfl"), output=b"{}",
                                content_type="application/json")
        return request_id
    return workspace, owe


def take(store, request_id, now, token=None):
    return store.take(request_id, now=now, lease_s=30, token=token or f"t-{request_id}-{now}")


# -- the cap of attempts in flight per workspace -----------------------------------------------


def test_a_workspace_at_its_cap_waits_and_another_is_not_delayed(hooked, http):
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    flood_ws, flood = owing(hooked, http, "flood")
    _, calm = owing(hooked, http, "calm")
    flooded = [flood(f"http://127.0.0.1:9/hole/{n}") for n in range(5)]
    mine = calm("http://127.0.0.1:8/calm")

    first, second = (take(store, rid, now) for rid in flooded[:2])
    assert first.outcome == second.outcome == "TAKEN"
    waiting = take(store, flooded[2], now)
    assert waiting.outcome == "WAIT" and waiting.event is None
    assert now <= waiting.due_at < now + 2  # a random point of twice WEBHOOK_WAIT_SECONDS, then published again
    assert hooked.redis.zscore(keys.webhooks_due("bfl"), flooded[2]) == pytest.approx(waiting.due_at)
    # Waiting is not an attempt: nothing counted, nothing logged.
    assert hooked.webhooks.event(flooded[2]).get("attempts") == "0"
    assert store.attempts(flood_ws) == []
    # The other workspace's attempt goes at once, the flood at its cap notwithstanding.
    assert take(store, mine, now).outcome == "TAKEN"
    assert store.in_flight(now) == 3

    # A recorded attempt frees its slot: the next in line goes.
    assert store.record(first.event, token=f"t-{flooded[0]}-{now}", now=now + 1, outcome="failed", status=None,
                        error="no answer", seconds=1, next_at=now + 60) == "RETRY"
    assert take(store, flooded[2], now + 1).outcome == "TAKEN"
    assert take(store, flooded[3], now + 1).outcome == "WAIT"
    # A killed worker's slot (``second``'s, never recorded) frees itself at its lease's end.
    assert take(store, flooded[3], now + 29.5).outcome == "WAIT"
    assert take(store, flooded[3], now + 30.5).outcome == "TAKEN"


def _in_flight(services, workspace) -> set[bytes]:
    return set(services.redis.zrange(keys.webhook_in_flight(workspace), 0, -1))


def test_a_turn_held_for_an_event_not_taken_is_given_back_at_once(hooked, http, monkeypatch):
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    hooked.webhooks.limits = dataclasses.replace(LIMITS, max_in_flight_per_workspace=3)
    workspace, owe = owing(hooked, http, "raced")
    request_id = owe("http://127.0.0.1:9/x")
    assert take(store, request_id, now, token="first").outcome == "TAKEN"
    # A duplicate message: the event is busy, and no turn is held for it.
    assert take(store, request_id, now + 1, token="duplicate").outcome == "BUSY"
    assert _in_flight(hooked, workspace) == {b"first"}
    assert store.in_flight(now + 1) == 1

    # Another attempt takes the event between this one's turn and its take:
    # this one's turn is given back, the other's holds.
    again = owe("http://127.0.0.1:9/y")
    turn = store._turn

    def another_takes_it_meanwhile(**call):
        answer = turn(**call)
        monkeypatch.setattr(store, "_turn", turn)
        assert take(store, again, now, token="other").outcome == "TAKEN"
        return answer

    monkeypatch.setattr(store, "_turn", another_takes_it_meanwhile)
    assert take(store, again, now, token="late").outcome == "BUSY"
    assert _in_flight(hooked, workspace) == {b"first", b"other"}
    assert store.in_flight(now) == 2


def test_a_workspace_step_that_fails_after_the_events_is_logged_and_its_slot_frees_at_its_lease(
        hooked, http, monkeypatch, caplog):
    import redis
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    workspace, owe = owing(hooked, http, "unlucky")
    first, second, third = (owe(f"http://127.0.0.1:9/{n}") for n in range(3))
    taken = [take(store, request_id, now, token=request_id) for request_id in (first, second)]

    def unreachable(**call):
        raise redis.ConnectionError("the workspace's node did not answer")

    monkeypatch.setattr(store, "_turn_end", unreachable)
    assert store.record(taken[0].event, token=first, now=now + 1, outcome="delivered", status=200, error="",
                        seconds=0.1, next_at=None) == "DELIVERED"
    monkeypatch.undo()
    assert "not written" in caplog.text
    assert hooked.webhooks.event(first)["state"] == "delivered"
    assert store.attempts(workspace) == []  # the log misses it
    assert take(store, third, now + 2).outcome == "WAIT"  # its slot is still held ...
    assert take(store, third, now + 31).outcome == "TAKEN"  # ... until its lease's end


def test_a_probe_given_back_unused_lets_the_next_attempt_probe(hooked, http, monkeypatch):
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    hooked.webhooks.limits = dataclasses.replace(LIMITS, max_in_flight_per_workspace=0)
    workspace, owe = owing(hooked, http, "probed")
    for n in range(3):
        fail(store, owe("http://127.0.0.1:9/a"), now + n)
    ended, waiting = owe("http://127.0.0.1:9/b"), owe("http://127.0.0.1:9/c")
    turn = store._turn

    def it_ends_meanwhile(**call):
        answer = turn(**call)
        assert answer == [b"PROBE"]
        hooked.redis.hset(keys.webhook_event(ended), "state", "delivered")  # as another attempt's record would
        return answer

    monkeypatch.setattr(store, "_turn", it_ends_meanwhile)
    assert take(store, ended, now + 20, token="probe").outcome == "DONE"
    monkeypatch.undo()
    assert _in_flight(hooked, workspace) == set()
    assert take(store, waiting, now + 20, token="next").outcome == "TAKEN"  # not "OPEN": no probe runs


def test_an_event_that_keeps_waiting_waits_longer_each_time(hooked, http):
    store, now = hooked.webhooks, time.time() + 5
    _, flood = owing(hooked, http, "patient")
    held = [take(store, flood("http://127.0.0.1:9/x"), now) for _ in range(2)]
    assert all(t.outcome == "TAKEN" for t in held)
    late = flood("http://127.0.0.1:9/x")
    spans = []
    for n in range(9):
        waited = take(store, late, now + n * 0.01)
        assert waited.outcome == "WAIT"
        spans.append(waited.due_at - (now + n * 0.01))
        assert 0 <= spans[-1] < 2 * LIMITS.wait_s * 2 ** min(n, 6), (n, spans)
    assert hooked.webhooks.event(late)["waits"] == "9"
    assert max(spans[5:]) > 2 * LIMITS.wait_s  # not all of the later waits fell short (seeded)
    # Taken at last: its waits start again from the first.
    assert take(store, late, now + 31).outcome == "TAKEN"
    assert hooked.webhooks.event(late)["waits"] == "0"


def test_no_cap_when_set_to_zero(hooked, http):
    hooked.webhooks.limits = dataclasses.replace(LIMITS, max_in_flight_per_workspace=0)
    _, flood = owing(hooked, http, "uncapped")
    now = time.time() + 5
    assert [take(hooked.webhooks, flood(f"http://127.0.0.1:9/{n}"), now).outcome for n in range(5)] == ["TAKEN"] * 5


def test_an_event_that_waits_past_the_retry_window_is_given_up(hooked, http):
    workspace, flood = owing(hooked, http, "late")
    now = time.time() + 5
    # two attempts hang on for longer than the window (their leases, too)
    held = [hooked.webhooks.take(flood("http://127.0.0.1:9/x"), now=now, lease_s=2 * LIMITS.window_s, token=f"h{n}")
            for n in range(2)]
    assert all(t.outcome == "TAKEN" for t in held)
    late = flood("http://127.0.0.1:9/x")
    assert take(hooked.webhooks, late, now + LIMITS.window_s).outcome == "GAVE_UP"
    assert hooked.webhooks.event(late)["state"] == "given_up" and not hooked.webhooks.owed(late)
    # it gives back its workspace's pending event (the quota), as an attempt that gives up does
    assert hooked.accounts.get(workspace).webhooks_pending == 2


# -- the circuit per endpoint ----------------------------------------------------------------


def fail(store, request_id, now, *, endpoint_failed=True):
    taken = take(store, request_id, now, token=f"f-{now}")
    assert taken.outcome == "TAKEN", taken
    return store.record(taken.event, token=f"f-{now}", now=now, outcome="failed", status=None, error="timed out",
                        seconds=2, next_at=now + 1, endpoint_failed=endpoint_failed)


def test_the_circuit_opens_after_failures_in_a_row_spaces_attempts_and_a_success_closes_it(hooked, http):
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    hooked.webhooks.limits = dataclasses.replace(LIMITS, max_in_flight_per_workspace=0)
    workspace, owe = owing(hooked, http, "circuit")
    _, neighbour = owing(hooked, http, "neighbour")
    events = [owe(f"http://127.0.0.1:9/hole?n={n}") for n in range(6)]
    # A failure that never reached the endpoint (its URL refused, no secret) does not count.
    fail(store, events[0], now, endpoint_failed=False)
    assert store.failing(workspace) == []
    for n in range(3):
        fail(store, events[n], now + 2 + n)
    (row,) = store.failing(workspace)
    assert (row.origin, row.failures, row.open_until) == ("http://127.0.0.1:9", 3, pytest.approx(now + 4 + 10))
    assert store.open_circuits() == [row]

    # Open: its events wait out the cooling (not attempts), then a random point of another.
    waiting = take(store, events[3], now + 5)
    assert waiting.outcome == "OPEN" and now + 14 <= waiting.due_at < now + 24
    assert hooked.webhooks.event(events[3])["attempts"] == "0"
    # Another workspace's endpoint at the same origin has a circuit of its own.
    assert take(store, neighbour("http://127.0.0.1:9/fine"), now + 5).outcome == "TAKEN"

    # Cooled: one attempt probes it, the others wait while it runs.
    probe = take(store, events[3], now + 15, token="probe")
    assert probe.outcome == "TAKEN"
    assert take(store, events[4], now + 15.1).outcome == "OPEN"
    # The probe fails: open again for another cooling.
    store.record(probe.event, token="probe", now=now + 16, outcome="failed", status=503, error="HTTP 503",
                 seconds=0.1, next_at=now + 17)
    assert take(store, events[4], now + 17).outcome == "OPEN"
    assert store.failing(workspace)[0].open_until == pytest.approx(now + 26)
    # The next probe gets an answer: closed, no longer failing, the rest go at once.
    probe = take(store, events[4], now + 26.5, token="probe2")
    assert probe.outcome == "TAKEN"
    assert store.record(probe.event, token="probe2", now=now + 27, outcome="delivered", status=204, error="",
                        seconds=0.1, next_at=None) == "DELIVERED"
    assert store.failing() == [] and store.open_circuits() == []
    assert take(store, events[5], now + 27).outcome == "TAKEN"


def test_a_410_is_an_answer_and_closes_the_circuit(hooked, http):
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    workspace, owe = owing(hooked, http, "gone")
    for n in range(2):
        fail(store, owe("http://127.0.0.1:9/a"), now + n)
    gone = take(store, owe("http://127.0.0.1:9/b"), now + 3, token="g")
    store.record(gone.event, token="g", now=now + 3, outcome="gone", status=410, error="", seconds=0.1, next_at=None)
    assert store.failing(workspace) == []


# -- origins only, and bounded ------------------------------------------------------------------


def test_an_error_naming_the_path_is_cut():
    from router_queue.webhooks.delivery import without_path
    error = "URL can't contain control characters. '/services/T0/s3cr3t path?sig=x' (found at least ' ')"
    assert "s3cr3t" not in without_path(error, "http://h.example/services/T0/s3cr3t path?sig=x")


def test_origin_keeps_scheme_host_and_port_only():
    assert origin(SECRET_URL) == "http://127.0.0.1:9"
    assert origin("https://Hooks.Example.com/T/B/x?token=1#f") == "https://hooks.example.com"
    assert origin("https://user:pw@example.com:8443/x") == "https://example.com:8443"
    assert origin("http://[::1]:8080/p") == "http://[::1]:8080"
    assert origin("not a url") == ""


def test_only_the_origin_reaches_the_log_the_failing_list_the_page_its_json_and_the_cli(app, hooked, http, ops_http):
    from router_queue.cli import main
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    hooked.webhooks.limits = dataclasses.replace(LIMITS, circuit_failures=1)
    workspace, owe = owing(hooked, http, "secretive")
    request_id = owe(SECRET_URL)
    fail(store, request_id, now)
    surfaces = {
        "attempt log": json.dumps([dataclasses.asdict(a) for a in store.attempts(workspace)]),
        "failing": repr(store.failing()),
        "page": ops_http.get("/ops").get_data(as_text=True),
        "json": ops_http.get("/ops/summary.json").get_data(as_text=True),
        "cli": cli_runner(app).invoke(main, ["ops", "webhooks", workspace]).output,
        "cli, every workspace": cli_runner(app).invoke(main, ["ops", "webhooks"]).output,
        "cli inspect": cli_runner(app).invoke(main, ["ops", "inspect", request_id]).output,
        "metrics": ops_http.get("/metrics").get_data(as_text=True),
    }
    for name, text in surfaces.items():
        assert "s3cr3t" not in text, name
    for name in ("attempt log", "failing", "page", "json", "cli", "cli, every workspace"):
        assert "http://127.0.0.1:9" in surfaces[name], name
    summary = json.loads(surfaces["json"])["webhooks"]
    assert summary["failing"] == [{"workspace": workspace, "origin": "http://127.0.0.1:9", "failures": 1,
                                   "circuit": "open", "open_until": pytest.approx(now + 10)}]
    assert summary["open_circuits"] == 1 and summary["in_flight"] == 0
    assert "open until" in surfaces["cli"]
    # In Redis, the whole URL is only where delivery needs it: the request and its event.
    for key in hooked.redis.scan_iter():
        name = key.decode()
        if name in (keys.request(request_id), keys.webhook_event(request_id)):
            continue
        assert "s3cr3t" not in name, name
        kind = hooked.redis.type(key).decode()
        values = {"hash": lambda: hooked.redis.hgetall(key), "list": lambda: hooked.redis.lrange(key, 0, -1),
                  "zset": lambda: hooked.redis.zrange(key, 0, -1), "string": lambda: hooked.redis.get(key)}
        if kind in values:
            assert b"s3cr3t" not in repr(values[kind]()).encode(), name


def test_the_failing_endpoints_are_trimmed_to_the_most_recent(hooked, http):
    store, now = hooked.webhooks, time.time() + 5  # past every event owed below
    hooked.webhooks.limits = dataclasses.replace(LIMITS, max_in_flight_per_workspace=0)
    workspace, owe = owing(hooked, http, "many")
    event = take(store, owe("http://127.0.0.1:9/x"), now, token="t").event
    # Many distinct failing origins, as many distinct URLs once were: recorded
    # straight from one attempt's event, its URL changed.
    for n in range(FAILING_KEPT + 5):
        store.record(dataclasses.replace(event, url=f"http://h{n}.example:{n + 1}/p?q={n}"), token="x",
                     now=now + n * 0.001, outcome="failed", status=500, error="HTTP 500", seconds=0.1, next_at=now)
    assert hooked.redis.zcard(keys.webhooks_failing()) == FAILING_KEPT
    origins = {row.origin for row in store.failing(workspace)}
    assert "http://h0.example:1" not in origins and f"http://h{FAILING_KEPT + 4}.example:{FAILING_KEPT + 5}" in origins
    # One failing a window later drops every older one.
    store.record(event, token="x", now=now + LIMITS.window_s + 10, outcome="failed", status=500, error="HTTP 500",
                 seconds=0.1, next_at=now)
    assert [m.decode() for m in hooked.redis.zrange(keys.webhooks_failing(), 0, -1)] == [
        f"{workspace}|http://127.0.0.1:9"]


# -- the deadline covers the connect ------------------------------------------------------------------


def _never_accepting() -> tuple[socket.socket, list[socket.socket], int]:
    """A listener whose accept queue is full: the kernel drops further SYNs,
    so a connect never completes nor is refused (a blackhole)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.2)
    return listener, fillers, port


@pytest.mark.parametrize("kind", ["never accepts", "accepts, never answers"])
def test_the_deadline_covers_the_connect_and_the_answer(kind):
    if kind == "never accepts":
        listener, fillers, port = _never_accepting()
    else:
        listener, fillers = socket.socket(), []
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        port = listener.getsockname()[1]
    try:
        headers = webhook_event.signed_headers("msg_x", b"{}", [webhook_event.new_secret()], int(time.time()))
        started = time.monotonic()
        with pytest.raises(Exception) as raised:
            post(f"http://127.0.0.1:{port}/hook", "127.0.0.1", b"{}", headers, 1.0)
        took = time.monotonic() - started
    finally:
        for s in (listener, *fillers):
            s.close()
    assert type(raised.value).__name__ == ("ConnectTimedOut" if kind == "never accepts" else "AttemptTimedOut")
    assert 0.9 <= took < 1.5, took


def test_a_worker_attempt_at_a_blackhole_fails_at_the_timeout_and_counts_for_the_circuit(hooked, http):
    listener, fillers, port = _never_accepting()
    try:
        hooked.settings = dataclasses.replace(hooked.settings, webhook_timeout_s=0.5)
        workspace, owe = owing(hooked, http, "blackholed")
        request_id = owe(f"http://127.0.0.1:{port}/hook")
        started = time.monotonic()
        assert deliver_webhook(context_of(hooked), request_id) == "retry"
        assert time.monotonic() - started < 1.5
    finally:
        for s in (listener, *fillers):
            s.close()
    (attempt,) = hooked.webhooks.attempts(workspace)
    assert attempt.error == "no connection within 0.5 s" and attempt.origin == f"http://127.0.0.1:{port}"
    assert hooked.webhooks.failing(workspace)[0].failures == 1
