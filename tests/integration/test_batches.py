"""Batches against real processes (issue 35): a batch submitted, drained by
the worker in the background, run by the stub, read back line by line,
COMPLETED, and announced by one signed ``batch.completed`` webhook; a resent
batch that admits nothing twice; a cancelled one.

A stack of our own (``harness.private_stack``: its worker drains batches on
the maintenance queue, beat sweeps every second) with loopback http webhooks
allowed, and the tests' webhook receiver, which verifies each attempt with
the ``standardwebhooks`` package.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
import requests

from .harness import FLUX, ApiClient, RunningStack, make_caller, private_stack, unique_prompt, wait_for
from .webhook_support import Receiver, workspace_with_secret

NDJSON = {"Content-Type": "application/x-ndjson"}


@pytest.fixture(scope="module")
def batch_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with private_stack(tmp_path_factory, "batches", {"WEBHOOK_ALLOW_LOOPBACK_HTTP": "1"}, webhooks=True) as running:
        yield running


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    made = Receiver(tmp_path_factory.mktemp("batch-receiver"))
    try:
        yield made
    finally:
        made.stop()


def line(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": FLUX, "body": {"prompt": prompt}, **extra}


def send(caller: ApiClient, lines: list[Any], headers: dict[str, str] | None = None) -> requests.Response:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    return caller.session.post(f"{caller.base_url}/v2/batches", data=data.encode(),
                               headers=caller.headers({**NDJSON, **(headers or {})}), timeout=30)


def batch_status(caller: ApiClient, batch_id: str) -> requests.Response:
    return caller.session.get(f"{caller.base_url}/v2/batches/{batch_id}", headers=caller.headers(), timeout=10)


def results(caller: ApiClient, batch_id: str) -> list[dict[str, Any]]:
    response = caller.session.get(f"{caller.base_url}/v2/batches/{batch_id}/results", headers=caller.headers(),
                                  timeout=30)
    assert response.status_code == 200, response.text
    return [json.loads(x) for x in response.text.splitlines()]


def completed(caller: ApiClient, batch_id: str, timeout_s: float = 60) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        body = batch_status(caller, batch_id).json()
        return body if body["status"] == "COMPLETED" else None
    return wait_for(done, timeout_s=timeout_s, interval_s=0.3, what=f"batch {batch_id} COMPLETED")


def test_a_batch_drains_runs_completes_and_is_announced_once(batch_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(batch_stack, "batch-hook")
    hook = receiver.configure(f"batch-{caller.workspace}", secrets={"current": secret})
    lines = [line(unique_prompt("batch-a"), metadata={"sku": "A-1"}), {"model": "bfl/nope", "body": {}},
             line(unique_prompt("batch-b"))]
    submitted = send(caller, lines, {"X-Comfy-Webhook-Url": hook})
    assert submitted.status_code == 201, submitted.text
    batch_id = submitted.json()["batch_id"]
    final = completed(caller, batch_id)
    assert final["counts"]["COMPLETED"] == 3 and final["counts"]["by_error_type"] == {"model_not_found": 1}
    assert final["credits"]["charged"] > 0 and final["credits"]["held"] == 0
    assert batch_status(caller, batch_id).headers["Retry-After"] == "0"
    shown = results(caller, batch_id)
    assert [s["line"] for s in shown] == [1, 2, 3]
    assert shown[1]["request_id"] is None and shown[1]["error_type"] == "model_not_found"
    for s in (shown[0], shown[2]):
        assert s["status"] == "COMPLETED" and "error_type" not in s
        result = caller.session.get(s["response_url"], headers=caller.headers(), timeout=10)
        assert result.status_code == 200
    status = caller.status_body(FLUX, shown[0]["request_id"])
    assert (status["batch_id"], status["line"], status["metadata"]) == (batch_id, 1, {"sku": "A-1"})
    (attempt,) = receiver.wait_attempts(f"batch-{caller.workspace}", 1, answered=True)
    assert attempt["webhook_id"] == f"batch_{batch_id}" and attempt["verified"], attempt["errors"]
    event = json.loads(attempt["body"])
    assert event["type"] == "batch.completed" and event["batch_id"] == batch_id
    assert event["results_url"].endswith(f"/v2/batches/{batch_id}/results")
    assert event["counts"]["COMPLETED"] == 3
    wait_for(lambda: batch_status(caller, batch_id).json() and True, timeout_s=3)  # a few sweeps later ...
    assert len(receiver.attempts(f"batch-{caller.workspace}")) == 1  # ... still one


def test_a_resent_batch_admits_nothing_twice(batch_stack: RunningStack) -> None:
    caller = make_caller(batch_stack, "batch-resend")
    lines = [line(unique_prompt("resend")) for _ in range(5)]
    first = send(caller, lines, {"Idempotency-Key": "nightly-1"})
    again = send(caller, lines, {"Idempotency-Key": "nightly-1"})
    assert first.status_code == again.status_code == 201
    assert again.json()["batch_id"] == first.json()["batch_id"]
    final = completed(caller, first.json()["batch_id"])
    listed = caller.session.get(f"{caller.base_url}/v2/requests?limit=100", headers=caller.headers(), timeout=10)
    assert len(listed.json()["requests"]) == 5
    price = caller.session.get(f"{caller.base_url}/v2/models/{FLUX}/cost", headers=caller.headers(),
                               timeout=10).json()["credits"]
    assert final["credits"]["charged"] == 5 * price  # charged once per line


def test_cancel_ends_the_lines_not_finished(batch_stack: RunningStack) -> None:
    caller = make_caller(batch_stack, "batch-cancel")
    lines = [line(unique_prompt("cancel", "[stub:latency=120]")) for _ in range(3)]
    batch_id = send(caller, lines).json()["batch_id"]
    wait_for(lambda: all(s["request_id"] for s in results(caller, batch_id)), timeout_s=20, what="drained")
    cancelled = caller.session.put(f"{caller.base_url}/v2/batches/{batch_id}/cancel", headers=caller.headers(),
                                   timeout=30)
    assert cancelled.status_code == 202, cancelled.text
    final = completed(caller, batch_id, timeout_s=60)
    assert final["counts"]["by_error_type"] == {"cancelled": 3}
    assert final["credits"]["charged"] == 0
