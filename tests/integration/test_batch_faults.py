"""Batches under faults (issue 35), slow: the worker SIGKILLed while a batch
drains, and the same batch sent twice at once. Each counts the lines lost
(no request and no error), admitted twice (more requests than lines) and
charged twice (a request with two charges, or more charges than lines).

A stack of our own with a short lease (``harness.SHORT_LEASE``) and a
backlog cap of 50, so a batch drains over many sweeps: its lines wait in it
for room and are admitted as earlier ones finish.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest
import requests

from .harness import (
    FLUX,
    SHORT_LEASE,
    ApiClient,
    RunningStack,
    ledger_by_request,
    make_caller,
    private_stack,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.slow
NDJSON = {"Content-Type": "application/x-ndjson"}


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with private_stack(tmp_path_factory, "batch-faults", {**SHORT_LEASE, "MAX_QUEUED_PER_WORKSPACE": "50"}) as running:
        yield running


def send(caller: ApiClient, count: int, label: str, key: str | None = None) -> requests.Response:
    data = "".join(json.dumps({"model": FLUX, "body": {"prompt": unique_prompt(label)}}) + "\n" for _ in range(count))
    headers = {**NDJSON, **({"Idempotency-Key": key} if key else {})}
    return requests.post(f"{caller.base_url}/v2/batches", data=data.encode(), headers=caller.headers(headers),
                         timeout=60)


def batch(caller: ApiClient, batch_id: str) -> dict[str, Any]:
    return requests.get(f"{caller.base_url}/v2/batches/{batch_id}", headers=caller.headers(), timeout=30).json()


def results(caller: ApiClient, batch_id: str) -> list[dict[str, Any]]:
    answer = requests.get(f"{caller.base_url}/v2/batches/{batch_id}/results", headers=caller.headers(), timeout=60)
    return [json.loads(x) for x in answer.text.splitlines()]


def assert_each_line_once(stack: RunningStack, caller: ApiClient, batch_id: str, lines: int) -> None:
    shown = results(caller, batch_id)
    lost = [s["line"] for s in shown if not s["request_id"] and not s.get("error_type")]
    ids = [s["request_id"] for s in shown if s["request_id"]]
    ledger = ledger_by_request(stack.services, caller.workspace)
    holds = sum(types.count("hold") for types in ledger.values())
    charged_twice = [rid for rid, types in ledger.items() if types.count("charge") > 1]
    charges = sum(types.count("charge") for types in ledger.values())
    assert (len(shown), lost, len(ids) - len(set(ids)), holds - lines, charged_twice, charges) == \
        (lines, [], 0, 0, [], lines), "lines lost, admitted twice (ids, holds) or charged twice"


def test_a_worker_killed_while_a_batch_drains_loses_and_doubles_nothing(fault_stack: RunningStack) -> None:
    caller = make_caller(fault_stack, "batch-sigkill")
    lines = 400
    batch_id = send(caller, lines, "sigkill").json()["batch_id"]
    store = fault_stack.services.batches

    def mid_drain() -> bool:
        cursor = int((store.get(caller.workspace, batch_id) or {}).get("cursor", 0))
        return 50 < cursor < lines - 100
    wait_for(mid_drain, timeout_s=60, interval_s=0.05, what="the batch partly drained")
    proc = fault_stack.stack.procs["worker"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    fault_stack.start_worker("worker")
    fault_stack.wait_ready(["worker"], serving=False)
    wait_for(lambda: batch(caller, batch_id)["status"] == "COMPLETED", timeout_s=240, interval_s=1,
             what="the batch COMPLETED after the kill")
    assert batch(caller, batch_id)["counts"]["by_error_type"] == {}
    assert_each_line_once(fault_stack, caller, batch_id, lines)


def test_the_same_batch_sent_twice_at_once_is_one_batch(fault_stack: RunningStack) -> None:
    caller = make_caller(fault_stack, "batch-twice")
    data = "".join(json.dumps({"model": FLUX, "body": {"prompt": unique_prompt("twice")}}) + "\n" for _ in range(150))

    def post(_: int) -> requests.Response:
        return requests.post(f"{caller.base_url}/v2/batches", data=data.encode(),
                             headers=caller.headers({**NDJSON, "Idempotency-Key": "twice-1"}), timeout=60)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(post, range(2)))
    assert [a.status_code for a in answers] == [201, 201], [a.text for a in answers]
    assert answers[0].json()["batch_id"] == answers[1].json()["batch_id"]
    batch_id = answers[0].json()["batch_id"]
    wait_for(lambda: batch(caller, batch_id)["status"] == "COMPLETED", timeout_s=180, interval_s=1,
             what="the batch COMPLETED")
    listed = requests.get(f"{caller.base_url}/v2/batches", headers=caller.headers(), timeout=10).json()["batches"]
    assert [b["batch_id"] for b in listed] == [batch_id]
    assert_each_line_once(fault_stack, caller, batch_id, 150)
