"""The retry route and the caller's deadlines (X-Comfy-Start-Deadline,
X-Comfy-Deadline), as a caller sees them and as the ledger records them, on
fakeredis and a real Redis."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
import requests

from router_queue import metrics
from router_queue.store import keys
from router_queue.store.outcomes import Claim
from router_queue.store.requests_values import Lease
from tests.unit.route_support import FAILED_BODY, FLUX, assert_error, failed, retry, status_of, submit
from tests.unit.support import record_of
from workers.context import WorkerContext
from workers.leases import LeaseKeeper
from workers.sweeper import sweep

LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)
#: flux-2-pro's queue timeout and longest run (catalog.json), the deadlines' bounds.
QUEUE_TIMEOUT_S, MAX_RUN_S = 86_400, 1_800


def ledger_types(services, workspace, request_id):
    return [entry.type for entry in services.accounts.ledger(workspace) if entry.request_id == request_id]


def held_and_credits(services, workspace):
    held, credits = services.redis.hmget(keys.workspace(workspace), "held", "credits")
    return int(held or 0), int(credits or 0)


def context_of(services) -> WorkerContext:
    return WorkerContext(services, requests.Session(), services.dispatcher,
                         LeaseKeeper(services.store, services.settings.lease_s))


def seconds_from(iso: str, ts: float) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() - ts


# -- retry -----------------------------------------------------------------------------


def test_a_retry_submits_the_failed_body_again_as_a_new_request(http, auth, services, workspace):
    original = failed(http, auth, services)
    submitted = submit(http, auth, {"prompt": "any"})
    response = retry(http, auth, original)
    assert response.status_code == 201, response.get_data(as_text=True)
    new = response.json["request_id"]
    assert new != original
    assert set(response.json) == set(submitted.json)  # the submit's 201, field for field
    assert response.headers["X-Comfy-Request-Id"] == new
    assert "Idempotent-Replayed" not in response.headers
    body = status_of(http, auth, new)
    assert (body["status"], body["retry_of"]) == ("IN_QUEUE", original)
    assert "retry_of" not in status_of(http, auth, original)
    _, stored = services.store.load(new)
    assert json.loads(stored) == FAILED_BODY
    # admitted like any submit: its price held, its body counted until it completes
    assert ledger_types(services, workspace, new) == ["hold"]
    assert int(services.redis.hget(keys.workspace(workspace), "queued_bytes")) == (
        len(json.dumps(FAILED_BODY)) + len(json.dumps({"prompt": "any"})))


def test_a_retry_of_a_retry_names_its_own_original(http, auth, services):
    first = failed(http, auth, services)
    second = retry(http, auth, first).json["request_id"]
    services.store.claim(record_of(services, second, "bfl"), LEASE)
    services.store.complete(record_of(services, second, "bfl"), error_type="provider_timeout", detail="slow")
    third = retry(http, auth, second).json["request_id"]
    assert status_of(http, auth, third)["retry_of"] == second
    assert json.loads(services.store.load(third)[1]) == FAILED_BODY


@pytest.mark.parametrize("error_type", ["provider_error", "provider_timeout", "cancelled", "queue_timeout"])
def test_every_failure_can_be_retried(http, auth, services, error_type):
    original = failed(http, auth, services, error_type=error_type)
    assert retry(http, auth, original).status_code == 201


def test_only_a_failed_request_is_retried(http, auth, services):
    queued = submit(http, auth).json["request_id"]
    running = submit(http, auth).json["request_id"]
    services.store.claim(record_of(services, running, "bfl"), LEASE)
    succeeded = submit(http, auth).json["request_id"]
    services.store.claim(record_of(services, succeeded, "bfl"), LEASE)
    services.store.complete(record_of(services, succeeded, "bfl"), output=b"{}", content_type="application/json")
    depth = services.store.queue_depth("bfl")
    for request_id, said in ((queued, "IN_QUEUE"), (running, "IN_PROGRESS"), (succeeded, "succeeded")):
        response = retry(http, auth, request_id)
        assert_error(response, 409, "invalid_input")
        assert said in response.json["detail"]
    assert services.store.queue_depth("bfl") == depth  # nothing admitted


def test_another_workspaces_failed_request_looks_unknown(http, auth, services):
    theirs = services.accounts.mint_key(services.accounts.create_workspace("them", queue_enabled=True, credits=999))
    original = failed(http, {"X-API-Key": theirs}, services)
    unknown = services.ids.mint("ws_nobody", "bfl/flux-2-pro")
    mine = failed(http, auth, services)
    for request_id in (original, unknown, "not-an-id", mine + "%0A"):
        assert_error(retry(http, auth, request_id), 404, "request_not_found")
    assert_error(retry(http, auth, mine, path="/v2/models/vertexai/gemini-3.1-flash-image"), 404,
                 "request_not_found")
    assert_error(retry(http, auth, mine, path="/v2/models/bfl/nope"), 404, "model_not_found")
    assert_error(retry(http, {}, mine), 401, "unauthorized")


def test_a_retry_past_retention_is_gone_and_one_without_a_kept_body_is_409(http, auth, services):
    expired = failed(http, auth, services)
    services.redis.delete(keys.request(expired), keys.body(expired))
    response = retry(http, auth, expired)
    assert response.status_code == 410 and "detail" in response.json
    bodiless = failed(http, auth, services)
    services.redis.delete(keys.body(bodiless))  # failed before bodies were kept
    assert_error(retry(http, auth, bodiless), 409, "invalid_input")


def test_a_failed_body_is_kept_for_the_retention_and_a_succeeded_one_is_not(http, auth, services, workspace):
    original = failed(http, auth, services)
    assert 0 < services.redis.ttl(keys.body(original)) <= services.settings.result_retention_s
    assert int(services.redis.hget(keys.workspace(workspace), "queued_bytes")) == 0  # no longer counted
    done = submit(http, auth).json["request_id"]
    services.store.claim(record_of(services, done, "bfl"), LEASE)
    services.store.complete(record_of(services, done, "bfl"), output=b"{}", content_type="application/json")
    assert services.redis.exists(keys.body(done)) == 0


def test_a_retry_already_made_under_its_idempotency_key_is_409_naming_it(http, auth, services, workspace):
    original, other = failed(http, auth, services), failed(http, auth, services, body={"prompt": "other"})
    first = retry(http, auth, original, headers={"Idempotency-Key": "again-1"})
    assert first.status_code == 201
    queued = services.accounts.get(workspace).queued
    again = retry(http, auth, original, headers={"Idempotency-Key": "again-1"})
    assert_error(again, 409, "invalid_input")
    assert first.json["request_id"] in again.json["detail"]  # where the caller finds the retry it made
    assert services.accounts.get(workspace).queued == queued  # nothing new admitted
    # the key is bound to this retry: another request's retry, or a submit, under it is refused
    assert_error(retry(http, auth, other, headers={"Idempotency-Key": "again-1"}), 409, "invalid_input")
    assert_error(submit(http, auth, FAILED_BODY, headers={"Idempotency-Key": "again-1"}), 409, "invalid_input")
    # without a key each retry is a new request
    assert retry(http, auth, original).json["request_id"] != first.json["request_id"]


def test_a_retry_is_admitted_like_any_submit(http, auth, services, workspace):
    original = failed(http, auth, services)
    services.accounts.set_credits(workspace, 0)
    assert_error(retry(http, auth, original), 402, "insufficient_credits")
    services.accounts.set_credits(workspace, 1000)
    services.accounts.set_queue_enabled(workspace, False)
    assert_error(retry(http, auth, original), 403, "not_enabled")
    services.accounts.set_queue_enabled(workspace, True)
    services.accounts.set_limits(workspace, max_queued=0)
    assert_error(retry(http, auth, original), 429, "queue_backlog_full")
    services.accounts.set_limits(workspace, max_queued=10, max_queued_bytes=5)
    assert_error(retry(http, auth, original), 429, "queued_bytes_full")
    services.accounts.set_limits(workspace, max_queued_bytes=10_000)
    assert_error(retry(http, auth, original, headers={"X-Comfy-Priority": "urgent"}), 400, "invalid_input")
    assert_error(retry(http, auth, original, headers={"X-Comfy-Deadline": "nan"}), 400, "invalid_input")
    response = retry(http, auth, original, headers={"X-Comfy-Priority": "high", "X-Comfy-Deadline": "60"})
    assert response.status_code == 201
    assert "deadline_at" in status_of(http, auth, response.json["request_id"])


# -- deadlines: the headers ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "0", "0.0", "-5", "nan", "NaN", "inf", "1e3", "+5", " 5", "5s", "0x10",
                                   "1" * 10, "1.1234567", "99999999999999999999", "5,5"])
@pytest.mark.parametrize("header", ["X-Comfy-Start-Deadline", "X-Comfy-Deadline"])
def test_a_malformed_deadline_is_invalid_input_and_admits_nothing(http, auth, services, header, value):
    assert_error(submit(http, auth, headers={header: value}), 400, "invalid_input")
    assert_error(http.post(FLUX, json={"prompt": "sync"}, headers={**auth, header: value}), 400, "invalid_input")
    assert services.store.queue_depth("bfl") == 0


def test_a_deadline_past_the_models_own_policy_is_refused(http, auth, services):
    start = submit(http, auth, headers={"X-Comfy-Start-Deadline": str(QUEUE_TIMEOUT_S + 1)})
    assert_error(start, 400, "invalid_input")
    assert "queue timeout" in start.json["detail"]
    run = submit(http, auth, headers={"X-Comfy-Deadline": str(QUEUE_TIMEOUT_S + MAX_RUN_S + 1)})
    assert_error(run, 400, "invalid_input")
    at_bounds = submit(http, auth, headers={"X-Comfy-Start-Deadline": str(QUEUE_TIMEOUT_S),
                                            "X-Comfy-Deadline": str(QUEUE_TIMEOUT_S + MAX_RUN_S)})
    assert at_bounds.status_code == 201


def test_the_status_shows_the_deadlines_and_omits_them_when_unset(http, auth):
    before = time.time()
    request_id = submit(http, auth, headers={"X-Comfy-Start-Deadline": "30",
                                             "X-Comfy-Deadline": "90.5"}).json["request_id"]
    body = status_of(http, auth, request_id)
    assert 29 < seconds_from(body["start_deadline_at"], before) < 32
    assert 89.5 < seconds_from(body["deadline_at"], before) < 92.5
    assert body["start_deadline_at"].endswith("Z") and body["deadline_at"].endswith("Z")
    plain = status_of(http, auth, submit(http, auth).json["request_id"])
    assert "start_deadline_at" not in plain and "deadline_at" not in plain


# -- deadlines: the claim enforces them at once ----------------------------------------------


def test_a_claim_after_the_start_deadline_ends_queue_timeout_uncharged(http, auth, services, workspace):
    request_id = submit(http, auth, headers={"X-Comfy-Start-Deadline": "5"}).json["request_id"]
    record = record_of(services, request_id, "bfl")
    _, credits = held_and_credits(services, workspace)
    assert services.store.claim(record, LEASE, now=record.created_at + 6) is Claim.QUEUE_TIMEOUT
    body = status_of(http, auth, request_id)
    assert (body["status"], body["error_type"]) == ("COMPLETED", "queue_timeout")
    assert "X-Comfy-Start-Deadline" in body["detail"]
    assert "started_at" not in body
    assert ledger_types(services, workspace, request_id) == ["hold", "release"]
    assert held_and_credits(services, workspace) == (0, credits)
    assert services.redis.zcard(keys.deadlines("bfl")) == 0
    assert services.store.in_flight("bfl") == 0


def test_a_claim_before_the_start_deadline_runs_it_and_drops_that_deadline(http, auth, services):
    request_id = submit(http, auth, headers={"X-Comfy-Start-Deadline": "5",
                                             "X-Comfy-Deadline": "60"}).json["request_id"]
    record = record_of(services, request_id, "bfl")
    assert services.store.claim(record, LEASE, now=record.created_at + 4) is Claim.CLAIMED
    assert [m.decode() for m in services.redis.zrange(keys.deadlines("bfl"), 0, -1)] == [f"run|{request_id}"]
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    assert services.redis.zcard(keys.deadlines("bfl")) == 0  # completed: nothing left to enforce


def test_a_claim_after_the_deadline_cancels_it_unrun(http, auth, services, workspace):
    request_id = submit(http, auth, headers={"X-Comfy-Deadline": "5"}).json["request_id"]
    record = record_of(services, request_id, "bfl")
    assert services.store.claim(record, LEASE, now=record.created_at + 6) is Claim.DEADLINE
    body = status_of(http, auth, request_id)
    assert (body["error_type"], "X-Comfy-Deadline" in body["detail"]) == ("cancelled", True)
    assert ledger_types(services, workspace, request_id) == ["hold", "release"]


# -- deadlines: the sweeper enforces them within its interval ------------------------------------


def test_the_sweeper_ends_a_request_waiting_past_its_start_deadline(http, auth, services, workspace):
    late = submit(http, auth, headers={"X-Comfy-Start-Deadline": "2"}).json["request_id"]
    patient = submit(http, auth, headers={"X-Comfy-Start-Deadline": "600"}).json["request_id"]
    created = record_of(services, late, "bfl").created_at
    _, credits = held_and_credits(services, workspace)
    context = context_of(services)
    assert sweep(context, now=created + 1).timed_out == 0
    report = sweep(context, now=created + 3)
    assert report.timed_out == 1
    body = status_of(http, auth, late)
    assert (body["status"], body["error_type"]) == ("COMPLETED", "queue_timeout")
    assert "X-Comfy-Start-Deadline" in body["detail"]
    assert status_of(http, auth, patient)["status"] == "IN_QUEUE"
    assert ledger_types(services, workspace, late) == ["hold", "release"]
    assert held_and_credits(services, workspace) == (60, credits)  # only the patient one is held
    assert sweep(context, now=created + 4).timed_out == 0  # once


def test_a_start_deadline_no_longer_matters_once_the_request_started(http, auth, services):
    request_id = submit(http, auth, headers={"X-Comfy-Start-Deadline": "2"}).json["request_id"]
    created = record_of(services, request_id, "bfl").created_at
    services.redis.zadd(keys.deadlines("bfl"), {f"start|{request_id}": created + 2})  # as if the claim lost it
    services.store.claim(record_of(services, request_id, "bfl"), LEASE, now=created + 1)
    assert sweep(context_of(services), now=created + 3).timed_out == 0
    assert status_of(http, auth, request_id)["status"] == "IN_PROGRESS"
    assert services.redis.zcard(keys.deadlines("bfl")) == 0


def test_the_sweeper_cancels_a_queued_request_past_its_deadline_as_the_cancel_route_would(
        http, auth, services, workspace):
    request_id = submit(http, auth, headers={"X-Comfy-Deadline": "2"}).json["request_id"]
    created = record_of(services, request_id, "bfl").created_at
    report = sweep(context_of(services), now=created + 3)
    assert report.deadline_cancels == 1
    body = status_of(http, auth, request_id)
    assert (body["status"], body["error_type"]) == ("COMPLETED", "cancelled")
    assert "X-Comfy-Deadline" in body["detail"]
    assert_error(http.get(f"{FLUX}/requests/{request_id}", headers=auth), 409, "cancelled")
    assert ledger_types(services, workspace, request_id) == ["hold", "release"]
    assert services.redis.zcard(keys.deadlines("bfl")) == 0


@pytest.mark.parametrize("billable", [False, True])
def test_a_running_request_past_its_deadline_is_flagged_for_its_worker(http, auth, services, workspace,
                                                                       billable):
    request_id = submit(http, auth, headers={"X-Comfy-Deadline": "2"}).json["request_id"]
    created = record_of(services, request_id, "bfl").created_at
    services.store.claim(record_of(services, request_id, "bfl"), LEASE, now=created + 1)
    assert sweep(context_of(services), now=created + 3).deadline_cancels == 1
    assert services.store.cancel_requested(request_id)  # what the cancel route sets, read by the worker
    assert services.redis.zcard(keys.deadlines("bfl")) == 0
    # the worker stops and completes it cancelled, as it does for the cancel route
    services.store.complete(record_of(services, request_id, "bfl"), error_type="cancelled",
                            detail="cancelled by the caller while running", billable=billable)
    body = status_of(http, auth, request_id)
    assert body["error_type"] == "cancelled"
    assert "X-Comfy-Deadline" in body["detail"]
    assert ledger_types(services, workspace, request_id) == ["hold", "charge" if billable else "release"]


def test_the_callers_own_cancel_keeps_its_reason_after_a_deadline_passes(http, auth, services):
    request_id = submit(http, auth, headers={"X-Comfy-Deadline": "2"}).json["request_id"]
    created = record_of(services, request_id, "bfl").created_at
    services.store.claim(record_of(services, request_id, "bfl"), LEASE, now=created + 1)
    assert http.put(f"{FLUX}/requests/{request_id}/cancel", headers=auth).status_code == 202
    sweep(context_of(services), now=created + 3)
    services.store.complete(record_of(services, request_id, "bfl"), error_type="cancelled", detail="stopped")
    assert status_of(http, auth, request_id)["detail"] == "cancelled by the caller while running"


def test_deadlines_of_expired_requests_are_dropped(http, auth, services):
    request_id = submit(http, auth, headers={"X-Comfy-Deadline": "2"}).json["request_id"]
    created = record_of(services, request_id, "bfl").created_at
    services.redis.delete(keys.request(request_id))
    assert sweep(context_of(services), now=created + 3).deadline_cancels == 0
    assert services.redis.zcard(keys.deadlines("bfl")) == 0


def test_racing_retries_under_one_key_admit_one_request(app, auth, services, workspace):
    http = app.test_client()
    original = failed(http, auth, services)

    def one(_):
        response = retry(app.test_client(), auth, original, headers={"Idempotency-Key": "raced"})
        return response.status_code, response.json.get("request_id")

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(one, range(16)))
    # one is admitted; every other is told it was already retried (or is being admitted)
    assert sorted(status for status, _ in answers) == [201] + [409] * 15
    (new,) = {request_id for status, request_id in answers if status == 201}
    assert ledger_types(services, workspace, new) == ["hold"]
    assert services.store.queue_depth("bfl") == 1


def test_the_sweeper_counts_what_deadlines_did(http, auth, services):
    request_id = submit(http, auth, headers={"X-Comfy-Deadline": "2"}).json["request_id"]
    created = record_of(services, request_id, "bfl").created_at
    counted = metrics.REGISTRY.get_sample_value("router_queue_sweeper_actions_total", {"action": "deadline_cancels"})
    sweep(context_of(services), now=created + 3)
    assert metrics.REGISTRY.get_sample_value("router_queue_sweeper_actions_total",
                                             {"action": "deadline_cancels"}) == counted + 1
