"""Signed webhooks against real processes (issue 14, item 6).

A stack of our own (``harness.RunningStack`` on a private ``redis-server``:
the stub, one Celery worker for the provider queues, the webhooks worker
(the Procfile's ``webhooks``, consuming ``router.webhooks`` only), beat
sweeping every second, gunicorn) with loopback http
allowed and the webhook clock shortened (:data:`WEBHOOK_SETTINGS`), and a
receiver process of the tests (``webhook_receiver.py``) that verifies every
attempt with the ``standardwebhooks`` package, each secret on its own, and
answers as each test programs it: 500 then 204, hang, 410.

Scenarios: a receiver that fails twice then succeeds (a succeeded and a failed
request), one that hangs past the attempt's timeout, one that answers 410, a
SIGKILL of the worker in the middle of an attempt, a secret rotation, the
workspace default URL against a request's own, URLs refused at submit, and a
receiver that trickles its answer byte by byte (cut at the attempt's timeout:
before the watchdog in router_queue/webhooks/delivery.py it held a thread 12 s against a
2 s timeout, and its lease ran out, so a second attempt ran beside it).
The operator's view is ``router-queue ops webhooks WS`` run as a process; it
names endpoints by origin only. The flood of a blackhole is in
``test_webhook_flood.py``.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from typing import Any, Iterator

import pytest

from router_queue.webhooks.event import new_secret

from .harness import FLUX, ApiClient, RunningStack, make_caller, private_stack, unique_prompt, wait_for
from .webhook_support import Receiver, cli, cli_ok, workspace_with_secret

#: Seconds one attempt may take (connect, each read, the whole answer).
TIMEOUT_S = 2.0
#: Seconds an attempt holds its event: a killed worker's event is due again after it.
LEASE_S = 4.0
#: Seconds before attempts 2, 3, 4, ... (the last repeats), each jittered by ±20 %.
SCHEDULE_S = (1.0, 1.0, 2.0)
JITTER = 0.2
#: beat's sweep (harness.stack_env): a retry may start up to this much after it is due.
SWEEP_S = 1.0
WEBHOOK_SETTINGS = {
    "WEBHOOK_ALLOW_LOOPBACK_HTTP": "1",
    "WEBHOOK_TIMEOUT_SECONDS": f"{TIMEOUT_S:g}",
    "WEBHOOK_LEASE_SECONDS": f"{LEASE_S:g}",
    "WEBHOOK_RETRY_SCHEDULE": ",".join(f"{s:g}" for s in SCHEDULE_S),
    "WEBHOOK_RETRY_FOR_SECONDS": "120",
    # Every test here has a workspace of its own, so circuits (per workspace
    # and origin) never carry over; none fails 5 times in a row.
    "WEBHOOK_CIRCUIT_FAILURES": "5",
}
#: Slack on top of a computed bound: process scheduling, a publish, a Redis round trip.
SLACK_S = 1.5


def retry_gap_bounds(after_attempt: int, *, took_s: float = 0.0) -> tuple[float, float]:
    """The least and most seconds from one attempt's arrival to the next's, after
    failed attempt ``after_attempt`` that took ``took_s`` (its answer, or its timeout)."""
    delay = SCHEDULE_S[min(after_attempt, len(SCHEDULE_S)) - 1]
    return took_s + delay * (1 - JITTER) - 0.1, took_s + delay * (1 + JITTER) + SWEEP_S + SLACK_S


# -- the receiver -----------------------------------------------------------------------


# -- the operator's CLI ---------------------------------------------------------------------


def ops_webhooks(env: dict[str, str], workspace: str) -> tuple[list[tuple[int, str]], list[dict[str, str]]]:
    """``router-queue ops webhooks WS``: (failing endpoints as (failures, origin),
    recent attempts as dicts by the header's columns, newest first)."""
    text = cli_ok(env, "ops", "webhooks", workspace).stdout
    lines = text.splitlines()
    assert lines[0] == "failing endpoints (failed attempts in a row):", text
    split = lines.index("recent attempts:")
    failing = [] if lines[1:split] == ["  none"] else [
        (int(line.split("\t")[0]), line.split("\t")[1]) for line in lines[1:split]]
    header = lines[split + 1].strip().split("\t")
    assert header == ["at", "request_id", "attempt", "outcome", "status", "seconds", "origin", "error"], text
    rows = [dict(zip(header, line.strip().split("\t"))) for line in lines[split + 2:]]
    return failing, rows


# -- the stack --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hook_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """A stack of our own on a private redis-server (no other stack's worker
    may take our webhook deliveries), with :data:`WEBHOOK_SETTINGS`."""
    with private_stack(tmp_path_factory, "webhook", WEBHOOK_SETTINGS, webhooks=True) as running:
        yield running


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    made = Receiver(tmp_path_factory.mktemp("webhook-receiver"))
    try:
        yield made
    finally:
        made.stop()


def hook_name(label: str, caller: ApiClient) -> str:
    return f"{label}-{caller.workspace}"


# -- checks -----------------------------------------------------------------------------------


def _iso(value: str) -> datetime:
    assert value.endswith("Z"), value
    return datetime.fromisoformat(value[:-1] + "+00:00")


def assert_same_event(attempts: list[dict[str, Any]], request_id: str) -> None:
    """Every attempt: the same webhook-id and the same body bytes, verified, recent timestamp."""
    assert attempts
    assert {a["webhook_id"] for a in attempts} == {f"msg_{request_id}"}
    assert len({a["body_sha256"] for a in attempts}) == 1, [a["body"] for a in attempts]
    for a in attempts:
        assert a["verified"], a["errors"]
        assert a["content_type"] == "application/json"
        assert abs(int(a["webhook_timestamp"]) - a["arrived_at"]) < 5  # signed anew on every attempt


def assert_event_body(event: dict[str, Any], status: dict[str, Any], submitted: dict[str, Any]) -> None:
    """The event names the request as its status does."""
    assert event["type"] == "request.completed"
    assert event["request_id"] == status["request_id"]
    assert event["model"] == FLUX
    assert event["status"] == "COMPLETED" == status["status"]
    assert event["error_type"] == status.get("error_type")
    assert event["response_url"] == submitted["response_url"] == status["response_url"]
    for name in ("created_at", "started_at", "completed_at"):
        assert event[name] == status[name], name
    assert _iso(event["created_at"]) <= _iso(event["started_at"]) <= _iso(event["completed_at"])
    assert event["cost"] == status["cost"]  # settled with the completion: the event and the status agree
    assert set(event) == {"type", "request_id", "model", "status", "error_type", "response_url", "created_at",
                          "started_at", "completed_at", "cost"}


def submit(caller: ApiClient, label: str, *directives: str, url: str | None = None) -> tuple[str, dict[str, Any]]:
    headers = {"X-Comfy-Webhook-Url": url} if url is not None else None
    response = caller.submit(FLUX, {"prompt": unique_prompt(label, *directives)}, headers=headers)
    assert response.status_code == 201, (response.status_code, response.text)
    return response.json()["request_id"], response.json()


def gaps(attempts: list[dict[str, Any]]) -> list[float]:
    return [round(b["arrived_at"] - a["arrived_at"], 2) for a, b in zip(attempts, attempts[1:])]


# -- scenarios --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_receiver_that_fails_twice_then_succeeds_gets_each_event_delivered_once(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-fail-twice")
    with caller:
        plan = ["500", "500", "204"]
        ok_url = receiver.configure(hook_name("ok", caller), secrets={"current": secret}, plan=plan)
        failed_url = receiver.configure(hook_name("failed", caller), secrets={"current": secret}, plan=plan)

        ok_id, ok_submitted = submit(caller, "webhook fails twice", url=ok_url)
        failed_id, failed_submitted = submit(caller, "webhook fails twice, refused", "[stub:refuse]",
                                             url=failed_url)
        cases = ((hook_name("ok", caller), ok_id, ok_submitted),
                 (hook_name("failed", caller), failed_id, failed_submitted))
        for name, request_id, _ in cases:
            receiver.wait_attempts(name, 3, answered=True)
        # Delivered: no 4th attempt within another step of the schedule.
        time.sleep(SCHEDULE_S[-1] * (1 + JITTER) + SWEEP_S)
        for name, request_id, submitted in cases:
            status = caller.wait_status(FLUX, request_id)
            attempts = receiver.attempts(name)
            print(f"\n{name}: attempts {len(attempts)}, gaps {gaps(attempts)} s, answers "
                  f"{[a['answered'] for a in attempts]}")
            assert [a["answered"] for a in attempts] == [500, 500, 204]
            assert_same_event(attempts, request_id)
            assert all(a["verified_with"] == ["current"] and a["signatures"] == 1 for a in attempts)
            assert_event_body(attempts[0]["event"], status, submitted)
            for n, gap in enumerate(gaps(attempts), start=1):
                low, high = retry_gap_bounds(n)
                assert low <= gap <= high, (n, gap, low, high)
            event = hook_stack.services.webhooks.event(request_id)
            assert event["state"] == "delivered" and event["attempts"] == "3", event

        assert receiver.attempts(hook_name("ok", caller))[0]["event"]["error_type"] is None
        assert receiver.attempts(hook_name("failed", caller))[0]["event"]["error_type"] == "content_policy_violation"

        failing, rows = ops_webhooks(hook_stack.env, caller.workspace)
        assert failing == []  # the delivery cleared the failures in a row
        for request_id, url in ((ok_id, ok_url), (failed_id, failed_url)):
            mine = sorted((r for r in rows if r["request_id"] == request_id), key=lambda r: int(r["attempt"]))
            assert [(r["attempt"], r["outcome"], r["status"], r["error"]) for r in mine] == [
                ("1", "failed", "500", "HTTP 500"), ("2", "failed", "500", "HTTP 500"), ("3", "delivered", "204", "-")]
            assert {r["origin"] for r in mine} == {receiver.base_url}  # never the path


@pytest.mark.slow
def test_a_hanging_receiver_times_out_and_is_tried_again_until_it_answers(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-hang")
    with caller:
        name = hook_name("hang", caller)
        # Held 5 s (past the 2 s timeout) twice, then answered at once.
        url = receiver.configure(name, secrets={"current": secret}, plan=["hang:5", "hang:5", "204"])
        request_id, _ = submit(caller, "webhook hangs", url=url)

        attempts = receiver.wait_attempts(name, 3, timeout_s=30)
        wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("state") == "delivered",
                 what="the event delivered")
        attempts = receiver.attempts(name)
        print(f"\n{name}: attempts {len(attempts)}, gaps {gaps(attempts)} s")
        assert len(attempts) == 3
        assert_same_event(attempts, request_id)
        for n, gap in enumerate(gaps(attempts), start=1):
            low, high = retry_gap_bounds(n, took_s=TIMEOUT_S)
            assert low <= gap <= high, (n, gap, low, high)

        _, rows = ops_webhooks(hook_stack.env, caller.workspace)
        mine = sorted((r for r in rows if r["request_id"] == request_id), key=lambda r: int(r["attempt"]))
        print(f"attempt seconds {[r['seconds'] for r in mine]}")
        assert [(r["outcome"], r["status"]) for r in mine] == [("failed", "-"), ("failed", "-"), ("delivered", "204")]
        for row in mine[:2]:
            assert row["error"] == f"no answer within {TIMEOUT_S:g} s"
            # a read timeout of 2 s: the attempt ended then, not when the receiver gave up holding it (5 s)
            assert TIMEOUT_S - 0.1 <= float(row["seconds"]) < TIMEOUT_S + 1.0, row
        assert float(mine[2]["seconds"]) < 1.0


@pytest.mark.slow
def test_a_410_stops_the_retries(hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-gone")
    with caller:
        name = hook_name("gone", caller)
        # A 500, then 410; had it gone on it would have been answered 204.
        url = receiver.configure(name, secrets={"current": secret}, plan=["500", "410", "204"])
        request_id, _ = submit(caller, "webhook gone", url=url)

        receiver.wait_attempts(name, 2, answered=True)
        wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("state") == "gone",
                 what="the event gone")
        # Nothing more within the next three steps of the schedule.
        time.sleep(sum(SCHEDULE_S) * (1 + JITTER) + SWEEP_S)
        attempts = receiver.attempts(name)
        print(f"\n{name}: attempts {len(attempts)}, gaps {gaps(attempts)} s")
        assert [a["answered"] for a in attempts] == [500, 410]
        assert_same_event(attempts, request_id)
        assert hook_stack.services.webhooks.owed(request_id) is False

        failing, rows = ops_webhooks(hook_stack.env, caller.workspace)
        mine = sorted((r for r in rows if r["request_id"] == request_id), key=lambda r: int(r["attempt"]))
        assert [(r["attempt"], r["outcome"], r["status"]) for r in mine] == [("1", "failed", "500"),
                                                                            ("2", "gone", "410")]
        assert "410 Gone" in mine[1]["error"]
        assert failing == []  # a 410 is an answer: the endpoint is not failing, its circuit closed


@pytest.mark.slow
def test_a_worker_killed_mid_delivery_leaves_the_event_to_be_delivered_after_its_lease(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-kill")
    with caller:
        name = hook_name("kill", caller)
        # The first attempt is held (past the kill); the next answered 204.
        url = receiver.configure(name, secrets={"current": secret}, plan=["hang:30", "204"])
        request_id, _ = submit(caller, "webhook worker killed", url=url)

        first = receiver.wait_attempts(name, 1, timeout_s=20)[0]
        worker = hook_stack.stack.procs["webhooks"]
        os.kill(worker.pid, signal.SIGKILL)
        killed_at = time.time()
        assert worker.wait(5) == -signal.SIGKILL
        in_flight_s = killed_at - first["arrived_at"]
        assert in_flight_s < TIMEOUT_S, f"killed {in_flight_s:.2f} s after the attempt arrived: not mid-attempt"
        event = hook_stack.services.webhooks.event(request_id)
        assert event["state"] == "pending" and event["attempts"] == "1", event  # taken, never recorded

        hook_stack.start_worker("webhooks")
        hook_stack.wait_ready(["webhooks"], serving=False)
        restarted_at = time.time()
        wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("state") == "delivered",
                 timeout_s=LEASE_S + 15, what="the event delivered by the new worker")
        attempts = receiver.attempts(name)
        delivered = [a for a in attempts if a["answered"] == 204]
        print(f"\n{name}: killed {in_flight_s:.2f} s into attempt 1, worker ready {restarted_at - killed_at:.1f} s "
              f"later, attempt 2 {attempts[1]['arrived_at'] - first['arrived_at']:.1f} s after attempt 1; "
              f"{len(attempts)} attempts")
        assert len(attempts) == 2 and len(delivered) == 1
        assert_same_event(attempts, request_id)
        # Not before the killed attempt's lease ran out.
        assert attempts[1]["arrived_at"] - first["arrived_at"] >= LEASE_S - 0.2
        receiver.configure(name)  # let the held attempt go

        _, rows = ops_webhooks(hook_stack.env, caller.workspace)
        mine = [(r["attempt"], r["outcome"], r["status"]) for r in rows if r["request_id"] == request_id]
        assert mine == [("2", "delivered", "204")]  # the killed attempt recorded nothing


@pytest.mark.slow
def test_a_trickling_receiver_is_cut_off_at_the_timeout(hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-trickle")
    with caller:
        name = hook_name("trickle", caller)
        # A 204's head, a byte every ~0.2 s for 12 s (no read waits 2 s), then 204 at once.
        url = receiver.configure(name, secrets={"current": secret}, plan=["trickle:12", "204"])
        request_id, _ = submit(caller, "webhook trickles", url=url)

        def attempt_one_recorded() -> list[Any] | None:
            mine = sorted((a for a in hook_stack.services.webhooks.attempts(caller.workspace)
                           if a.request_id == request_id), key=lambda a: a.attempt)
            return mine if mine and mine[0].attempt == 1 else None

        mine = wait_for(attempt_one_recorded, timeout_s=25, interval_s=0.2, what="attempt 1 recorded")
        wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("state") == "delivered",
                 what="the event delivered")
        attempts = receiver.attempts(name)
        took_s = mine[0].seconds
        print(f"\n{name}: attempt 1 took {took_s:.1f} s (timeout {TIMEOUT_S:g} s, lease {LEASE_S:g} s), "
              f"{[(a.attempt, a.outcome, a.seconds) for a in mine]}, receiver gaps {gaps(attempts)} s")
        receiver.configure(name)
        assert took_s < TIMEOUT_S + 1.0, f"attempt 1 ran {took_s:.1f} s with WEBHOOK_TIMEOUT_SECONDS={TIMEOUT_S:g}"
        assert attempts[1]["arrived_at"] >= attempts[0]["arrived_at"] + took_s, "two attempts at once"


def test_a_rotation_signs_with_the_old_and_the_new_secret_each_verifying_alone(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, old = workspace_with_secret(hook_stack, "hooks-rotate")
    with caller:
        stranger = new_secret()
        name = hook_name("rotate", caller)
        url = receiver.configure(name, secrets={"old": old, "stranger": stranger})
        before_id, _ = submit(caller, "webhook before rotation", url=url)
        before = receiver.wait_attempts(name, 1)[0]
        assert before["answered"] in (None, 204)
        assert (before["signatures"], before["verified_with"]) == (1, ["old"])
        assert "No matching signature" in before["errors"]["stranger"]

        again = cli(hook_stack.env, "workspace", "webhook-secret", caller.workspace)
        assert again.returncode != 0 and "never shown again" in again.stderr, again
        rotated = cli_ok(hook_stack.env, "workspace", "webhook-secret", caller.workspace, "--rotate")
        new = rotated.stdout.strip()
        assert new.startswith("whsec_") and new != old
        assert "24 h" in rotated.stderr

        receiver.configure(name, secrets={"old": old, "new": new, "stranger": stranger})
        during_id, _ = submit(caller, "webhook during rotation", url=url)
        attempts = receiver.wait_attempts(name, 2, answered=True)
        during = attempts[1]
        assert during["webhook_id"] == f"msg_{during_id}"
        assert during["signatures"] == 2
        assert during["verified_with"] == ["new", "old"]  # each on its own
        assert set(during["errors"]) == {"stranger"}
        assert during["answered"] == 204
        for request_id in (before_id, during_id):
            wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("state") == "delivered",
                     what=f"{request_id} delivered")
        assert len(receiver.attempts(name)) == 2


def test_the_workspace_default_url_applies_unless_the_request_names_its_own(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-default")
    with caller:
        default_url = receiver.configure(hook_name("default", caller), secrets={"current": secret})
        own_url = receiver.configure(hook_name("own", caller), secrets={"current": secret})

        refused = cli(hook_stack.env, "workspace", "set-webhook", caller.workspace,
                      "https://169.254.169.254/latest/meta-data/")
        assert refused.returncode == 2 and "metadata" in refused.stderr, refused
        done = cli_ok(hook_stack.env, "workspace", "set-webhook", caller.workspace, default_url)
        assert default_url in done.stdout

        by_default, _ = submit(caller, "webhook to the default")
        own, _ = submit(caller, "webhook to its own", url=own_url)
        got_default = receiver.wait_attempts(hook_name("default", caller), 1, answered=True)
        got_own = receiver.wait_attempts(hook_name("own", caller), 1, answered=True)
        for request_id in (by_default, own):
            wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("state") == "delivered",
                     what=f"{request_id} delivered")
        assert [a["webhook_id"] for a in receiver.attempts(hook_name("default", caller))] == [f"msg_{by_default}"]
        assert [a["webhook_id"] for a in receiver.attempts(hook_name("own", caller))] == [f"msg_{own}"]
        assert got_default[0]["verified"] and got_own[0]["verified"]

        cli_ok(hook_stack.env, "workspace", "set-webhook", caller.workspace, "--off")
        unhooked, _ = submit(caller, "webhook default off")
        caller.wait_status(FLUX, unhooked)
        assert hook_stack.services.webhooks.event(unhooked) == {}  # nothing owed
        time.sleep(SWEEP_S + 0.5)
        assert len(receiver.attempts(hook_name("default", caller))) == 1


def test_a_host_name_is_looked_up_within_its_budget_at_submit_and_at_delivery(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    """``localhost``, not an address: the front door's gevent worker and the
    webhooks worker's threads each look it up through ``webhooks/lookup.py``."""
    caller, secret = workspace_with_secret(hook_stack, "hooks-by-name")
    with caller:
        url = receiver.configure(hook_name("by-name", caller), secrets={"current": secret})
        by_name = url.replace("127.0.0.1", "localhost")
        request_id, _ = submit(caller, "webhook by name", url=by_name)
        got = receiver.wait_attempts(hook_name("by-name", caller), 1, answered=True)
        assert got[0]["verified"] and got[0]["webhook_id"] == f"msg_{request_id}"


@pytest.mark.parametrize("url, reason", [
    ("https://169.254.169.254/latest/meta-data/", "a cloud metadata address"),
    ("http://[fd00:ec2::254]/latest/meta-data/", "a cloud metadata address"),
    ("http://8.8.8.8/hook", "must use https"),
    ("https://10.0.0.1/hook", "a private address"),
    ("ftp://127.0.0.1/hook", "must be an absolute https URL"),
    ("http://127.0.0.1:9/a b", "contains a space"),
    ("https://[2002:a9fe:a9fe::]/", "carries 169.254.169.254 (6to4), a cloud metadata address"),
    ("https://[fec0::1]/", "a site-local address"),
    ("https://127.0.0.1:0/hook", "has port 0"),
])
def test_an_unsafe_url_is_refused_at_submit_naming_the_header(
        hook_stack: RunningStack, url: str, reason: str) -> None:
    with make_caller(hook_stack, "hooks-refused") as caller:
        queued = caller.submit(FLUX, {"prompt": unique_prompt("refused hook")}, headers={"X-Comfy-Webhook-Url": url})
        synchronous = caller.session.post(f"{caller.base_url}/v2/models/{FLUX}",
                                          json={"prompt": unique_prompt("refused hook sync")},
                                          headers=caller.headers({"X-Comfy-Webhook-Url": url}), timeout=10)
        for response in (queued, synchronous):
            assert response.status_code == 400, (response.status_code, response.text)
            body = response.json()
            assert body["error_type"] == "invalid_input"
            assert response.headers["X-Comfy-Error-Type"] == "invalid_input"
            assert body["detail"].startswith("X-Comfy-Webhook-Url "), body
            assert reason in body["detail"], body
        # nothing admitted, nothing held
        assert hook_stack.services.accounts.ledger(caller.workspace, count=10) == []


# -- webhooks for each step (issue 21, item 5) --------------------------------------------------

#: The events the step tests choose, and the least seconds between two progress
#: events' arrivals we accept: 2 s (WEBHOOK_PROGRESS_EVERY_SECONDS, between the times
#: they are owed) less 0.5 s of delivery jitter (a publish, a worker's take, a POST).
ALL_EVENTS = "started, progress,completed"
PROGRESS_GAP_S = 2.0 - 0.5


def submit_steps(caller: ApiClient, label: str, url: str, *directives: str) -> str:
    response = caller.submit(FLUX, {"prompt": unique_prompt(label, *directives)},
                             headers={"X-Comfy-Webhook-Url": url, "X-Comfy-Webhook-Events": ALL_EVENTS})
    assert response.status_code == 201, (response.status_code, response.text)
    return response.json()["request_id"]


def events_in_order(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each event's first attempt, in arrival order."""
    seen: dict[str, dict[str, Any]] = {}
    for a in attempts:
        seen.setdefault(a["webhook_id"], a)
    return list(seen.values())


def assert_steps(attempts: list[dict[str, Any]], request_id: str, status: dict[str, Any]) -> list[dict[str, Any]]:
    """started, then progress events, then completed: each verified, each its own
    id, stable across its attempts; returns the events' first attempts."""
    for a in attempts:
        assert a["verified"], a["errors"]
    by_id: dict[str, set[str]] = {}
    for a in attempts:
        by_id.setdefault(a["webhook_id"], set()).add(a["body_sha256"])
    assert all(len(bodies) == 1 for bodies in by_id.values()), by_id  # the same bytes on every attempt
    firsts = events_in_order(attempts)
    types = [a["event"]["type"] for a in firsts]
    ids = [a["webhook_id"] for a in firsts]
    progress_n = len(types) - 2
    assert types == ["request.started"] + ["request.progress"] * progress_n + ["request.completed"], types
    assert ids == ([f"msg_{request_id}_started"] + [f"msg_{request_id}_progress_{n}" for n in range(1, progress_n + 1)]
                   + [f"msg_{request_id}"]), ids
    # once an event has arrived, no earlier one arrives after it
    order = {msg_id: n for n, msg_id in enumerate(ids)}
    positions = [order[a["webhook_id"]] for a in attempts]
    assert positions == sorted(positions), positions
    started, *progress, completed = (a["event"] for a in firsts)
    assert started["status"] == "IN_PROGRESS" and started["started_at"] == status["started_at"]
    assert started["completed_at"] is None
    values = [p["progress"] for p in progress]
    assert all(p["status"] == "IN_PROGRESS" for p in progress) and values == sorted(values), values
    assert all(0 <= v < 1 for v in values)
    assert completed["status"] == "COMPLETED" and completed["error_type"] is None
    assert completed["completed_at"] == status["completed_at"]
    # the cost at each step: held while it ran, then as the completion settled it
    assert all(e["cost"] == {**status["cost"], "state": "held"} for e in (started, *progress))
    assert completed["cost"] == status["cost"] and status["cost"]["state"] == "charged"
    return firsts


@pytest.mark.slow
def test_each_step_of_a_bfl_request_arrives_in_order_with_its_own_id(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-steps")
    with caller:
        name = hook_name("steps", caller)
        url = receiver.configure(name, secrets={"current": secret})
        request_id = submit_steps(caller, "webhook each step", url, "[stub:latency=7]")
        status = caller.wait_status(FLUX, request_id)
        wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("type") == "completed"
                 and hook_stack.services.webhooks.event(request_id).get("state") == "delivered",
                 what=f"{request_id}'s completed event delivered")
        attempts = receiver.attempts(name)
        firsts = assert_steps(attempts, request_id, status)
        arrivals = [a["arrived_at"] for a in firsts if a["event"]["type"] == "request.progress"]
        progress_gaps = [round(b - a, 2) for a, b in zip(arrivals, arrivals[1:])]
        print(f"\nsteps: {[a['event']['type'] for a in firsts]}, progress "
              f"{[a['event']['progress'] for a in firsts[1:-1]]}, gaps between progress events {progress_gaps} s")
        assert len(arrivals) >= 2  # 7 s of generation, one progress event every 2 s at most
        assert all(gap >= PROGRESS_GAP_S for gap in progress_gaps), progress_gaps
        assert all(a["answered"] == 204 for a in attempts) and len(attempts) == len(firsts)  # each once
        assert hook_stack.services.accounts.get(caller.workspace).webhooks_pending == 0


@pytest.mark.slow
def test_a_receiver_that_fails_the_started_event_once_still_gets_it_before_completed(
        hook_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(hook_stack, "hooks-steps-fail")
    with caller:
        name = hook_name("steps-fail", caller)
        url = receiver.configure(name, secrets={"current": secret}, plan=["500", "204"])
        request_id = submit_steps(caller, "webhook each step, started fails once", url, "[stub:latency=3]")
        status = caller.wait_status(FLUX, request_id)
        wait_for(lambda: hook_stack.services.webhooks.event(request_id).get("type") == "completed"
                 and hook_stack.services.webhooks.event(request_id).get("state") == "delivered",
                 timeout_s=30, what=f"{request_id}'s completed event delivered")
        attempts = receiver.attempts(name)
        print(f"\nattempts: {[(a['webhook_id'].removeprefix('msg_' + request_id), a['answered']) for a in attempts]}")
        assert attempts[0]["webhook_id"] == attempts[1]["webhook_id"] == f"msg_{request_id}_started"
        assert [a["answered"] for a in attempts[:2]] == [500, 204]
        low, high = retry_gap_bounds(1)
        assert low <= attempts[1]["arrived_at"] - attempts[0]["arrived_at"] <= high
        assert_steps(attempts, request_id, status)
        assert hook_stack.services.accounts.get(caller.workspace).webhooks_pending == 0


def test_the_events_header_is_refused_when_unknown_or_without_a_webhook(hook_stack: RunningStack) -> None:
    with make_caller(hook_stack, "hooks-events-refused") as caller:
        for headers, said in (({"X-Comfy-Webhook-Events": "started,logs"}, "unknown event"),
                              ({"X-Comfy-Webhook-Events": ""}, "names no event"),
                              ({"X-Comfy-Webhook-Events": "started"}, "no webhook")):
            response = caller.submit(FLUX, {"prompt": unique_prompt("refused events")}, headers=headers)
            assert response.status_code == 400 and response.json()["error_type"] == "invalid_input", response.text
            assert "X-Comfy-Webhook-Events" in response.json()["detail"] and said in response.json()["detail"]
