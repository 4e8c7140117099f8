"""Bulk actions through real processes (gunicorn, a Celery worker running the
steps, beat's sweeper, the stub provider): a dry run, a bulk retry of failed
requests that then complete, charged once each, a bulk cancel of queued ones,
and an action whose step was lost resumed by the sweeper."""

from __future__ import annotations

import time
from typing import Any

from router_queue.store.bulk import BulkFilter

from .harness import FLUX, ApiClient, RunningStack, Stub, ledger_by_request, unique_prompt, wait_for


def _bulk(caller: ApiClient, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return caller.session.post(f"{caller.base_url}/v2/requests/bulk", json=body, headers=caller.headers(headers),
                               timeout=30)


def _progress(caller: ApiClient, bulk_id: str) -> dict[str, Any]:
    response = caller.session.get(f"{caller.base_url}/v2/requests/bulk/{bulk_id}", headers=caller.headers(),
                                  timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _completed(caller: ApiClient, bulk_id: str) -> dict[str, Any]:
    return wait_for(lambda: (body := _progress(caller, bulk_id))["status"] == "COMPLETED" and body,
                    timeout_s=60, what=f"bulk action {bulk_id} completed")


def test_a_bulk_retry_completes_each_failed_request_once_charged_once(
        caller: ApiClient, other_caller: ApiClient, stack: RunningStack, stub: Stub) -> None:
    # the stub fails the first 4 calls of each body (flux-2-pro makes 4 attempts), then succeeds
    bodies = [{"prompt": unique_prompt(f"bulk-retry-{i}", "[stub:fail_times=4]")} for i in range(3)]
    originals = {caller.submit_ok(FLUX, body) for body in bodies}
    theirs = other_caller.submit_ok(FLUX, {"prompt": unique_prompt("theirs", "[stub:fail_times=4]")})
    for request_id in originals:
        assert caller.wait_status(FLUX, request_id, timeout_s=30)["error_type"] == "provider_error"
    assert other_caller.wait_status(FLUX, theirs, timeout_s=30)["error_type"] == "provider_error"

    wanted = {"action": "retry", "filter": {"model": FLUX, "error_type": "provider_error"}}
    dry = _bulk(caller, {**wanted, "dry_run": True})
    assert dry.status_code == 200, dry.text
    assert dry.json() == {"action": "retry", "dry_run": True, "matched": 3, "limited": False, "retryable": 3,
                          "credits": 3 * 60}

    started = _bulk(caller, wanted, {"Idempotency-Key": "bulk-retry-once"})
    assert started.status_code == 202, started.text
    bulk_id = started.json()["bulk_id"]
    again = _bulk(caller, wanted, {"Idempotency-Key": "bulk-retry-once"})
    assert (again.status_code, again.json()["bulk_id"]) == (202, bulk_id)
    done = _completed(caller, bulk_id)
    assert (done["matched"], done["done"], done["failed"], done["outcomes"]) == (3, 3, 0, {"retried": 3})

    listed = caller.session.get(f"{caller.base_url}/v2/requests?limit=100", headers=caller.headers(), timeout=10)
    retries = [entry for entry in listed.json()["requests"] if entry.get("bulk_id") == bulk_id]
    assert {entry["retry_of"] for entry in retries} == originals and len(retries) == 3
    for entry in retries:
        finished = caller.wait_status(FLUX, entry["request_id"], timeout_s=30)
        assert "error_type" not in finished and finished["bulk_id"] == bulk_id
        assert caller.result(FLUX, entry["request_id"]).status_code == 200
    ledger = ledger_by_request(stack.services, caller.workspace)
    assert all(ledger[entry["request_id"]] == ["hold", "charge"] for entry in retries)
    assert all(ledger[request_id] == ["hold", "release"] for request_id in originals)
    for body in bodies:
        assert stub.submits("bfl_submit", body) == 5  # four failed calls, then the one retry
    # the workers counted the failures for the operators (the stack is shared: at least these)
    recent = {(row.model, row.error_type): row.last_hour for row in stack.services.failures.recent(["bfl"])}
    assert recent[(FLUX, "provider_error")] >= 4
    # the other workspace's failure was not touched
    assert other_caller.status_body(FLUX, theirs)["error_type"] == "provider_error"
    assert len(other_caller.session.get(f"{other_caller.base_url}/v2/requests", headers=other_caller.headers(),
                                        timeout=10).json()["requests"]) == 1
    gone = other_caller.session.get(f"{other_caller.base_url}/v2/requests/bulk/{bulk_id}",
                                    headers=other_caller.headers(), timeout=10)
    assert (gone.status_code, gone.json()["error_type"]) == (404, "bulk_not_found")


def test_a_bulk_cancel_cancels_the_queued_requests(caller: ApiClient, stack: RunningStack, stub: Stub) -> None:
    stack.services.accounts.set_limits(caller.workspace, max_in_flight=1)
    blocker = caller.submit_ok(FLUX, {"prompt": unique_prompt("holds-the-slot", "[stub:latency=60]")})
    caller.wait_status(FLUX, blocker, "IN_PROGRESS")
    bodies = [{"prompt": unique_prompt(f"bulk-cancel-{i}")} for i in range(3)]
    queued = [caller.submit_ok(FLUX, body) for body in bodies]
    assert all(caller.status_body(FLUX, request_id)["status"] == "IN_QUEUE" for request_id in queued)
    started = _bulk(caller, {"action": "cancel", "filter": {"status": "IN_QUEUE"}})
    assert started.status_code == 202, started.text
    done = _completed(caller, started.json()["bulk_id"])
    assert (done["matched"], done["done"], done["outcomes"]) == (3, 3, {"cancelled": 3})
    ledger = ledger_by_request(stack.services, caller.workspace)
    for request_id, body in zip(queued, bodies):
        ended = caller.status_body(FLUX, request_id)
        assert (ended["status"], ended["error_type"], ended["cost"]["state"]) == ("COMPLETED", "cancelled", "released")
        assert ledger[request_id] == ["hold", "release"]
        assert stub.submits("bfl_submit", body) == 0
    assert caller.status_body(FLUX, blocker)["status"] == "IN_PROGRESS"  # not matched: it runs
    caller.cancel(FLUX, blocker)
    caller.wait_status(FLUX, blocker)


def test_an_action_whose_step_was_lost_is_resumed_by_the_sweeper(caller: ApiClient, stack: RunningStack) -> None:
    """As if the worker holding its step died and its message went with it:
    written, never published; beat's sweeper (every second here) publishes it
    once it is overdue, and it runs to its end, each request retried once."""
    originals = {caller.submit_ok(FLUX, {"prompt": unique_prompt(f"lost-step-{i}", "[stub:fail_times=4]")})
                 for i in range(2)}
    for request_id in originals:
        assert caller.wait_status(FLUX, request_id, timeout_s=30)["error_type"] == "provider_error"
    bulk = stack.services.bulk
    assert bulk is not None
    outcome, bulk_id = bulk.create(caller.workspace, "ab" * 12, action="retry", filter=BulkFilter(),
                                   base_url=caller.base_url)
    assert outcome == "CREATED"
    bulk.due(caller.workspace, bulk_id, time.time() - 120)  # its step overdue
    done = _completed(caller, bulk_id)
    assert (done["matched"], done["done"], done["outcomes"]) == (2, 2, {"retried": 2})
    listed = caller.session.get(f"{caller.base_url}/v2/requests?limit=100", headers=caller.headers(), timeout=10)
    assert sorted(e["retry_of"] for e in listed.json()["requests"] if e.get("bulk_id") == bulk_id) == \
        sorted(originals)
