"""Credits: a hold at admission, one charge or one release at the end, a ledger
that agrees, and no overdraw under concurrency (fakeredis and real Redis)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from router_queue.store.record import Submission
from router_queue.store.requests_values import Lease
from tests.unit.support import record_of

MODEL = "bfl/flux-2-pro"
PRICE = 60


def lease(token="t"):
    return Lease(token=token, lease_s=30, queue_timeout_s=3600, max_takeovers=3)


def admit(services, workspace, price=PRICE):
    request_id = services.ids.mint(workspace, MODEL)
    return request_id, services.store.admit(Submission(request_id=request_id, workspace=workspace, model=MODEL,
                                            provider="bfl", body="{}", price=price))


def funded(services, credits):
    return services.accounts.create_workspace("funded", queue_enabled=True, credits=credits)


def test_admission_holds_the_price_and_success_charges_it(services):
    ws = funded(services, 100)
    request_id, _ = admit(services, ws)
    assert (services.accounts.get(ws).credits, services.accounts.get(ws).held) == (100, PRICE)
    services.store.claim(record_of(services, request_id, "bfl"), lease())
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    account = services.accounts.get(ws)
    assert (account.credits, account.held) == (100 - PRICE, 0)
    assert [e.type for e in services.accounts.ledger(ws)] == ["hold", "charge"]


def test_a_workspace_that_cannot_fund_the_run_queues_nothing(services):
    ws = funded(services, PRICE - 1)
    request_id, outcome = admit(services, ws)
    assert (outcome.outcome, outcome.available) == ("INSUFFICIENT_CREDITS", PRICE - 1)
    assert services.store.status_view(request_id, "bfl").record is None
    assert services.accounts.get(ws).held == 0
    assert services.accounts.ledger(ws) == []


def test_holds_count_against_what_is_available(services):
    ws = funded(services, PRICE * 2)
    assert admit(services, ws)[1].outcome == "ADMITTED"
    assert admit(services, ws)[1].outcome == "ADMITTED"
    assert admit(services, ws)[1].outcome == "INSUFFICIENT_CREDITS"


def test_cancel_queue_timeout_and_unbilled_failures_release_the_hold(services):
    ws = funded(services, 1000)
    cancelled, _ = admit(services, ws)
    services.store.cancel(request_id=cancelled, workspace=ws, model=MODEL, provider="bfl")
    timed_out, _ = admit(services, ws)
    services.store.expire_queued(timed_out, "bfl", ws, 0, now=1e12)
    failed, _ = admit(services, ws)
    services.store.claim(record_of(services, failed, "bfl"), lease())
    services.store.complete(record_of(services, failed, "bfl"), error_type="provider_error", detail="x")
    account = services.accounts.get(ws)
    assert (account.credits, account.held) == (1000, 0)
    assert sorted(e.type for e in services.accounts.ledger(ws)) == ["hold"] * 3 + ["release"] * 3


def test_a_refusal_the_provider_bills_is_charged(services):
    ws = funded(services, 1000)
    request_id, _ = admit(services, ws)
    services.store.claim(record_of(services, request_id, "bfl"), lease())
    services.store.complete(record_of(services, request_id, "bfl"), error_type="content_policy_violation",
                            detail="blocked", billable=True)
    assert services.accounts.get(ws).credits == 1000 - PRICE


def test_a_request_is_charged_once_whatever_completes_it_again(services):
    ws = funded(services, 1000)
    request_id, _ = admit(services, ws)
    services.store.claim(record_of(services, request_id, "bfl"), lease())
    record = record_of(services, request_id, "bfl")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: services.store.complete(record, output=b"{}", content_type="x"), range(16)))
    assert services.accounts.get(ws).credits == 1000 - PRICE
    assert [e.type for e in services.accounts.ledger(ws)] == ["hold", "charge"]


def test_a_thousand_racing_submits_never_overdraw(services):
    ws = funded(services, PRICE * 100)
    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda _: admit(services, ws)[1].outcome, range(1000)))
    assert outcomes.count("ADMITTED") == 100
    assert set(outcomes) == {"ADMITTED", "INSUFFICIENT_CREDITS"}
    account = services.accounts.get(ws)
    assert (account.credits, account.held, account.queued) == (PRICE * 100, PRICE * 100, 100)


def test_balance_and_ledger_agree_after_a_storm(services):
    """Concurrent submits, cancels, successes, failures and duplicate completions."""
    start = PRICE * 40
    ws = funded(services, start)
    rng = random.Random(7)

    def one(n: int) -> None:
        request_id, outcome = admit(services, ws)
        if outcome.outcome != "ADMITTED":
            return
        fate = rng.choice(["cancel", "success", "failure", "refusal_billed", "twice"])
        if fate == "cancel":
            services.store.cancel(request_id=request_id, workspace=ws, model=MODEL, provider="bfl")
            return
        services.store.claim(record_of(services, request_id, "bfl"), lease(f"t{n}"))
        record = record_of(services, request_id, "bfl")
        if fate in ("success", "twice"):
            services.store.complete(record, output=b"{}", content_type="x")
        if fate == "twice":
            services.store.complete(record, error_type="provider_error", detail="late duplicate")
        if fate == "failure":
            services.store.complete(record, error_type="provider_error", detail="x")
        if fate == "refusal_billed":
            services.store.complete(record, error_type="content_policy_violation", detail="x", billable=True)

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(300)))
    ledger = services.accounts.ledger(ws, count=10_000)
    charges = sum(e.amount for e in ledger if e.type == "charge")
    holds = sum(e.amount for e in ledger if e.type == "hold")
    releases = sum(e.amount for e in ledger if e.type == "release")
    account = services.accounts.get(ws)
    assert charges > 0
    assert account.credits == start - charges
    assert account.held == 0 == holds - charges - releases
    assert account.credits >= 0
    assert account.queued == 0
    assert ledger[-1].balance == account.credits
