"""Retry and the caller's deadlines through real processes: gunicorn, a
Celery worker, beat's sweeper (every second) and the stub provider."""

from __future__ import annotations

from typing import Any

from .harness import FLUX, ApiClient, RunningStack, Stub, ledger_by_request, unique_prompt

#: Seconds the sweeper (every SWEEP_INTERVAL_S = 1 s) and a BFL poll (0.5-2 s) may take to act, generously.
ACT_WITHIN_S = 20.0


def _retry(caller: ApiClient, request_id: str, headers: dict[str, str] | None = None) -> Any:
    return caller.session.post(caller.url(FLUX, request_id, "/retry"), headers=caller.headers(headers), timeout=10)


def test_a_request_that_failed_with_provider_error_is_retried_as_a_new_request(
        caller: ApiClient, stack: RunningStack, stub: Stub) -> None:
    # the stub fails the first 4 calls of this body (flux-2-pro makes 4 attempts), then succeeds
    body = {"prompt": unique_prompt("retry-me", "[stub:fail_times=4]")}
    original = caller.submit_ok(FLUX, body)
    failed = caller.wait_status(FLUX, original, timeout_s=30)
    assert failed["error_type"] == "provider_error"

    response = _retry(caller, original, {"Idempotency-Key": "retry-once"})
    assert response.status_code == 201, response.text
    handle = response.json()
    assert set(handle) == {"request_id", "status", "queue_position", "status_url", "response_url", "cancel_url"}
    retried = handle["request_id"]
    assert retried != original
    again = _retry(caller, original, {"Idempotency-Key": "retry-once"})
    assert (again.status_code, again.json()["error_type"]) == (409, "invalid_input"), again.text
    assert retried in again.json()["detail"]

    done = caller.wait_status(FLUX, retried)
    assert done["retry_of"] == original
    assert "error_type" not in done
    assert caller.result(FLUX, retried).status_code == 200
    assert stub.submits("bfl_submit", body) == 5  # the same body, sent again by the retry
    ledger = ledger_by_request(stack.services, caller.workspace)
    assert ledger[original] == ["hold", "release"]
    assert ledger[retried] == ["hold", "charge"]


def test_a_running_or_succeeded_request_is_not_retried(caller: ApiClient) -> None:
    slow = caller.submit_ok(FLUX, {"prompt": unique_prompt("running", "[stub:latency=30]")})
    caller.wait_status(FLUX, slow, "IN_PROGRESS")
    quick = caller.submit_ok(FLUX, {"prompt": unique_prompt("quick")})
    caller.wait_status(FLUX, quick)
    for request_id in (slow, quick):
        response = _retry(caller, request_id)
        assert response.status_code == 409, response.text
        assert response.json()["error_type"] == response.headers["X-Comfy-Error-Type"] == "invalid_input"
    caller.cancel(FLUX, slow)
    caller.wait_status(FLUX, slow)


def test_a_start_deadline_that_passes_in_the_queue_ends_queue_timeout_uncharged(
        caller: ApiClient, stack: RunningStack, stub: Stub) -> None:
    # the workspace's own cap on requests in flight is 1, and a slow run holds it
    stack.services.accounts.set_limits(caller.workspace, max_in_flight=1)
    blocker = caller.submit_ok(FLUX, {"prompt": unique_prompt("holds-the-slot", "[stub:latency=60]")})
    caller.wait_status(FLUX, blocker, "IN_PROGRESS")
    body = {"prompt": unique_prompt("too-late")}
    waiting = caller.submit(FLUX, body, headers={"X-Comfy-Start-Deadline": "2"})
    assert waiting.status_code == 201, waiting.text
    request_id = waiting.json()["request_id"]
    assert "start_deadline_at" in caller.status_body(FLUX, request_id)

    ended = caller.wait_status(FLUX, request_id, timeout_s=ACT_WITHIN_S)
    assert ended["error_type"] == "queue_timeout"
    assert "X-Comfy-Start-Deadline" in ended["detail"]
    assert "started_at" not in ended
    assert caller.result(FLUX, request_id).status_code == 504
    assert stub.submits("bfl_submit", body) == 0  # never reached the provider
    assert ledger_by_request(stack.services, caller.workspace)[request_id] == ["hold", "release"]
    caller.cancel(FLUX, blocker)
    caller.wait_status(FLUX, blocker)


def test_a_deadline_cancels_a_slow_run_as_the_cancel_route_would(caller: ApiClient, stack: RunningStack) -> None:
    response = caller.submit(FLUX, {"prompt": unique_prompt("too-slow", "[stub:latency=60]")},
                             headers={"X-Comfy-Deadline": "3"})
    assert response.status_code == 201, response.text
    request_id = response.json()["request_id"]
    caller.wait_status(FLUX, request_id, "IN_PROGRESS")
    ended = caller.wait_status(FLUX, request_id, timeout_s=ACT_WITHIN_S)
    assert ended["error_type"] == "cancelled"
    assert "X-Comfy-Deadline" in ended["detail"]
    assert "deadline_at" in ended
    assert caller.result(FLUX, request_id).status_code == 409
    assert ledger_by_request(stack.services, caller.workspace)[request_id] == ["hold", "release"]


def test_a_2mb_body_is_kept_in_the_object_store_and_retried_byte_for_byte(
        caller: ApiClient, stack: RunningStack, stub: Stub) -> None:
    """Over the old 1 MiB limit: written to the object store by the gevent
    front door before its 201, sent to the provider as submitted, by the
    request and by its retry, which shares it."""
    from router_queue.blobs.pointers import BodyPointer
    from router_queue.store import keys

    body = {"prompt": unique_prompt("a big retry", "[stub:fail_times=4]"), "input_image": "B" * 2_000_000}
    original = caller.submit_ok(FLUX, body)
    pointer = BodyPointer.parse(stack.services.redis.get(keys.body(original)))
    assert pointer is not None and pointer.size > 2_000_000  # Redis holds the pointer alone
    assert caller.wait_status(FLUX, original, timeout_s=30)["error_type"] == "provider_error"
    retried = _retry(caller, original)
    assert retried.status_code == 201, retried.text
    assert "error_type" not in caller.wait_status(FLUX, retried.json()["request_id"])
    assert stub.submits("bfl_submit", body) == 5  # the same bytes each time
    workspace = stack.services.accounts.get(caller.workspace)
    assert workspace.queued_bytes == 0
    assert workspace.stored_bytes >= pointer.size  # the kept body once (and the retry's result)
