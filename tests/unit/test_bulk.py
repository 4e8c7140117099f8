"""Bulk actions (``POST /v2/requests/bulk``) as a caller sees them: the body's
checks, dry runs' counts, the action run in steps (``workers/bulk.py``), its
progress, its Idempotency-Key, and one workspace never reaching another's."""

from __future__ import annotations

import json
import time

import pytest

from router_queue.store import keys
from tests.unit.route_support import LEASE, assert_error, failed, status_of, submit
from tests.unit.support import context_of, record_of
from workers import bulk as bulk_steps
from workers.sweeper import sweep

BULK = "/v2/requests/bulk"


def post(http, auth, body, **headers):
    return http.post(BULK, data=json.dumps(body) if not isinstance(body, bytes) else body,
                     headers={**auth, "Content-Type": "application/json", **headers})


def run(services, bulk_id, workspace, steps=50):
    """Run the action's steps as the workers would, until it ends (or waits); the last step's answer."""
    context = context_of(services)
    answer = None
    for _ in range(steps):
        answer = bulk_steps.step(context, workspace, bulk_id)
        if answer is None or answer > 0:
            return answer
    raise AssertionError("the action did not end")


@pytest.mark.parametrize(("body", "status"), [
    (b"not json", 400),
    ({"filter": {}}, 422),  # no action
    ({"action": "delete"}, 422),
    ({"action": "retry", "filter": {"colour": "red"}}, 422),
    ({"action": "retry", "dry_run": "yes"}, 422),
    ({"action": "retry", "filter": {"status": "FAILED"}}, 400),
    ({"action": "retry", "filter": {"error_type": "oops"}}, 400),
    ({"action": "retry", "filter": {"model": "bfl/nope"}}, 400),
    ({"action": "retry", "filter": {"since": "yesterday"}}, 400),
    ({"action": "retry", "filter": {"since": "2026-12-02T05:00:00Z", "until": "2026-12-02T04:00:00Z"}}, 400),
    ({"action": "cancel", "filter": {"batch_id": "a b"}}, 400),
    ({"action": "cancel", "filter": {"batch_id": 7}}, 422),
])
def test_a_bad_body_is_refused_in_the_contracts_shape_and_nothing_is_written(http, auth, services, workspace, body,
                                                                             status):
    response = post(http, auth, body)
    assert_error(response, status, "invalid_input")
    assert not list(services.redis.scan_iter(match=f"{keys.workspace_prefix(workspace)}:bulk*"))


def test_a_dry_run_counts_what_matches_and_what_a_retry_would_hold(http, auth, services, workspace):
    failures = [failed(http, auth, services, {"prompt": f"failed {i}"}) for i in range(3)]
    failed(http, auth, services, {"prompt": "timed out"}, error_type="queue_timeout")
    submit(http, auth, {"prompt": "still waiting"})
    retry = post(http, auth, {"action": "retry", "filter": {"error_type": "provider_error"}, "dry_run": True})
    assert retry.status_code == 200, retry.get_data(as_text=True)
    assert retry.json == {"action": "retry", "dry_run": True, "matched": 3, "limited": False, "retryable": 3,
                          "credits": 3 * 60}
    every = post(http, auth, {"action": "retry", "filter": {"model": "bfl/flux-2-pro"}, "dry_run": True}).json
    assert (every["matched"], every["retryable"], every["credits"]) == (5, 4, 4 * 60)  # the waiting one is not
    cancel = post(http, auth, {"action": "cancel", "dry_run": True}).json
    assert (cancel["matched"], cancel["cancellable"]) == (5, 1)
    # nothing was written or done
    assert all(status_of(http, auth, i)["status"] == "COMPLETED" for i in failures)
    assert not list(services.redis.scan_iter(match=f"{keys.workspace_prefix(workspace)}:bulk*"))


def test_a_dry_run_leaves_out_a_chain_at_its_retry_cap(http, auth, services, settings):
    object.__setattr__(settings, "retry_max_per_request", 1)  # frozen: this test's own instance
    services.store.retry_max = 1
    original = failed(http, auth, services)
    again = http.post(f"/v2/models/bfl/flux-2-pro/requests/{original}/retry", headers=auth).json["request_id"]
    services.store.claim(record_of(services, again, "bfl"), LEASE)
    services.store.complete(record_of(services, again, "bfl"), error_type="provider_error", detail="again")
    counted = post(http, auth, {"action": "retry", "filter": {"status": "COMPLETED"}, "dry_run": True}).json
    assert (counted["matched"], counted["retryable"], counted["credits"]) == (2, 0, 0)


def test_a_bulk_retry_submits_each_failed_request_again_once_at_low_priority(http, auth, services, workspace):
    originals = {failed(http, auth, services, {"prompt": f"failed {i}"}) for i in range(3)}
    waiting = submit(http, auth, {"prompt": "still waiting"}).json["request_id"]
    answer = post(http, auth, {"action": "retry", "filter": {"model": "bfl/flux-2-pro"}})
    assert answer.status_code == 202, answer.get_data(as_text=True)
    bulk_id = answer.json["bulk_id"]
    assert answer.json["status"] == "IN_PROGRESS" and answer.json["action"] == "retry"
    assert answer.json["status_url"] == f"http://router.test{BULK}/{bulk_id}"
    assert run(services, bulk_id, workspace) is None
    progress = http.get(f"{BULK}/{bulk_id}", headers=auth).json
    assert progress["status"] == "COMPLETED" and progress["completed_at"]
    assert (progress["matched"], progress["done"], progress["skipped"], progress["failed"]) == (4, 3, 1, 0)
    assert progress["outcomes"] == {"retried": 3, "not_failed": 1} and progress["failures"] == {}
    retries = [r for r in http.get("/v2/requests?limit=100", headers=auth).json["requests"] if r.get("bulk_id")]
    assert {r["retry_of"] for r in retries} == originals and len(retries) == 3
    assert all(r["bulk_id"] == bulk_id and r["status"] == "IN_QUEUE" for r in retries)
    assert all(services.store.dump(r["request_id"])[0]["priority"] == "low" for r in retries)
    assert status_of(http, auth, waiting)["status"] == "IN_QUEUE"
    # the action's progress lost and run again (a worker died before counting): nothing admitted twice
    services.redis.hset(keys.bulk(workspace, bulk_id), mapping={"status": "IN_PROGRESS", "cursor": "", "matched": 0,
                                                                "done": 0, "done:retried": 0, "skipped": 0,
                                                                "skipped:not_failed": 0})
    assert run(services, bulk_id, workspace) is None
    listed = http.get("/v2/requests?limit=100", headers=auth).json["requests"]
    assert len(listed) == 7
    assert http.get(f"{BULK}/{bulk_id}", headers=auth).json["outcomes"] == {"retried": 3, "not_failed": 1}


def test_a_bulk_cancel_cancels_the_unfinished_ones_as_the_cancel_route_does(http, auth, services, workspace):
    queued = [submit(http, auth, {"prompt": f"queued {i}"}).json["request_id"] for i in range(3)]
    done = failed(http, auth, services)
    bulk_id = post(http, auth, {"action": "cancel", "filter": {"status": "IN_QUEUE"}}).json["bulk_id"]
    run(services, bulk_id, workspace)
    progress = http.get(f"{BULK}/{bulk_id}", headers=auth).json
    assert (progress["matched"], progress["done"], progress["outcomes"]) == (3, 3, {"cancelled": 3})
    for request_id in queued:
        body = status_of(http, auth, request_id)
        assert (body["status"], body["error_type"], body["cost"]["state"]) == ("COMPLETED", "cancelled", "released")
    assert status_of(http, auth, done)["error_type"] == "provider_error"


def test_an_action_reaches_only_the_callers_workspace(http, auth, services, workspace):
    other = services.accounts.create_workspace("other", queue_enabled=True, credits=1000)
    other_auth = {"X-API-Key": services.accounts.mint_key(other)}
    theirs = [failed(http, other_auth, services, {"prompt": f"theirs {i}"}) for i in range(2)]
    mine = failed(http, auth, services)
    assert post(http, auth, {"action": "retry", "dry_run": True}).json["matched"] == 1
    bulk_id = post(http, auth, {"action": "retry"}).json["bulk_id"]
    run(services, bulk_id, workspace)
    assert http.get(f"{BULK}/{bulk_id}", headers=auth).json["done"] == 1
    assert len(http.get("/v2/requests", headers=other_auth).json["requests"]) == 2  # no retry of theirs
    assert {r.get("retry_of") for r in http.get("/v2/requests", headers=auth).json["requests"]} == {None, mine}
    assert theirs
    # another workspace's bulk id is not found, nor is a malformed one
    assert_error(http.get(f"{BULK}/{bulk_id}", headers=other_auth), 404, "bulk_not_found")
    assert_error(http.get(f"{BULK}/not-an-id", headers=auth), 404, "bulk_not_found")
    assert_error(http.get(f"{BULK}/{'0' * 24}", headers=auth), 404, "bulk_not_found")


def test_the_idempotency_key_answers_the_same_action_and_refuses_another_body(http, auth, services, workspace):
    failed(http, auth, services)
    first = post(http, auth, {"action": "retry"}, **{"Idempotency-Key": "k1"})
    again = post(http, auth, {"action": "retry"}, **{"Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 202
    assert again.json["bulk_id"] == first.json["bulk_id"] and again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert_error(post(http, auth, {"action": "cancel"}, **{"Idempotency-Key": "k1"}), 409, "invalid_input")
    other = post(http, auth, {"action": "retry"}, **{"Idempotency-Key": "k2"}).json["bulk_id"]
    assert other != first.json["bulk_id"]


def test_a_refused_retry_is_counted_with_its_reason_and_a_full_backlog_waits(http, auth, services, workspace):
    for i in range(3):
        failed(http, auth, services, {"prompt": f"failed {i}"})
    services.accounts.set_credits(workspace, 60)  # one retry's worth
    bulk_id = post(http, auth, {"action": "retry"}).json["bulk_id"]
    run(services, bulk_id, workspace)
    progress = http.get(f"{BULK}/{bulk_id}", headers=auth).json
    assert (progress["done"], progress["failed"], progress["failures"]) == (1, 2, {"insufficient_credits": 2})
    # a backlog at its cap: the step stops and names when to go on; nothing is counted failed
    services.accounts.set_credits(workspace, 1000)
    services.accounts.set_limits(workspace, max_queued=1)
    waiting = post(http, auth, {"action": "retry", "filter": {"status": "COMPLETED"}}).json["bulk_id"]
    assert run(services, waiting, workspace) > 0
    progress = http.get(f"{BULK}/{waiting}", headers=auth).json
    assert (progress["status"], progress["waiting"], progress["failed"]) == ("IN_PROGRESS", "queue_backlog_full", 0)


def test_an_action_stops_at_max_bulk_requests_and_says_so(http, auth, services, workspace, settings):
    object.__setattr__(settings, "max_bulk_requests", 2)
    for i in range(3):
        submit(http, auth, {"prompt": f"queued {i}"})
    assert post(http, auth, {"action": "cancel", "dry_run": True}).json == {
        "action": "cancel", "dry_run": True, "matched": 2, "limited": True, "cancellable": 2}
    bulk_id = post(http, auth, {"action": "cancel"}).json["bulk_id"]
    run(services, bulk_id, workspace)
    progress = http.get(f"{BULK}/{bulk_id}", headers=auth).json
    assert (progress["status"], progress["matched"], progress["limited"]) == ("COMPLETED", 2, True)


class Celery:
    """What the sweeper publishes a bulk step with."""

    def __init__(self):
        self.sent: list[tuple[str, list, dict]] = []

    def send_task(self, name, args, **options):
        self.sent.append((name, args, options))


def test_the_sweeper_publishes_again_the_step_of_an_action_a_worker_lost(services, workspace, http, auth,
                                                                        dispatcher):
    failed(http, auth, services)
    bulk_id = post(http, auth, {"action": "retry"}).json["bulk_id"]
    dispatcher.celery = Celery()
    sweep(context_of(services))
    assert dispatcher.celery.sent == []  # not overdue yet
    sweep(context_of(services), now=time.time() + 120)
    assert dispatcher.celery.sent == [("workers.tasks.bulk_step", [workspace, bulk_id],
                                       {"queue": "router.maintenance", "countdown": 0.0})]
    sweep(context_of(services), now=time.time() + 121)
    assert len(dispatcher.celery.sent) == 1  # pushed ahead: one sweep publishes it, not every sweep
    run(services, bulk_id, workspace)
    sweep(context_of(services), now=time.time() + 600)
    assert len(dispatcher.celery.sent) == 1  # ended: out of the index


def test_a_workspace_has_at_most_max_bulk_actions_running(http, auth, services, workspace):
    services.bulk.max_running = 2
    submit(http, auth, {"prompt": "queued"})
    first, second = (post(http, auth, {"action": "cancel", "filter": {"status": "IN_QUEUE"}}).json["bulk_id"]
                     for _ in range(2))
    refused = post(http, auth, {"action": "cancel"})
    assert_error(refused, 409, "concurrency_limit_exceeded")
    assert int(refused.headers["Retry-After"]) >= 1
    assert post(http, auth, {"action": "cancel", "dry_run": True}).status_code == 200
    run(services, first, workspace)
    assert post(http, auth, {"action": "cancel"}).status_code == 202  # one ended: room again
    assert second


def test_the_bulk_routes_leave_the_history_list_as_it_was(http, auth, services):
    failed(http, auth, services)
    assert http.get("/v2/requests", headers=auth).status_code == 200
    assert_error(http.get(BULK, headers=auth), 405, "invalid_input")
