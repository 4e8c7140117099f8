"""Batches under faults (issue 35), slow: the worker SIGKILLed while a batch
drains (and the batch then cancelled), Redis stalled while one is admitted,
and the same batch sent twice at once. Each counts the lines lost (no
request and no error), admitted twice (more requests than lines) and charged
twice (a request with two charges, or more charges than lines).

A stack of our own with a short lease (``harness.SHORT_LEASE``) and a
backlog cap of 50, so a batch drains over many sweeps: its lines wait in it
for room and are admitted as earlier ones finish.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest
import requests

from router_queue.dev.stack import free_port
from tests.redis_servers import PrivateRedis

from .harness import (
    FLUX,
    SHORT_LEASE,
    ApiClient,
    RunningStack,
    ledger_by_request,
    make_caller,
    stack_env,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.slow
NDJSON = {"Content-Type": "application/x-ndjson"}


#: Seconds Redis is SIGSTOPped while a batch drains (issue 32's stalls last 8 s).
STALL_S = 8.0


@pytest.fixture(scope="module")
def fault_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path_factory.mktemp("batch-faults-redis"), persist=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fault_stack(fault_redis: PrivateRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    env = stack_env(fault_redis.url, stub_port=free_port(), **SHORT_LEASE, MAX_QUEUED_PER_WORKSPACE="50")
    with RunningStack.start(env, tmp_path_factory.mktemp("batch-faults-logs"), label="batch-faults stack") as running:
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


def wait_mid_drain(stack: RunningStack, caller: ApiClient, batch_id: str, lines: int) -> None:
    store = stack.services.batches

    def mid_drain() -> bool:
        cursor = int((store.get(caller.workspace, batch_id) or {}).get("cursor", 0))
        return 50 < cursor < lines - 100
    wait_for(mid_drain, timeout_s=60, interval_s=0.05, what="the batch partly drained")


def kill_worker(stack: RunningStack) -> None:
    proc = stack.stack.procs["worker"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)


def restart_worker(stack: RunningStack) -> None:
    stack.start_worker("worker")
    stack.wait_ready(["worker"], serving=False)


def test_a_worker_killed_while_a_batch_drains_loses_and_doubles_nothing(fault_stack: RunningStack) -> None:
    caller = make_caller(fault_stack, "batch-sigkill")
    lines = 400
    batch_id = send(caller, lines, "sigkill").json()["batch_id"]
    wait_mid_drain(fault_stack, caller, batch_id, lines)
    kill_worker(fault_stack)
    restart_worker(fault_stack)
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


def test_a_batch_cancelled_after_its_drain_died_admits_nothing_after_the_cancel(fault_stack: RunningStack) -> None:
    """The race: the drain SIGKILLed mid-drain, then ``PUT …/cancel`` while no
    worker runs; the restarted worker and the sweeper admit no line after the
    cancel was answered, and what the dead drain admitted unrecorded is
    cancelled with the batch, never charged."""
    caller = make_caller(fault_stack, "batch-kill-cancel")
    lines = 400
    batch_id = send(caller, lines, "kill-cancel").json()["batch_id"]
    wait_mid_drain(fault_stack, caller, batch_id, lines)
    kill_worker(fault_stack)
    answer = requests.put(f"{caller.base_url}/v2/batches/{batch_id}/cancel", headers=caller.headers(), timeout=60)
    answered_at = time.time()
    assert answer.status_code == 202, answer.text
    restart_worker(fault_stack)
    wait_for(lambda: batch(caller, batch_id)["status"] == "COMPLETED", timeout_s=240, interval_s=1,
             what="the cancelled batch COMPLETED")
    shown = results(caller, batch_id)
    named = {s["request_id"]: s for s in shown if s["request_id"]}
    ledger = ledger_by_request(fault_stack.services, caller.workspace)  # every request admitted: each held once
    created = {i: fault_stack.services.store.status_view(i, "bfl").record.created_at for i in ledger}
    late = sorted(i for i, at in created.items() if at > answered_at)
    lost = [s["line"] for s in shown if not s["request_id"] and not s.get("error_type")]
    charged = {i for i, types in ledger.items() if "charge" in types}
    charged_twice = [i for i, types in ledger.items() if types.count("charge") > 1]
    unnamed_charged = sorted(charged - set(named))
    wrongly_charged = sorted(i for i in charged & set(named) if named[i].get("error_type"))
    assert (len(shown), late, lost, charged_twice, unnamed_charged, wrongly_charged) == (lines, [], [], [], [], []), \
        "admitted after the cancel, lost, charged twice, or charged and shown cancelled"
    assert len(charged) < lines and "cancelled" in batch(caller, batch_id)["counts"]["by_error_type"]


def test_redis_stalled_while_a_batch_is_admitted_loses_doubles_and_refuses_nothing(
        fault_stack: RunningStack, fault_redis: PrivateRedis) -> None:
    """Redis SIGSTOPped for STALL_S while a 400-line batch drains, and a second
    batch sent into the stall: the first loses, doubles and charges twice no
    line and none of its lines ends 503 (service_unavailable); the second is
    refused whole (503: nothing written) and, sent again with its key, is one batch."""
    caller, late = make_caller(fault_stack, "batch-stall"), make_caller(fault_stack, "batch-stall-late")
    lines = 400
    batch_id = send(caller, lines, "stall", key="stall-1").json()["batch_id"]
    wait_mid_drain(fault_stack, caller, batch_id, lines)
    began = time.monotonic()
    fault_redis.pause()
    try:
        during = send(late, 100, "stalled", key="stall-late-1")
        answered_s = time.monotonic() - began
        time.sleep(max(0.0, STALL_S - answered_s))
    finally:
        fault_redis.resume()
    assert during.status_code == 503 and during.json()["error_type"] == "service_unavailable", during.text
    assert answered_s < STALL_S, f"a batch sent into the stall waited {answered_s:.1f} s for its answer"
    wait_for(lambda: requests.get(f"{caller.base_url}/readyz", timeout=5).status_code == 200, timeout_s=30,
             interval_s=0.2, what="/readyz 200 after the stall")
    again = send(late, 100, "stalled", key="stall-late-1")
    assert again.status_code == 201, again.text
    late_id = again.json()["batch_id"]
    for who, which in ((caller, batch_id), (late, late_id)):
        wait_for(lambda: batch(who, which)["status"] == "COMPLETED", timeout_s=240, interval_s=1,
                 what=f"batch {which} COMPLETED after the stall")
        assert batch(who, which)["counts"]["by_error_type"] == {}  # no accepted line ended 503, or at all
    listed = requests.get(f"{late.base_url}/v2/batches", headers=late.headers(), timeout=10).json()["batches"]
    assert [b["batch_id"] for b in listed] == [late_id]  # the refused call wrote nothing
    assert_each_line_once(fault_stack, caller, batch_id, lines)
    assert_each_line_once(fault_stack, late, late_id, 100)
