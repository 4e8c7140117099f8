"""Batches (POST /v2/batches) on the front door and their drain: the NDJSON
body read line by line, each bad line answered by its number, the whole-call
limits, idempotent resends, waiting for room, results, status and cancel."""

from __future__ import annotations

import json

import pytest

from router_queue.batches.drain import drain
from router_queue.settings import Secret, Settings
from tests.unit.conftest import TEST_WEBHOOK_SECRETS_KEY
from tests.unit.route_support import assert_error, status_of

NDJSON = {"Content-Type": "application/x-ndjson"}
GOOD = {"model": "bfl/flux-2-pro", "body": {"prompt": "a red teapot"}}
#: The smallest MAX_BODY_BYTES these tests run with, so a line over it is cheap to send.
MAX_BODY = 4096
#: And the smallest MAX_BATCH_BYTES: 10,001 lines still fit under it.
MAX_BATCH = 2_000_000


@pytest.fixture
def settings() -> Settings:
    return Settings(redis_url="redis://unused", public_base_url="http://router.test", republish_after_s=0,
                    default_rate_limit="1000/second", readyz_cache_s=0, max_body_bytes=MAX_BODY,
                    max_batch_bytes=MAX_BATCH, webhook_allow_loopback_http=True,
                    webhook_secrets_keys=(Secret(TEST_WEBHOOK_SECRETS_KEY),))


def ndjson(*lines) -> str:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)


def send(http, auth, data, *, headers=None):
    return http.post("/v2/batches", data=data, headers={**auth, **NDJSON, **(headers or {})})


def results(http, auth, batch_id):
    response = http.get(f"/v2/batches/{batch_id}/results", headers=auth)
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.mimetype == "application/x-ndjson"
    return [json.loads(line) for line in response.get_data(as_text=True).splitlines()]


def test_a_batch_is_answered_once_durable_and_each_bad_line_by_its_number(http, auth, services, workspace):
    with_metadata = {**GOOD, "metadata": {"sku": "A-17"}}
    response = send(http, auth, ndjson(with_metadata, {"model": "bfl/flux-9", "body": {}}, "{not json",
                                       {"model": "bfl/flux-2-pro", "body": {"prompt": 7}}))
    assert response.status_code == 201, response.get_data(as_text=True)
    batch_id = response.json["batch_id"]
    assert response.json["counts"] == {"lines": 4, "accepted": 1, "refused": 3}
    assert response.json["results_url"] == f"http://router.test/v2/batches/{batch_id}/results"
    assert (batch_id, "batch") in services.dispatcher.published  # its drain was published
    before = results(http, auth, batch_id)
    assert before[0] == {"line": 1, "request_id": None, "status": "IN_QUEUE", "response_url": None}
    assert drain(services, workspace, batch_id).stopped == "done"
    lines = results(http, auth, batch_id)
    assert [line["line"] for line in lines] == [1, 2, 3, 4]
    assert lines[0]["status"] == "IN_QUEUE" and lines[0]["request_id"]
    assert [line.get("error_type") for line in lines[1:]] == ["model_not_found", "invalid_input", "invalid_input"]
    assert all(line["request_id"] is None and line["detail"] for line in lines[1:])
    shown = status_of(http, auth, lines[0]["request_id"])
    assert (shown["batch_id"], shown["line"], shown["metadata"]) == (batch_id, 1, {"sku": "A-17"})
    batch = http.get(f"/v2/batches/{batch_id}", headers=auth)
    assert batch.status_code == 200
    assert batch.json["status"] == "IN_PROGRESS"  # three lines ended, one waits in the queue
    assert batch.json["counts"]["by_error_type"] == {"model_not_found": 1, "invalid_input": 2}
    assert batch.json["credits"]["held"] > 0
    assert batch.headers["Retry-After"] != "0"


def test_whole_call_refusals(http, auth, services, workspace):
    assert_error(http.post("/v2/batches", data=ndjson(GOOD), headers={**auth, "Content-Type": "application/json"}),
                 415, "invalid_input")
    too_many = ndjson(*[GOOD] * 10_001)
    refused = send(http, auth, too_many)
    assert_error(refused, 413, "invalid_input")
    assert "10000" in refused.json["detail"] and "line 10001" in refused.json["detail"]
    assert http.get("/v2/batches", headers=auth).json["batches"] == []  # nothing was kept
    assert_error(send(http, auth, "\n"), 400, "invalid_input")
    over = send(http, auth, ndjson(*[GOOD] * (MAX_BATCH // len(ndjson(GOOD)) + 1)))
    assert_error(over, 413, "invalid_input")
    assert "MAX_BATCH_BYTES" in over.json["detail"]
    no_secret = send(http, auth, ndjson(GOOD), headers={"X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook"})
    assert_error(no_secret, 400, "invalid_input")
    assert "signing secret" in no_secret.json["detail"]
    assert_error(http.get("/v2/batches/00000000-0000-4000-8000-000000000000", headers=auth), 404, "batch_not_found")
    assert_error(http.get("/v2/batches/nonsense/results", headers=auth), 404, "batch_not_found")


def test_invalid_json_on_line_7000_refuses_that_line_only(http, auth, services, workspace):
    lines = [GOOD] * 6999 + ['{"model": "bfl/flux-2-pro", "body": '] + [GOOD] * 10
    response = send(http, auth, ndjson(*lines))
    assert response.status_code == 201, response.get_data(as_text=True)
    assert response.json["counts"] == {"lines": 7010, "accepted": 7009, "refused": 1}
    shown = results(http, auth, response.json["batch_id"])
    assert len(shown) == 7010
    assert [s["line"] for s in shown if s.get("error_type")] == [7000]
    assert "JSON" in shown[6999]["detail"]


def test_empty_lines_and_a_line_over_the_body_limit_are_named(http, auth, services, workspace):
    huge = {"model": "bfl/flux-2-pro", "body": {"prompt": "x" * (MAX_BODY + 20_000)}}
    response = send(http, auth, ndjson(GOOD, "", GOOD, huge, GOOD) + "\n\n")
    assert response.status_code == 201, response.get_data(as_text=True)
    assert response.json["counts"]["lines"] == 5  # the blank lines at the end are not lines
    shown = results(http, auth, response.json["batch_id"])
    assert [(s["line"], s.get("error_type")) for s in shown] == [
        (1, None), (2, "invalid_input"), (3, None), (4, "invalid_input"), (5, None)]
    assert "empty" in shown[1]["detail"] and "longer than" in shown[3]["detail"]
    over = {"model": "bfl/flux-2-pro", "body": {"prompt": "y" * (MAX_BODY + 10)}}  # within a line, over the body
    second = results(http, auth, send(http, auth, ndjson(over)).json["batch_id"])
    assert second[0]["error_type"] == "invalid_input" and "MAX_BODY_BYTES" in second[0]["detail"]


def test_a_resent_batch_answers_the_same_batch_and_admits_nothing_twice(http, auth, services, workspace):
    body = ndjson(GOOD, GOOD)
    first = send(http, auth, body, headers={"Idempotency-Key": "shots-1"})
    again = send(http, auth, body, headers={"Idempotency-Key": "shots-1"})
    assert first.status_code == again.status_code == 201
    assert again.json["batch_id"] == first.json["batch_id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert_error(send(http, auth, ndjson(GOOD), headers={"Idempotency-Key": "shots-1"}), 409, "invalid_input")
    batch_id = first.json["batch_id"]
    drain(services, workspace, batch_id)
    services.batches.client.hset(f"{{ws:{workspace}}}:batch:{batch_id}", "cursor", 0)  # as if it crashed
    drain(services, workspace, batch_id)  # re-run: every line replays its own request
    ids = [line["request_id"] for line in results(http, auth, batch_id)]
    assert len(set(ids)) == 2 and None not in ids
    assert len(http.get("/v2/requests", headers=auth).json["requests"]) == 2


def test_lines_wait_for_room_and_are_never_refused_for_the_backlog(http, auth, services, workspace):
    services.store.max_queued = 2
    batch_id = send(http, auth, ndjson(*[GOOD] * 5)).json["batch_id"]
    assert drain(services, workspace, batch_id).stopped == "waiting"
    shown = results(http, auth, batch_id)
    assert [bool(s["request_id"]) for s in shown] == [True, True, False, False, False]
    assert not any(s.get("error_type") for s in shown)
    services.store.max_queued = 10
    assert drain(services, workspace, batch_id).stopped == "done"
    assert all(s["request_id"] for s in results(http, auth, batch_id))


def test_a_line_the_workspace_cannot_fund_ends_alone(http, auth, services, workspace):
    poor_id = services.accounts.create_workspace("poor", queue_enabled=True, credits=1)
    poor = {"X-API-Key": services.accounts.mint_key(poor_id)}
    batch_id = send(http, poor, ndjson(GOOD)).json["batch_id"]
    drain(services, poor_id, batch_id)
    assert results(http, poor, batch_id)[0]["error_type"] == "insufficient_credits"
    assert http.get(f"/v2/batches/{batch_id}", headers=poor).json["status"] == "COMPLETED"
    assert_error(http.get(f"/v2/batches/{batch_id}", headers=auth), 404, "batch_not_found")  # another's


def test_cancel_ends_every_line_not_finished(http, auth, services, workspace):
    services.store.max_queued = 2
    batch_id = send(http, auth, ndjson(*[GOOD] * 4)).json["batch_id"]
    drain(services, workspace, batch_id)
    cancelled = http.put(f"/v2/batches/{batch_id}/cancel", headers=auth)
    assert cancelled.status_code == 202, cancelled.get_data(as_text=True)
    assert cancelled.json["cancelled"] == 2
    assert drain(services, workspace, batch_id).stopped == "done"  # nothing more is admitted
    shown = results(http, auth, batch_id)
    assert [s.get("error_type") for s in shown] == ["cancelled"] * 4
    batch = http.get(f"/v2/batches/{batch_id}", headers=auth)
    assert batch.json["status"] == "COMPLETED" and batch.headers["Retry-After"] == "0"
    assert batch.json["counts"]["by_error_type"] == {"cancelled": 4}
    assert http.put(f"/v2/batches/{batch_id}/cancel", headers=auth).status_code == 409


def test_open_batches_are_capped_and_listed(http, auth, services, workspace):
    for _ in range(services.settings.max_open_batches):
        assert send(http, auth, ndjson(GOOD)).status_code == 201
    assert_error(send(http, auth, ndjson(GOOD)), 409, "concurrency_limit_exceeded")
    page = http.get("/v2/batches?limit=3", headers=auth).json
    assert len(page["batches"]) == 3 and page["next_cursor"]
    rest = http.get(f"/v2/batches?limit=3&cursor={page['next_cursor']}", headers=auth).json
    assert len(rest["batches"]) == 2
    assert_error(http.get("/v2/batches?cursor=zz", headers=auth), 400, "invalid_input")


def test_the_sweeper_resumes_a_waiting_drain_and_finishes_a_batch_once_its_lines_end(http, auth, services,
                                                                                     workspace):
    from router_queue.batches.sweep import sweep_batches
    from tests.unit.route_support import LEASE
    from tests.unit.support import record_of

    services.store.max_queued = 2
    batch_id = send(http, auth, ndjson(*[GOOD] * 3)).json["batch_id"]
    published: list[str] = []
    drain(services, workspace, batch_id)
    sweep_batches(services, lambda ws, b: published.append(b), lambda ws, b: published.append(f"hook {b}"))
    assert published == [batch_id]  # a line still waits in it: its drain is published again
    services.store.max_queued = 10
    drain(services, workspace, batch_id)
    ids = [line["request_id"] for line in results(http, auth, batch_id)]
    for request_id in ids[:2]:
        services.store.claim(record_of(services, request_id, "bfl"), LEASE)
        services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    assert sweep_batches(services, published.append, published.append) == 0  # the third still waits
    assert services.batches.get(workspace, batch_id)["ended"] == "2"  # the next check starts at line 3
    services.store.cancel(request_id=ids[2], workspace=workspace, model="bfl/flux-2-pro", provider="bfl")
    assert sweep_batches(services, published.append, published.append) == 1
    final = http.get(f"/v2/batches/{batch_id}", headers=auth).json
    assert final["status"] == "COMPLETED" and final["counts"]["by_error_type"] == {"cancelled": 1}
    assert final["credits"]["charged"] > 0 and final["credits"]["held"] == 0
    assert services.batches.unfinished() == []  # settled: no webhook owed


def test_a_step_admitted_by_a_drain_that_died_is_cancelled_with_its_batch(http, auth, services, workspace):
    from router_queue.batches.drain import _admit_chunk

    batch_id = send(http, auth, ndjson(*[GOOD] * 3)).json["batch_id"]
    # the drain SIGKILLed mid-step: its admissions reached Redis, its progress never did
    outcomes = _admit_chunk(services, workspace, batch_id, 0, services.batches.lines(workspace, batch_id, 0, 3))
    ids = [o.split("|", 1)[0] for o in outcomes or []]
    assert len(ids) == 3 and all(status_of(http, auth, i)["status"] == "IN_QUEUE" for i in ids)
    assert http.put(f"/v2/batches/{batch_id}/cancel", headers=auth).status_code == 202
    drain(services, workspace, batch_id)  # the sweeper's next drain
    assert [status_of(http, auth, i).get("error_type") for i in ids] == ["cancelled"] * 3
    assert [s.get("error_type") for s in results(http, auth, batch_id)] == ["cancelled"] * 3


def test_a_drains_step_that_lands_after_the_cancel_admits_nothing(http, auth, services, workspace):
    """A live drain read its chunk, then the cancel answered, then the step's admissions reached
    Redis: each is refused in admission's own step (the batch's "cancelled"), so no request of the
    batch exists that the cancel's answer did not cover, and every line reads cancelled."""
    from router_queue.batches.drain import _admit_chunk

    batch_id = send(http, auth, ndjson(*[GOOD] * 3)).json["batch_id"]
    texts = services.batches.lines(workspace, batch_id, 0, 3)  # the drain's chunk, read before the cancel
    before = services.accounts.get(workspace)
    assert http.put(f"/v2/batches/{batch_id}/cancel", headers=auth).status_code == 202
    assert _admit_chunk(services, workspace, batch_id, 0, texts) == [None, None, None]  # each waits: not admitted
    for text in texts:
        assert http.get(f"/v2/models/bfl/flux-2-pro/requests/{json.loads(text)['id']}/status",
                        headers=auth).status_code == 410  # its id genuine (minted at staging), never admitted
    after = services.accounts.get(workspace)
    assert (after.held, after.queued) == (before.held, before.queued) == (0, 0)  # nothing held, nothing queued
    drain(services, workspace, batch_id)  # the sweeper's next drain: the batch is cancelled, it admits nothing
    assert [s.get("error_type") for s in results(http, auth, batch_id)] == ["cancelled"] * 3


def test_a_batch_webhook_is_the_webhooks_workers_to_send_in_its_workspaces_turn(http, auth, services, workspace,
                                                                               monkeypatch):
    """Published by the sweeper to the webhooks worker, never POSTed in the sweep;
    sent in the workspace's turn (its per-workspace cap, its endpoint's circuit),
    as a request's events are, and logged with them; one attempt at a time."""
    import dataclasses
    import time

    from router_queue.batches import finish
    from router_queue.batches.sweep import sweep_batches
    from router_queue.webhooks import event as webhook_event

    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    posted: list[dict] = []
    from router_queue.webhooks import delivery

    monkeypatch.setattr(delivery.safety, "check", lambda url, **_: ["127.0.0.1"])
    monkeypatch.setattr(delivery, "post", lambda url, address, body, headers, timeout: posted.append(json.loads(body))
                        or 200)
    hook = {"X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook"}
    batch_id = send(http, auth, ndjson({"model": "bfl/flux-9", "body": {}}), headers=hook).json["batch_id"]
    drain(services, workspace, batch_id)
    published: list[tuple[str, str]] = []
    sweep_batches(services, lambda ws, b: published.append(("drain", b)), lambda ws, b: published.append(("hook", b)))
    assert (published, posted) == ([("hook", batch_id)], [])  # the sweep itself sends nothing
    services.webhooks.limits = dataclasses.replace(services.webhooks.limits, max_in_flight_per_workspace=1)
    endpoint = "http://127.0.0.1:9"
    assert services.webhooks.turn(workspace, endpoint, now=time.time(), lease_s=30, token="an-event")[0] == "HELD"
    assert finish.send_webhook(services, workspace, batch_id) == "waiting"  # the workspace's one slot is taken
    assert posted == [] and services.batches.get(workspace, batch_id)["webhook"] == "owed"
    services.webhooks.end_turn(workspace, endpoint, token="an-event", now=time.time())
    services.batches.take_webhook(workspace, batch_id, "another-attempt", 30)
    assert finish.send_webhook(services, workspace, batch_id) == "busy"  # one attempt at a time
    services.batches.release_webhook(workspace, batch_id)
    assert finish.send_webhook(services, workspace, batch_id) == "delivered"
    assert [p["type"] for p in posted] == ["batch.completed"]
    assert [a.request_id for a in services.webhooks.attempts(workspace)] == [f"batch_{batch_id}"]
    assert finish.send_webhook(services, workspace, batch_id) == "not_owed"
