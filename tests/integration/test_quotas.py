"""Quotas per workspace against real processes (gunicorn with two gevent
workers, a Celery worker, beat, the stub, a webhook receiver, a private
redis-server of the module's own, so ``CLIENT LIST`` shows only this stack):

* held connections: synchronous calls and event streams of one workspace
  share its ``max_held`` across both front-door processes; the next one is
  ``429 held_calls_full`` and admits nothing; every held call waits on its
  process's one pub/sub subscription (counted with ``CLIENT LIST``); the
  slots are given back when the calls are answered;
* stored body bytes: the body that would pass ``max_queued_bytes`` is
  ``429 queued_bytes_full``, admitted once a queued one ends, and every
  admitted request is held once and charged or released once;
* pending webhook events: a submit-and-cancel flood stops at
  ``max_pending_webhooks`` with ``429 pending_webhooks_full``, a submit
  without a webhook still passes, and the quota frees as the events are
  delivered, each exactly once.
"""

from __future__ import annotations

import json
import threading
from typing import Iterator

import pytest
import redis
import requests

from router_queue.store import keys

from .harness import (
    FLUX,
    ApiClient,
    RunningStack,
    ledger_by_request,
    make_caller,
    private_stack,
    unique_prompt,
    wait_for,
)
from .webhook_support import Receiver, workspace_with_secret

#: Front-door processes of the module's stack (gunicorn workers).
WEB_PROCESSES = 2
#: Held synchronous calls and streams of the held-connection test.
HELD = 20
#: Seconds a held call waits at most for its answer (the calls are cancelled well before).
HELD_TIMEOUT_S = 60.0
QUOTA_SETTINGS = {
    "WEBHOOK_ALLOW_LOOPBACK_HTTP": "1",
    "WEBHOOK_TIMEOUT_SECONDS": "2",
    "WEBHOOK_LEASE_SECONDS": "4",
    "WEBHOOK_RETRY_SCHEDULE": "1",
    "WEBHOOK_RETRY_FOR_SECONDS": "120",
    # The receiver answers 503 until it recovers: its circuit opens after 5;
    # a short cooling lets the events through soon after it recovers.
    "WEBHOOK_CIRCUIT_COOLING_SECONDS": "2",
}


@pytest.fixture(scope="module")
def quota_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with private_stack(tmp_path_factory, "quota", QUOTA_SETTINGS, web_workers=WEB_PROCESSES,
                       webhooks=True) as running:
        yield running


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    made = Receiver(tmp_path_factory.mktemp("quota-receiver"))
    try:
        yield made
    finally:
        made.stop()


def assert_429(response: requests.Response, bucket: str) -> None:
    assert response.status_code == 429, (response.status_code, response.text)
    assert response.headers["X-Comfy-Error-Type"] == bucket == response.json()["error_type"]
    assert int(response.headers["Retry-After"]) >= 1


def pubsub_connections(client: redis.Redis) -> int:
    """Connections to the server subscribed to any channel or pattern."""
    return sum(1 for c in client.client_list() if int(c.get("sub", 0)) + int(c.get("psub", 0)) > 0)


def blocker(caller: ApiClient, label: str) -> str:
    """A long generation holding the workspace's one slot in flight, so what it
    submits next waits queued (``--max-in-flight 1``) until cancelled."""
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt(label, "[stub:latency=60]")})
    caller.wait_status(FLUX, request_id, "IN_PROGRESS")
    return request_id


def workspace_requests(stack: RunningStack, workspace: str) -> list[str]:
    """The workspace's requests waiting in the FLUX queue."""
    return [q.id for q in stack.services.store.queue_head("bfl", 1000) if q.workspace == workspace]


def cancel_all(caller: ApiClient, request_ids: list[str]) -> None:
    for request_id in request_ids:
        assert caller.cancel(FLUX, request_id).status_code in (202, 409)


# -- held connections ---------------------------------------------------------------------


def test_held_calls_and_streams_share_one_cap_and_one_subscription_per_process(quota_stack: RunningStack) -> None:
    services = quota_stack.services
    with make_caller(quota_stack, "held") as caller:
        services.accounts.set_limits(caller.workspace, max_held=HELD, max_in_flight=1)
        running = blocker(caller, "held blocker")
        queued_for_stream = caller.submit_ok(FLUX, {"prompt": unique_prompt("held stream")})
        before = pubsub_connections(services.redis)

        answers: dict[int, requests.Response] = {}

        def hold(n: int) -> None:
            with requests.Session() as session:
                answers[n] = session.post(f"{quota_stack.base_url}/v2/models/{FLUX}",
                                          json={"prompt": unique_prompt(f"held {n}")}, headers=caller.headers(),
                                          timeout=HELD_TIMEOUT_S)

        threads = [threading.Thread(target=hold, args=(n,), daemon=True) for n in range(HELD - 1)]
        for thread in threads:
            thread.start()
        stream = requests.get(caller.url(FLUX, queued_for_stream, "/events"), headers=caller.headers(),
                              stream=True, timeout=HELD_TIMEOUT_S)
        try:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith(b"id: ")
            wait_for(lambda: services.redis.zcard(keys.held(caller.workspace)) == HELD,
                     what=f"{HELD} held connections counted")
            during = pubsub_connections(services.redis)
            print(f"FIGURE pubsub_connections held={HELD} web_processes={WEB_PROCESSES} "
                  f"before={before} during={during}")
            # one subscription per front-door process, however many calls it holds
            assert during - before <= WEB_PROCESSES, (before, during)

            queued_before = services.accounts.get(caller.workspace).queued
            refused = caller.session.post(f"{quota_stack.base_url}/v2/models/{FLUX}",
                                          json={"prompt": unique_prompt("one too many")}, headers=caller.headers(),
                                          timeout=10)
            assert_429(refused, "held_calls_full")
            assert services.store.status_view(refused.headers["X-Comfy-Request-Id"], "bfl").record is None
            assert services.accounts.get(caller.workspace).queued == queued_before  # nothing admitted
            assert_429(caller.session.get(caller.url(FLUX, running, "/events"), headers=caller.headers(),
                                          timeout=10), "held_calls_full")
        finally:
            # the held calls wait behind the blocker: cancelling them answers each
            cancel_all(caller, workspace_requests(quota_stack, caller.workspace))
            for thread in threads:
                thread.join(HELD_TIMEOUT_S)
            stream.close()
            cancel_all(caller, [running])
        assert sorted({a.headers.get("X-Comfy-Error-Type") for a in answers.values()}) == ["cancelled"]
        assert len(answers) == HELD - 1
        wait_for(lambda: services.redis.zcard(keys.held(caller.workspace)) == 0, what="every held slot given back")
        # freed: a stream of a finished request is served (and ends at once)
        served = caller.session.get(caller.url(FLUX, running, "/events"), headers=caller.headers(), timeout=10)
        assert served.status_code == 200 and "event: completed" in served.text


# -- stored body bytes ----------------------------------------------------------------------


def test_the_byte_quota_refuses_the_body_past_it_and_loses_or_double_charges_nothing(
        quota_stack: RunningStack) -> None:
    services = quota_stack.services
    with make_caller(quota_stack, "bytes") as caller:
        services.accounts.set_limits(caller.workspace, max_in_flight=1)
        running = blocker(caller, "bytes blocker")
        bodies = [json.dumps({"prompt": unique_prompt(f"bytes {n}") + " " + "x" * 2000}) for n in range(4)]
        size = len(bodies[0].encode())
        stored = services.accounts.get(caller.workspace).queued_bytes  # the blocker's
        services.accounts.set_limits(caller.workspace, max_queued_bytes=stored + 3 * size + size // 2)

        def submit(body: str, key: str) -> requests.Response:
            return caller.session.post(caller.url(FLUX), data=body,
                                       headers=caller.headers({"Content-Type": "application/json",
                                                               "Idempotency-Key": key}), timeout=10)

        admitted = [submit(body, f"k{n}") for n, body in enumerate(bodies[:3])]
        assert [a.status_code for a in admitted] == [201, 201, 201]
        ids = [a.json()["request_id"] for a in admitted]
        assert services.accounts.get(caller.workspace).queued_bytes == stored + 3 * size
        refused = submit(bodies[3], "k3")
        assert_429(refused, "queued_bytes_full")
        assert services.accounts.get(caller.workspace).queued_bytes == stored + 3 * size
        # a queued one ends: its bytes come back and the same key admits the refused body
        assert caller.cancel(FLUX, ids[0]).status_code == 202
        again = submit(bodies[3], "k3")
        assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
        ids.append(again.json()["request_id"])
        # the blocker is cancelled; everything else runs to its end
        assert caller.cancel(FLUX, running).status_code == 202
        finished = {i: caller.wait_status(FLUX, i, timeout_s=60) for i in [running, *ids]}
        assert finished[ids[0]]["error_type"] == "cancelled"
        assert all("error_type" not in finished[i] for i in ids[1:])
        ws = services.accounts.get(caller.workspace)
        assert ws.queued_bytes == 0 and ws.held == 0
        ledger = ledger_by_request(services, caller.workspace)
        assert set(ledger) == {running, *ids}  # the refused body held nothing
        assert ledger[ids[0]] == ["hold", "release"]
        assert all(ledger[i] == ["hold", "charge"] for i in ids[1:])
        assert ledger[running] in (["hold", "release"], ["hold", "charge"])


# -- pending webhook events -------------------------------------------------------------------


def test_a_submit_and_cancel_flood_stops_at_the_pending_webhooks_cap(
        quota_stack: RunningStack, receiver: Receiver) -> None:
    services = quota_stack.services
    caller, _ = workspace_with_secret(quota_stack, "hooks")
    cap = 3
    with caller:
        services.accounts.set_limits(caller.workspace, max_pending_webhooks=cap, max_in_flight=1)
        running = blocker(caller, "hooks blocker")
        url = receiver.configure(f"quota-{caller.workspace}", plan=["503"])
        hook = {"X-Comfy-Webhook-Url": url}
        flood = []
        for n in range(cap):
            request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt(f"flood {n}")}, headers=hook)
            assert caller.cancel(FLUX, request_id).status_code == 202
            flood.append(request_id)
        assert services.accounts.get(caller.workspace).webhooks_pending == cap
        assert_429(caller.submit(FLUX, {"prompt": unique_prompt("flood past the cap")}, headers=hook),
                   "pending_webhooks_full")
        assert_429(caller.session.post(f"{quota_stack.base_url}/v2/models/{FLUX}",
                                       json={"prompt": unique_prompt("sync past the cap")},
                                       headers=caller.headers(hook), timeout=10), "pending_webhooks_full")
        without = caller.submit_ok(FLUX, {"prompt": unique_prompt("no webhook")})
        assert caller.cancel(FLUX, without).status_code == 202
        # the receiver recovers: each event is delivered once and the quota frees
        receiver.configure(f"quota-{caller.workspace}", plan=["204"])
        wait_for(lambda: services.accounts.get(caller.workspace).webhooks_pending == 0, timeout_s=30,
                 what="the flood's events delivered")
        delivered = [a for a in receiver.attempts(f"quota-{caller.workspace}") if a["action"] == "204"]
        assert sorted(a["event"]["request_id"] for a in delivered) == sorted(flood)
        admitted = caller.submit_ok(FLUX, {"prompt": unique_prompt("after delivery")}, headers=hook)
        assert caller.cancel(FLUX, admitted).status_code == 202
        assert caller.cancel(FLUX, running).status_code == 202
        assert {services.webhooks.event(i)["state"] for i in flood} == {"delivered"}
