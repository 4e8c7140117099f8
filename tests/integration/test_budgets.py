"""Budgets against real processes (issue 36 item 3): a budget crossed by
concurrent submits. A stack of our own on a private redis-server (the stub,
a worker, the webhooks worker, beat sweeping every second, gunicorn) with
loopback http allowed, and the webhook receiver of ``webhook_receiver.py``
as the workspace's default webhook, verifying every signature.

20 threads submit at once against a daily budget that holds 10 of them: 10
are admitted, 10 answer ``402 budget_exceeded``, the credits held and
charged never pass the line, and the receiver gets exactly one
``budget.threshold_crossed`` per threshold (50, 80, 100), each under its
fixed webhook-id. ``GET /v2/usage`` then shows what was charged, by key.

A receiver that never answers, the default webhook of one workspace, holds
no sweep (the sweeper publishes alerts; the webhooks worker sends them), and
another workspace's alert still reaches its receiver once, verified, though
its crossing is published ten times at once to two webhooks workers.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Iterator

import pytest

from router_queue.broker.celery_app import make_celery
from router_queue.services import Services
from workers.context import WorkerContext
from workers.sweeper import sweep

from .harness import FLUX, START_CREDITS, RunningStack, private_stack, unique_prompt, wait_for
from .webhook_support import Receiver, cli_ok, workspace_with_secret

THREADS = 20
FITS = 10
SETTINGS = {"WEBHOOK_ALLOW_LOOPBACK_HTTP": "1", "WEBHOOK_TIMEOUT_SECONDS": "2"}
SECOND_WEBHOOKS = "webhooks-2"
#: Seconds a sweep may take while an alert's receiver never answers (its webhook timeout is 2 s).
PROMPT_SWEEP_S = 1.0


@pytest.fixture(scope="module")
def budget_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with private_stack(tmp_path_factory, "budget", SETTINGS, webhooks=True) as running:
        running.stack.start_webhooks(SECOND_WEBHOOKS, concurrency=8)  # two workers to race for one alert
        running.wait_ready([SECOND_WEBHOOKS], serving=False)
        yield running


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    made = Receiver(tmp_path_factory.mktemp("budget-receiver"))
    try:
        yield made
    finally:
        made.stop()


def test_a_budget_crossed_by_concurrent_submits_is_never_overshot_and_alerts_once_per_threshold(
        budget_stack: RunningStack, receiver: Receiver) -> None:
    caller, secret = workspace_with_secret(budget_stack, "budget-concurrent")
    price = budget_stack.services.catalog.by_id(FLUX).price_credits
    name = f"budget-{caller.workspace}"
    with caller:
        url = receiver.configure(name, secrets={"current": secret})
        cli_ok(budget_stack.env, "workspace", "set-webhook", caller.workspace, url)
        cli_ok(budget_stack.env, "workspace", "set-budget", caller.workspace, "--daily", str(FITS * price),
               "--alert-at", "50,80,100")

        def submit(i: int):
            return caller.submit(FLUX, {"prompt": unique_prompt(f"budget {i}")})

        with ThreadPoolExecutor(THREADS) as pool:
            answers = list(pool.map(submit, range(THREADS)))
        codes = sorted(a.status_code for a in answers)
        assert codes == [201] * FITS + [402] * (THREADS - FITS), [a.text for a in answers]
        refused = [a for a in answers if a.status_code == 402]
        assert {a.json()["error_type"] for a in refused} == {"budget_exceeded"}
        ws = budget_stack.services.accounts.get(caller.workspace)
        assert ws is not None and ws.held + (START_CREDITS - ws.credits) == FITS * price  # held plus charged
        shown = budget_stack.services.accounts.budgets.show(caller.workspace)
        assert shown[0].spent["day"] == FITS * price  # held or charged, never over the line

        for a in answers:
            if a.status_code == 201:
                caller.wait_status(FLUX, a.json()["request_id"])

        def alerts() -> list[dict] | None:
            seen = [a for a in receiver.attempts(name) if a["webhook_id"].startswith("budget_")]
            return seen if len(seen) >= 3 else None
        got = wait_for(alerts, timeout_s=20, interval_s=0.2, what="three budget alerts")
        time.sleep(3)  # three more sweeps: nothing is sent twice
        got = [a for a in receiver.attempts(name) if a["webhook_id"].startswith("budget_")]
        day = datetime.now(timezone.utc).date().isoformat()
        assert sorted(a["webhook_id"] for a in got) == [
            f"budget_{caller.workspace}_day_{day}_{t}" for t in (100, 50, 80)]
        assert all(a["verified"] for a in got), [a["errors"] for a in got]
        bodies = sorted((json.loads(a["body"]) for a in got), key=lambda b: b["threshold"])
        assert [(b["type"], b["period"], b["budget"], b["threshold"]) for b in bodies] == [
            ("budget.threshold_crossed", "day", FITS * price, t) for t in (50, 80, 100)]
        assert [b["spent"] for b in bodies[:2]] == [FITS * price // 2, FITS * price * 8 // 10]

        usage = caller.session.get(f"{caller.base_url}/v2/usage?group_by=key", headers=caller.headers(), timeout=10)
        assert usage.status_code == 200, usage.text
        charged = sum(g["credits"] for g in usage.json()["groups"])
        assert charged <= FITS * price and usage.json()["groups"][0]["key_id"].startswith("key_")


def _crossed(stack: RunningStack, caller, url: str) -> str:
    """``caller``'s workspace with ``url`` its default webhook and a daily budget of one request,
    alerting at 100 %; one request submitted: the crossing its admission owes, by ident ("" once told)."""
    price = stack.services.catalog.by_id(FLUX).price_credits
    cli_ok(stack.env, "workspace", "set-webhook", caller.workspace, url)
    cli_ok(stack.env, "workspace", "set-budget", caller.workspace, "--daily", str(price), "--alert-at", "100")
    caller.submit_ok(FLUX, {"prompt": unique_prompt("budget alert")})
    owed = stack.services.accounts.budgets.owed([caller.workspace])
    return owed[0].ident if owed else ""


def test_a_silent_receiver_holds_no_sweep_and_a_raced_alert_is_delivered_once(
        budget_stack: RunningStack, receiver: Receiver) -> None:
    silent, silent_secret = workspace_with_secret(budget_stack, "budget-silent")
    working, working_secret = workspace_with_secret(budget_stack, "budget-working")
    silent_name, working_name = f"silent-{silent.workspace}", f"working-{working.workspace}"
    celery = make_celery(budget_stack.settings)
    services = Services.build(budget_stack.settings, celery=celery)
    try:
        with silent, working:
            _crossed(budget_stack, silent,
                     receiver.configure(silent_name, secrets={"current": silent_secret}, plan=["hang:30"]))
            wait_for(lambda: [a for a in receiver.attempts(silent_name) if a["webhook_id"].startswith("budget_")]
                     or None, timeout_s=20, interval_s=0.2, what="the silent receiver's first alert, under way")
            context = WorkerContext.build(celery, services)
            for _ in range(3):  # while an attempt at the silent receiver hangs, and once it failed
                started = time.monotonic()
                sweep(context)
                assert time.monotonic() - started < PROMPT_SWEEP_S
            assert budget_stack.services.accounts.budgets.owed([silent.workspace]) != []  # still owed: retried later

            url = receiver.configure(working_name, secrets={"current": working_secret}, plan=["204"])
            ident = _crossed(budget_stack, working, url)
            if ident:  # not yet sent by the stack's own sweep: race ten messages for it over two workers
                for _ in range(10):
                    services.dispatcher.publish_budget_alert(working.workspace, ident)
            wait_for(lambda: [a for a in receiver.attempts(working_name) if a["webhook_id"].startswith("budget_")]
                     or None, timeout_s=20, interval_s=0.2, what="the working receiver's alert")
            time.sleep(3)  # three more sweeps and every raced message consumed: nothing is sent twice
            got = [a for a in receiver.attempts(working_name) if a["webhook_id"].startswith("budget_")]
            day = datetime.now(timezone.utc).date().isoformat()
            assert [a["webhook_id"] for a in got] == [f"budget_{working.workspace}_day_{day}_100"]
            assert got[0]["verified"], got[0]["errors"]
            assert budget_stack.services.accounts.budgets.owed([working.workspace]) == []
            logged = [a for a in budget_stack.services.webhooks.attempts(working.workspace)
                      if a.request_id.startswith("budget_")]  # beside its request's own event
            assert [(a.request_id, a.outcome) for a in logged] == [(got[0]["webhook_id"], "delivered")]
    finally:
        services.redis.close()
        celery.close()
