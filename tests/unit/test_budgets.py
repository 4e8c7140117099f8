"""Budgets (issue 36 item 3): a workspace's and a key's credit budgets per
UTC day, ISO week and calendar month, checked inside admission (402
budget_exceeded, nothing queued or held), their thresholds owed once per
period, what a hold did not charge given back; the CLI; GET /v2/usage."""

from __future__ import annotations

import dataclasses
import datetime
import json
import time

import pytest

from router_queue.batches import drain
from router_queue.cli import main
from router_queue.requests.outcomes import Admit
from router_queue.requests.record import Submission
from router_queue.requests.values import Admission
from router_queue.services import Services
from router_queue.store import budgets as budget_store
from router_queue.store.budgets import period_start
from router_queue.web import usage as usage_route
from router_queue.webhooks import budget_alerts
from tests.unit.conftest import RecordingDispatcher
from tests.unit.support import ServicesCliRunner

MODEL = "bfl/flux-2-pro"
BODY = {"prompt": "a teapot"}
#: 2030-03-17 is a Sunday; 2030-03-18 the Monday after.
SUNDAY = datetime.datetime(2030, 3, 17, 23, 59, 30, tzinfo=datetime.timezone.utc).timestamp()
MONDAY = datetime.datetime(2030, 3, 18, 0, 0, 1, tzinfo=datetime.timezone.utc).timestamp()


def _utc(*args) -> float:
    return datetime.datetime(*args, tzinfo=datetime.timezone.utc).timestamp()


def admit(services, ws: str, price: int, *, now: float | None = None, key: str = "") -> Admission:
    request_id = services.ids.mint(ws, MODEL)
    return services.store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider="bfl",
                                           body="{}", price=price, now=now, key_id=key))


def spent(services, ws: str, now: float, scope: str = "ws") -> dict[str, int]:
    return next(b.spent for b in services.accounts.budgets.show(ws, now) if b.scope == scope)


@pytest.mark.parametrize("at, period, start", [
    (_utc(2030, 3, 17, 23, 59), "day", datetime.date(2030, 3, 17)),
    (_utc(2030, 3, 17, 23, 59), "week", datetime.date(2030, 3, 11)),  # a Sunday: its week began Monday 11th
    (_utc(2030, 3, 18, 0, 0), "week", datetime.date(2030, 3, 18)),
    (_utc(2027, 1, 1, 12, 0), "week", datetime.date(2026, 12, 28)),  # ISO weeks cross the year
    (_utc(2028, 2, 29, 8, 0), "month", datetime.date(2028, 2, 1)),
    (_utc(2030, 12, 31, 23, 59, 59), "month", datetime.date(2030, 12, 1)),
])
def test_periods_are_utc_days_iso_weeks_and_calendar_months(at, period, start):
    assert period_start(period, at) == start


@pytest.mark.parametrize("first, second, period", [
    (SUNDAY, MONDAY, "week"),  # a new ISO week at Monday 00:00 UTC
    (_utc(2030, 3, 31, 23, 59), _utc(2030, 4, 1, 0, 0, 1), "month"),
    (_utc(2030, 3, 12, 23, 59), _utc(2030, 3, 13, 0, 0, 1), "day"),
])
def test_a_budget_starts_afresh_with_its_period_in_the_admission_script(services, first, second, period):
    ws = services.accounts.create_workspace("p", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {period: 100})
    assert admit(services, ws, 60, now=first).outcome is Admit.ADMITTED
    assert admit(services, ws, 60, now=first + 1).outcome is Admit.BUDGET_EXCEEDED  # same period: over
    assert admit(services, ws, 60, now=second).outcome is Admit.ADMITTED  # the script's period turned too
    assert spent(services, ws, second)[period] == 60


def test_a_hold_over_the_budget_is_refused_and_nothing_is_queued_or_held(services):
    ws = services.accounts.create_workspace("b", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 100, "month": 1000})
    assert [admit(services, ws, 30).outcome for _ in range(3)] == [Admit.ADMITTED] * 3
    before = services.accounts.get(ws)
    refused = admit(services, ws, 30)
    assert refused.outcome is Admit.BUDGET_EXCEEDED
    assert refused.budget == budget_store.Refusal("workspace", "day", 100, 90)
    after = services.accounts.get(ws)
    assert (after.held, after.queued, after.credits) == (before.held, before.queued, before.credits) == (90, 3, 10_000)
    assert admit(services, ws, 10).outcome is Admit.ADMITTED  # exactly up to the line is within it


def test_a_released_hold_leaves_the_periods_spend(services):
    ws = services.accounts.create_workspace("r", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 100})
    request_id = services.ids.mint(ws, MODEL)
    services.store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider="bfl", body="{}",
                                    price=80))
    assert admit(services, ws, 80).outcome is Admit.BUDGET_EXCEEDED
    services.store.cancel(request_id=request_id, workspace=ws, model=MODEL, provider="bfl")
    assert spent(services, ws, datetime.datetime.now().timestamp())["day"] == 0
    assert admit(services, ws, 80).outcome is Admit.ADMITTED


def test_a_keys_budget_refuses_that_key_only(services):
    ws = services.accounts.create_workspace("k", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "key_a", {"month": 50})
    assert admit(services, ws, 40, key="key_a").outcome is Admit.ADMITTED
    refused = admit(services, ws, 40, key="key_a")
    assert refused.outcome is Admit.BUDGET_EXCEEDED and refused.budget.scope == "key"
    assert admit(services, ws, 40, key="key_b").outcome is Admit.ADMITTED  # another key: the workspace has room
    assert spent(services, ws, datetime.datetime.now().timestamp())["month"] == 80  # the workspace counts both


def test_a_keys_budget_set_mid_period_counts_what_the_key_spent_before_it(services):
    ws = services.accounts.create_workspace("m", queue_enabled=True, credits=10_000)
    assert admit(services, ws, 40, key="key_a").outcome is Admit.ADMITTED  # no budget yet
    services.accounts.budgets.set(ws, "key_a", {"day": 50})
    assert spent(services, ws, datetime.datetime.now().timestamp(), scope="key_a")["day"] == 40
    refused = admit(services, ws, 20, key="key_a")
    assert refused.outcome is Admit.BUDGET_EXCEEDED and (refused.budget.limit, refused.budget.spent) == (50, 40)
    assert admit(services, ws, 10, key="key_a").outcome is Admit.ADMITTED  # up to the line


def test_each_threshold_is_owed_once_per_period(services):
    ws = services.accounts.create_workspace("t", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 100, "week": 1000}, (50, 80, 100))
    for price in (30, 30, 30, 5):
        admit(services, ws, price, now=SUNDAY)
    assert admit(services, ws, 30, now=SUNDAY).outcome is Admit.BUDGET_EXCEEDED  # the day's budget is spent
    admit(services, ws, 30, now=SUNDAY)  # refused again: its 100 % alert is owed once
    owed = services.accounts.budgets.owed([ws])
    assert [(c.period, c.threshold, c.spent) for c in owed] == [("day", 50, 60), ("day", 80, 90), ("day", 100, 95)]
    assert owed[0].start == datetime.date(2030, 3, 17)
    assert owed[0].webhook_id == f"budget_{ws}_day_2030-03-17_50"
    admit(services, ws, 60, now=MONDAY)  # a new day (and week): 50 % again, of that day
    assert [(c.period, c.start.isoformat(), c.threshold) for c in services.accounts.budgets.owed([ws])][3:] == [
        ("day", "2030-03-18", 50)]


def _publish(services) -> list[str]:
    """The sweeper's part: the crossings it publishes to the webhooks worker, as (workspace|crossing)."""
    published: list[str] = []
    budget_alerts.publish_owed(services, lambda ws, ident: published.append(f"{ws}|{ident}"))
    return published


def _send_published(services) -> list[str]:
    """What the webhooks worker makes of each crossing the sweeper publishes now."""
    return [budget_alerts.send(services, *p.split("|", 1)) for p in _publish(services)]


def test_an_owed_alert_without_a_default_webhook_is_audited_once(services):
    ws = services.accounts.create_workspace("a", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 10}, (100,))
    admit(services, ws, 10)
    published = _publish(services)
    assert len(published) == 1 and services.accounts.keys.audit(ws) == []  # the sweep itself tells nobody
    assert budget_alerts.send(services, *published[0].split("|", 1)) == "audited"
    assert budget_alerts.send(services, *published[0].split("|", 1)) == "not_owed"
    assert _publish(services) == []
    lines = services.accounts.keys.audit(ws)
    assert [(line["action"], line["threshold"], line["period"], line["outcome"]) for line in lines] == [
        ("budget.threshold_crossed", 100, "day", "audited")]
    assert services.accounts.budgets.owed([ws]) == []


def _failing(services, monkeypatch, ws: str) -> list[str]:
    """Every attempt at ``ws``'s default webhook fails (its turn and circuit are still taken)."""
    from router_queue.webhooks import delivery, event as webhook_event

    services.accounts.webhook_secret(ws, webhook_event.new_secret())
    services.accounts.set_webhook_url(ws, "https://hooks.example/budget")
    posted: list[str] = []
    monkeypatch.setattr(delivery.safety, "check", lambda url, **_: ["127.0.0.1"])
    monkeypatch.setattr(delivery, "post", lambda url, address, body, headers, timeout:
                        posted.append(headers["webhook-id"]) or 503)
    return posted


def test_a_failed_alert_waits_out_its_backoff_then_is_given_up_and_audited(services, monkeypatch):
    ws = services.accounts.create_workspace("f", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 10}, (100,))
    admit(services, ws, 10)
    posted = _failing(services, monkeypatch, ws)
    assert _send_published(services) == ["failed"]
    assert _publish(services) == []  # its backoff (WEBHOOK_RETRY_SCHEDULE's first delay) runs
    (crossing,) = services.accounts.budgets.owed([ws])
    assert crossing.attempts == 1 and crossing.due > datetime.datetime.now().timestamp() + 3
    assert budget_alerts.send(services, ws, crossing.ident) == "busy"  # a stray message sends nothing either
    services.settings = dataclasses.replace(services.settings, webhook_retry_schedule_s=(0.0,))
    services.webhooks.limits = dataclasses.replace(services.webhooks.limits, circuit_failures=100)  # never open
    later = crossing.due + 1  # its backoff over: an attempt then, given back, leaves it due
    assert isinstance(services.accounts.budgets.take(ws, crossing.ident, token="t", now=later, lease_s=0),
                      budget_store.Crossing)
    assert services.accounts.budgets.sent(crossing, token="t", outcome="released") == 1
    outcomes = [_send_published(services) for _ in range(budget_alerts.MAX_ATTEMPTS)]
    assert outcomes[:-2] == [["failed"]] * (budget_alerts.MAX_ATTEMPTS - 2)
    assert outcomes[-2:] == [["given_up"], []]
    assert len(posted) == budget_alerts.MAX_ATTEMPTS and set(posted) == {crossing.webhook_id}
    assert services.accounts.keys.audit(ws)[0]["outcome"] == "given_up"
    assert services.accounts.budgets.owed([ws]) == []
    logged = services.webhooks.attempts(ws)  # beside the workspace's request events
    assert {a.request_id for a in logged} == {crossing.webhook_id}


def test_one_attempt_holds_a_crossing_and_a_full_turn_waits_uncounted(services, monkeypatch):
    ws = services.accounts.create_workspace("l", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 10}, (100,))
    admit(services, ws, 10)
    posted = _failing(services, monkeypatch, ws)
    (crossing,) = services.accounts.budgets.owed([ws])
    now = datetime.datetime.now().timestamp()
    held = services.accounts.budgets.take(ws, crossing.ident, token="another-worker", now=now, lease_s=30)
    assert isinstance(held, budget_store.Crossing)
    assert budget_alerts.send(services, ws, crossing.ident) == "busy" and posted == []  # never two at once
    assert _publish(services) == []  # held: not published again while its lease runs
    assert services.accounts.budgets.sent(crossing, token="not-the-holder", outcome="ended") == -2
    assert services.accounts.budgets.sent(crossing, token="another-worker", outcome="released") == 0
    services.webhooks.limits = dataclasses.replace(services.webhooks.limits, max_in_flight_per_workspace=1)
    endpoint = "https://hooks.example"
    assert services.webhooks.turn(ws, endpoint, now=now, lease_s=30, token="an-event")[0] == "HELD"
    assert _send_published(services) == ["waiting"] and posted == []  # the workspace's one slot is taken
    assert services.accounts.budgets.owed([ws])[0].attempts == 0  # waiting is no attempt
    services.webhooks.end_turn(ws, endpoint, token="an-event", now=now)
    assert _send_published(services) == ["failed"] and posted == [crossing.webhook_id]


def test_a_crossing_is_published_once_per_lease_until_a_worker_takes_it(services):
    ws = services.accounts.create_workspace("p", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 10}, (100,))
    admit(services, ws, 10)
    published: list[str] = []

    def sweep(at: float) -> None:
        budget_alerts.publish_owed(services, lambda w, ident: published.append(ident), now=at)

    now, lease = time.time(), services.settings.webhook_lease_s
    sweep(now)
    sweep(now + 1)  # its message is still queued: not published again
    assert len(published) == 1
    sweep(now + lease + 1)  # never taken (lost in the broker): published again, once
    sweep(now + lease + 2)
    assert len(published) == 2
    assert budget_alerts.send(services, ws, published[-1]) == "audited"
    sweep(now + 3 * lease)
    assert len(published) == 2


def test_a_taken_crossing_given_back_is_published_at_the_next_sweep(services):
    ws = services.accounts.create_workspace("g", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 10}, (100,))
    admit(services, ws, 10)
    (published,) = _publish(services)
    crossing = services.accounts.budgets.take(ws, published.split("|", 1)[1], token="t", now=time.time(), lease_s=30)
    assert isinstance(crossing, budget_store.Crossing)
    services.accounts.budgets.sent(crossing, token="t", outcome="released")  # the workspace's turn was full
    assert _publish(services) == [published]


def test_the_sweep_publishes_at_most_its_bound_of_crossings(services, monkeypatch):
    monkeypatch.setattr(budget_alerts, "CROSSINGS_PER_SWEEP", 2)
    ws = services.accounts.create_workspace("b", queue_enabled=True, credits=10_000)
    services.accounts.budgets.set(ws, "ws", {"day": 10}, (50, 80, 100))
    admit(services, ws, 10)
    assert len(services.accounts.budgets.owed([ws])) == 3
    assert len(_publish(services)) == 2


def test_a_refused_batch_line_names_budget_exceeded(services):
    line = {"id": "r1", "m": MODEL, "p": "bfl", "c": 30}
    outcome = drain._outcome(services, line, Admission(Admit.BUDGET_EXCEEDED))
    assert outcome is not None and "budget_exceeded" in outcome


def test_the_submit_route_answers_402_budget_exceeded(http, services, workspace, api_key, auth):
    price = services.catalog.by_id(MODEL).price_credits
    key_id = services.accounts.keys.find(api_key).id
    services.accounts.budgets.set(workspace, key_id, {"day": price})
    assert http.post(f"/v2/models/{MODEL}/requests", json=BODY, headers=auth).status_code == 201
    refused = http.post(f"/v2/models/{MODEL}/requests", json=BODY, headers=auth)
    assert refused.status_code == 402
    body = refused.get_json()
    assert body["error_type"] == "budget_exceeded" and "daily budget" in body["detail"]
    assert refused.headers["X-Comfy-Error-Type"] == "budget_exceeded"
    assert services.accounts.get(workspace).held == price


def test_a_keys_budget_holds_for_the_lines_of_a_batch_it_sends(http, services, workspace, api_key, auth):
    """A batch's lines are admitted later, by its drain, but as the key that sent the batch: one
    line fits the key's daily budget, the second ends budget_exceeded in the results."""
    price = services.catalog.by_id(MODEL).price_credits
    services.accounts.budgets.set(workspace, services.accounts.keys.find(api_key).id, {"day": price})
    line = json.dumps({"model": MODEL, "body": BODY})
    sent = http.post("/v2/batches", data=f"{line}\n{line}\n",
                     headers={**auth, "Content-Type": "application/x-ndjson"})
    assert sent.status_code == 201, sent.get_data(as_text=True)
    batch_id = sent.json["batch_id"]
    drain.drain(services, workspace, batch_id)
    results = [json.loads(text) for text in
               http.get(f"/v2/batches/{batch_id}/results", headers=auth).get_data(as_text=True).splitlines()]
    assert [r.get("error_type") for r in results] == [None, "budget_exceeded"]
    assert services.accounts.get(workspace).held == price


def test_the_cli_sets_shows_and_clears_budgets(services, workspace, api_key):
    runner = ServicesCliRunner(services)
    done = runner.invoke(main, ["workspace", "set-budget", workspace, "--daily", "100", "--monthly", "2000",
                                "--alert-at", "50,80,100"])
    assert done.exit_code == 0, done.output
    key_id = services.accounts.keys.find(api_key).id
    assert runner.invoke(main, ["key", "set-budget", key_id, "--weekly", "300"]).exit_code == 0
    shown = runner.invoke(main, ["workspace", "budgets", workspace]).output.splitlines()
    assert shown == ["whose\tperiod\tlimit\tspent\talert_at", "workspace\tday\t100\t0\t50,80,100",
                     "workspace\tmonth\t2000\t0\t50,80,100", f"{key_id}\tweek\t300\t0\t80,100"]
    assert runner.invoke(main, ["workspace", "set-budget", workspace, "--daily", "0"]).exit_code == 0
    assert runner.invoke(main, ["key", "set-budget", key_id, "--clear"]).exit_code == 0
    assert runner.invoke(main, ["workspace", "budgets", workspace]).output.splitlines()[1:] == [
        "workspace\tmonth\t2000\t0\t50,80,100"]
    bad = runner.invoke(main, ["workspace", "set-budget", workspace, "--alert-at", "0,80"])
    assert bad.exit_code == 2 and "per cents" in bad.output
    assert runner.invoke(main, ["workspace", "set-budget", workspace]).exit_code == 2
    assert runner.invoke(main, ["key", "set-budget", "key_nope", "--daily", "1"]).exit_code == 1


def _charged(services, ws: str, model: str, key: str, now: float) -> None:
    request_id = services.ids.mint(ws, model)
    services.store.admit(Submission(request_id=request_id, workspace=ws, model=model,
                                    provider=model.split("/")[0], body="{}", price=10, now=now, key_id=key))
    services.redis.xadd(f"{{ws:{ws}}}:ledger", {"type": "charge", "request_id": request_id, "amount": 10,
                                                "balance": 0, "held": 0, "at": now, "model": model, "key": key},
                        id=f"{int(now * 1000)}-*")


def test_usage_groups_the_charges_by_model_key_and_day(http, services, workspace, auth):
    day = _utc(2030, 3, 17, 10)
    _charged(services, workspace, MODEL, "key_a", day)
    _charged(services, workspace, MODEL, "key_b", day + 86400)
    _charged(services, workspace, "vertexai/gemini-2.5-flash-image-preview", "key_a", day + 86400)
    query = "since=2030-03-17T00:00:00Z&until=2030-03-19T00:00:00Z"
    by = {g: http.get(f"/v2/usage?{query}&group_by={g}", headers=auth).get_json() for g in ("model", "key", "day")}
    assert [(g["key_id"], g["credits"], g["requests"]) for g in by["key"]["groups"]] == [
        ("key_a", 20, 2), ("key_b", 10, 1)]
    assert [(g["day"], g["credits"]) for g in by["day"]["groups"]] == [("2030-03-17", 10), ("2030-03-18", 20)]
    assert by["model"]["groups"][0] == {"model": MODEL, "credits": 20, "requests": 2}
    assert by["model"]["total"] == {"credits": 30, "requests": 3} and by["model"]["complete"] is True
    narrow = http.get("/v2/usage?since=2030-03-18T00:00:00Z&until=2030-03-19T00:00:00Z", headers=auth).get_json()
    assert narrow["total"]["credits"] == 20 and narrow["group_by"] == "day"


def test_usage_that_reads_its_cap_of_entries_says_where_to_go_on(http, services, workspace, auth, monkeypatch):
    monkeypatch.setattr(usage_route, "MAX_ENTRIES", 3)
    for i in range(3):  # a hold and a charge each
        _charged(services, workspace, MODEL, "key_a", _utc(2030, 3, 17, 10, i))
    query = "since=2030-03-17T00:00:00Z&until=2030-03-18T00:00:00Z"
    pages = [http.get(f"/v2/usage?{query}", headers=auth).get_json()]
    while not pages[-1]["complete"]:
        assert len(pages) < 5
        pages.append(http.get(f"/v2/usage?since={pages[-1]['next_since']}&until=2030-03-18T00:00:00Z",
                              headers=auth).get_json())
    assert len(pages) > 1 and pages[0]["total"]["credits"] == 10  # a hold and its charge share a ms: never split
    assert sum(p["total"]["credits"] for p in pages) == 30


@pytest.mark.parametrize("query, names", [
    ("group_by=provider", "group_by"),
    ("since=yesterday", "since"),
    ("since=2030-03-17T00:00:00Z&until=2030-03-16T00:00:00Z", "until"),
    ("since=2030-01-01T00:00:00Z&until=2030-06-01T00:00:00Z", "until"),
    ("limit=5", "limit"),
    ("group_by=day&group_by=model", "group_by"),
])
def test_usage_refuses_bad_input_as_invalid_input(http, auth, query, names):
    refused = http.get(f"/v2/usage?{query}", headers=auth)
    assert refused.status_code == 400, refused.get_json()
    assert refused.headers["X-Comfy-Error-Type"] == "invalid_input"
    assert names in json.dumps(refused.get_json())


def test_a_split_store_checks_budgets_in_the_workspaces_step_and_an_undo_gives_the_spend_back(client, settings):
    split = Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True)
    ws = split.accounts.create_workspace("s", queue_enabled=True, credits=10_000)
    split.accounts.budgets.set(ws, "ws", {"day": 100})
    assert admit(split, ws, 60, key="key_a").outcome is Admit.ADMITTED
    assert admit(split, ws, 60, key="key_a").outcome is Admit.BUDGET_EXCEEDED
    split.store.set_draining("bfl", True)  # the provider's step refuses: the workspace's part is undone
    assert admit(split, ws, 40).outcome is Admit.DRAINING
    assert spent(split, ws, datetime.datetime.now().timestamp())["day"] == 60
