"""The front door's admission policy against the real stack (gunicorn, Redis, Celery, stub).

Idempotency under a storm of one key, credits under a race, every error-table
row the front door owns, refusals that leave the key free, billing through
real workers, the rate limit across gunicorn's processes, bad input that never
reaches a worker, and how keys and request ids are kept. docs/API.md is the
reference for every expectation here: "Errors" (the error table and "Input
limits"), "Idempotency", "Billing, retention, limits" and "Headers".
"""

from __future__ import annotations

import hashlib
import json
import socket
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import pytest
import requests

from router_queue.settings import Settings
from router_queue.store import keys
from router_queue.store.consistency import ONE_STEP
from router_queue.store.ids import ID_PATTERN

from .admission_support import (
    JSON,
    assert_error,
    assert_no_5xx,
    fan_out,
    idempotency_key_name,
    ledger,
    price,
    rate_counters,
    redis_occurrences,
    retry_after,
    saturated,
    sequence,
    settlements,
    workspace,
)
from .harness import (
    FLUX,
    GEMINI,
    TTS,
    WORKER_CONCURRENCY,
    ApiClient,
    Stub,
    broker_drained,
    make_caller,
    unique_prompt,
    wait_for,
)

#: MAX_BODY_BYTES as the stack runs it (the default: the harness does not set it).
MAX_BODY_BYTES = Settings.max_body_bytes

IDEMPOTENCY_TTL_S = 86_400  # IDEMPOTENCY_TTL_SECONDS default: the stack does not set it


def _flux(label: str, *directives: str) -> dict:
    return {"prompt": unique_prompt(label, *directives)}


def _tts(label: str) -> dict:
    return {"input": unique_prompt(label), "voice": "alloy"}


def _gemini(label: str, *directives: str) -> dict:
    return {"contents": [{"role": "user", "parts": [{"text": unique_prompt(label, *directives)}]}]}


def _post(session: requests.Session, caller: ApiClient, model: str, body: Any,
          headers: dict[str, str] | None = None) -> requests.Response:
    return session.post(caller.url(model), json=body, headers=caller.headers(headers), timeout=30)


def _nothing_admitted(services: Any, workspace_id: str) -> None:
    row = workspace(services, workspace_id)
    assert (row.queued, row.held) == (0, 0), row
    assert ledger(services, workspace_id) == []


def _wait_all_completed(services: Any, ids: list[str], timeout_s: float = 30.0) -> None:
    """Every request COMPLETED, read straight from the store (no rate limit spent)."""
    def done() -> bool:
        pipe = services.redis.pipeline(transaction=False)
        for request_id in ids:
            pipe.hget(keys.request(request_id), "status")
        return all(s == b"COMPLETED" for s in pipe.execute())
    wait_for(done, timeout_s=timeout_s, interval_s=0.2, what=f"{len(ids)} requests COMPLETED")


# -- 1. idempotency under a storm of one key ----------------------------------------------------


def test_200_concurrent_submits_under_one_key_create_exactly_one_request(stack, services, stub: Stub) -> None:
    cost = price(services, FLUX)
    start = 100 * cost
    key = f"storm-{uuid.uuid4()}"
    body = _flux("one key, two hundred submits")
    with make_caller(stack, "idem-storm", credits=start) as caller:
        answers = fan_out(lambda s, _: _post(s, caller, FLUX, body, {"Idempotency-Key": key}), 200)

        assert_no_5xx(answers)
        statuses = Counter(a.status_code for a in answers)
        assert set(statuses) <= {201, 409}, statuses
        for busy in (a for a in answers if a.status_code == 409):
            assert_error(busy, 409, "concurrency_limit_exceeded", retry_after_expected=True)
        if services.consistency is ONE_STEP:
            # Admission is one atomic Lua step: nobody ever sees the key "being admitted".
            assert statuses == {201: 200}, statuses
        # On a cluster it is steps (store/admission.py): a resend between the first's steps is
        # told to come back (409 above), never given an id that may not exist.
        admitted = [a for a in answers if a.status_code == 201]
        ids = {a.json()["request_id"] for a in admitted}
        assert len(ids) == 1, ids
        request_id = ids.pop()
        assert all(a.headers["X-Comfy-Request-Id"] == request_id for a in admitted)
        originals = [a for a in admitted if a.headers.get("Idempotent-Replayed") != "true"]
        assert len(originals) == 1
        assert all(a.headers.get("Idempotent-Replayed") == "true" for a in admitted if a is not originals[0])

        # One hold, for that request; the workspace counts one request, however far it got.
        assert settlements(ledger(services, caller.workspace)).keys() == {request_id}
        row = workspace(services, caller.workspace)
        assert row.queued in (0, 1) and row.held in (0, cost), row
        assert list(services.redis.scan_iter(match=keys.idempotency(caller.workspace, "*"))) == [
            idempotency_key_name(caller.workspace, key).encode()]
        ttl = services.redis.ttl(idempotency_key_name(caller.workspace, key))
        assert IDEMPOTENCY_TTL_S - 60 < ttl <= IDEMPOTENCY_TTL_S, ttl

        caller.wait_status(FLUX, request_id)
        assert stub.submits("bfl_submit", body) == 1
        assert settlements(ledger(services, caller.workspace)) == {request_id: [("hold", cost), ("charge", cost)]}
        row = workspace(services, caller.workspace)
        assert (row.credits, row.held, row.queued) == (start - cost, 0, 0), row

        # The same body with its keys reordered and spaced differently is the same request.
        reordered = caller.session.post(
            caller.url(FLUX), data=json.dumps(body, indent=2, sort_keys=True).encode(),
            headers=caller.headers({"Idempotency-Key": key, "Content-Type": JSON}), timeout=10)
        assert reordered.status_code == 201, reordered.text
        assert reordered.json()["request_id"] == request_id
        assert reordered.headers.get("Idempotent-Replayed") == "true"


# -- 2. credits under a race -----------------------------------------------------------------------


def test_a_thousand_submits_race_for_a_balance_that_funds_a_hundred(stack, services) -> None:
    cost = price(services, TTS)
    start = 100 * cost
    with make_caller(stack, "credit-race", credits=start) as payer:
        with saturated(stack):  # every admitted request stays held, none settles during the race
            answers = fan_out(lambda s, i: _post(s, payer, TTS, _tts(f"race {i}")), 1000)

            assert_no_5xx(answers)
            assert Counter(a.status_code for a in answers) == {201: 100, 402: 900}
            for refused in (a for a in answers if a.status_code == 402):
                assert_error(refused, 402, "insufficient_credits")
            admitted = [a.json()["request_id"] for a in answers if a.status_code == 201]
            assert len(set(admitted)) == 100

            row = workspace(services, payer.workspace)
            assert (row.credits, row.held, row.queued) == (start, start, 100), row
            assert row.available == 0
            entries = ledger(services, payer.workspace)
            assert [e.type for e in entries] == ["hold"] * 100
            assert {e.request_id for e in entries} == set(admitted)
            assert all(e.balance - e.held >= 0 for e in entries), "a hold overdrew the balance"
            assert [e.held for e in entries] == [cost * n for n in range(1, 101)]

            cancelled, kept = admitted[:50], admitted[50:]
            cancels = fan_out(lambda s, i: s.put(payer.url(TTS, cancelled[i], "/cancel"), headers=payer.headers(),
                                                 timeout=30), len(cancelled))
            assert [c.status_code for c in cancels] == [202] * 50
            row = workspace(services, payer.workspace)
            assert (row.held, row.queued) == (50 * cost, 50), row

        _wait_all_completed(services, admitted)
        final = workspace(services, payer.workspace)
        entries = ledger(services, payer.workspace)
        per_request = settlements(entries)
        assert {rid: per_request[rid] for rid in cancelled} == {rid: [("hold", cost), ("release", cost)]
                                                                for rid in cancelled}
        assert {rid: per_request[rid] for rid in kept} == {rid: [("hold", cost), ("charge", cost)] for rid in kept}
        charged = sum(e.amount for e in entries if e.type == "charge")
        assert charged == 50 * cost
        assert (final.credits, final.held, final.queued) == (start - charged, 0, 0), final
        assert entries[-1].balance == final.credits and entries[-1].held == 0


# -- 3. the error table -----------------------------------------------------------------------------


@dataclass
class Rig:
    """What an error-table row needs: the stack and workspaces made on demand."""

    stack: Any
    callers: list[ApiClient] = field(default_factory=list)

    @property
    def services(self) -> Any:
        return self.stack.services

    def caller(self, name: str = "table", **kwargs: Any) -> ApiClient:
        made = make_caller(self.stack, name, **kwargs)
        self.callers.append(made)
        return made

    def close(self) -> None:
        for made in self.callers:
            made.session.close()


@pytest.fixture
def rig(stack) -> Iterator[Rig]:
    made = Rig(stack)
    yield made
    made.close()


@dataclass(frozen=True)
class Row:
    status: int
    #: The bucket, or None where the contract gives none (410).
    bucket: str | None
    make: Callable[[Rig], requests.Response]
    retry_after: bool = False
    #: A submit refused before queueing: afterwards nothing is queued nor held.
    refusal: bool = False


def _not_json(rig: Rig) -> requests.Response:
    c = rig.caller()
    return c.session.post(c.url(FLUX), data=b'{"prompt": ', headers=c.headers({"Content-Type": JSON}), timeout=10)


def _not_an_object(rig: Rig) -> requests.Response:
    c = rig.caller()
    return c.session.post(c.url(FLUX), data=b'["a prompt"]', headers=c.headers({"Content-Type": JSON}), timeout=10)


def _no_key(rig: Rig) -> requests.Response:
    return requests.post(f"{rig.stack.base_url}/v2/models/{FLUX}/requests", json=_flux("no key"), timeout=10)


def _unknown_key(rig: Rig) -> requests.Response:
    return requests.post(f"{rig.stack.base_url}/v2/models/{FLUX}/requests", json=_flux("unknown key"),
                         headers={"Authorization": "Bearer rq_" + uuid.uuid4().hex}, timeout=10)


def _unfunded(rig: Rig) -> requests.Response:
    c = rig.caller(credits=price(rig.services, FLUX) - 1)
    return c.submit(FLUX, _flux("cannot pay"))


def _workspace_off(rig: Rig) -> requests.Response:
    return rig.caller(queue_enabled=False).submit(FLUX, _flux("queue off"))


def _legacy_key(rig: Rig) -> requests.Response:
    key = rig.services.accounts.mint_legacy_key()
    return requests.post(f"{rig.stack.base_url}/v2/models/{FLUX}/requests", json=_flux("legacy"),
                         headers={"X-API-Key": key}, timeout=10)


def _byok(header: str) -> Callable[[Rig], requests.Response]:
    def make(rig: Rig) -> requests.Response:
        return rig.caller().submit(FLUX, _flux("my own provider key"), headers={header: "sk-my-own"})
    return make


def _unknown_model(rig: Rig) -> requests.Response:
    response = rig.caller().submit("bfl/flux-2-pr0", _flux("typo"))
    assert "bfl/flux-2-pro" in response.json()["detail"], response.text  # a close id is suggested
    return response


def _unknown_request(rig: Rig) -> requests.Response:
    return rig.caller().status(FLUX, str(uuid.uuid4()))


def _key_conflict(rig: Rig) -> requests.Response:
    c = rig.caller()
    c.submit_ok(FLUX, _flux("first under the key"), headers={"Idempotency-Key": "shared"})
    return c.submit(FLUX, _flux("another body"), headers={"Idempotency-Key": "shared"})


def _cancel_finished(rig: Rig) -> requests.Response:
    c = rig.caller()
    request_id = c.submit_ok(FLUX, _flux("finished"))
    c.wait_status(FLUX, request_id)
    response = c.cancel(FLUX, request_id)
    assert response.status_code == 409, response.text
    assert response.json()["status"] == "ALREADY_COMPLETED"
    assert response.headers.get("X-Comfy-Request-Id")
    return response


def _result_of_cancelled(rig: Rig) -> requests.Response:
    c = rig.caller()
    request_id = c.submit_ok(FLUX, _flux("cancel me", "[stub:latency=30]"))
    assert c.cancel(FLUX, request_id).status_code == 202  # queued: at once; running: between polls
    assert c.wait_status(FLUX, request_id, timeout_s=10)["error_type"] == "cancelled"
    return c.result(FLUX, request_id)


def _past_retention(rig: Rig) -> requests.Response:
    c = rig.caller()
    request_id = c.submit_ok(FLUX, _flux("expires"))
    c.wait_status(FLUX, request_id)
    # What Redis does when the retention TTL runs out.
    assert rig.services.redis.delete(keys.request(request_id), keys.result(request_id)) == 2
    return c.status(FLUX, request_id)


def _too_large(rig: Rig) -> requests.Response:
    c = rig.caller()
    big = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()
    return c.session.post(c.url(FLUX), data=big, headers=c.headers({"Content-Type": JSON}), timeout=10)


def _schema(rig: Rig) -> requests.Response:
    response = rig.caller().submit(FLUX, {"prompt": 5, "colour": "red"})
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail, detail
    assert {tuple(d["loc"]) for d in detail} == {("body", "prompt"), ("body", "colour")}
    assert all(isinstance(d["msg"], str) and d["msg"] and isinstance(d["type"], str) for d in detail)
    return response


def _backlog_full(rig: Rig) -> requests.Response:
    c = rig.caller(max_queued=1)
    with saturated(rig.stack):
        waiting = c.submit_ok(FLUX, _flux("the one that waits"))
        assert c.status_body(FLUX, waiting)["status"] == "IN_QUEUE"
        before = sequence(rig.services, "bfl")
        response = c.submit(FLUX, _flux("one too many"))
        assert sequence(rig.services, "bfl") == before, "the refused submit was admitted"
        row = workspace(rig.services, c.workspace)
        assert (row.queued, row.held) == (1, price(rig.services, FLUX)), row
        assert c.cancel(FLUX, waiting).status_code == 202
    return response


def _rate_limited(rig: Rig) -> requests.Response:
    c = rig.caller(rate_limit="1/minute")
    request_id = c.submit_ok(FLUX, _flux("the one call allowed"))
    return c.status(FLUX, request_id)  # a poll counts like any call


ROWS = {
    "400-not-json": Row(400, "invalid_input", _not_json, refusal=True),
    "400-not-an-object": Row(400, "invalid_input", _not_an_object, refusal=True),
    "401-no-key": Row(401, "unauthorized", _no_key),
    "401-unknown-key": Row(401, "unauthorized", _unknown_key),
    "402-insufficient-credits": Row(402, "insufficient_credits", _unfunded, refusal=True),
    "403-workspace-off": Row(403, "not_enabled", _workspace_off, refusal=True),
    "403-legacy-key": Row(403, "not_enabled", _legacy_key),
    "403-byok-api-key": Row(403, "not_enabled", _byok("X-Provider-Api-Key"), refusal=True),
    "403-byok-authorization": Row(403, "not_enabled", _byok("X-Provider-Authorization"), refusal=True),
    "404-model-not-found": Row(404, "model_not_found", _unknown_model, refusal=True),
    "404-request-not-found": Row(404, "request_not_found", _unknown_request),
    "409-key-conflict": Row(409, "invalid_input", _key_conflict),
    "409-already-completed": Row(409, "already_completed", _cancel_finished),
    "409-cancelled": Row(409, "cancelled", _result_of_cancelled),
    "410-gone": Row(410, None, _past_retention),
    "413-too-large": Row(413, "invalid_input", _too_large, refusal=True),
    "422-schema": Row(422, "invalid_input", _schema, refusal=True),
    "429-queue-backlog-full": Row(429, "queue_backlog_full", _backlog_full, retry_after=True),
    "429-rate-limited": Row(429, "rate_limited", _rate_limited, retry_after=True),
}


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_error_table_row(rig: Rig, row: Row) -> None:
    response = row.make(rig)

    if row.bucket is None:  # 410: no bucket anywhere
        assert response.status_code == row.status, (response.status_code, response.text)
        assert "X-Comfy-Error-Type" not in response.headers
        assert response.headers.get("X-Comfy-Request-Id")
        assert "error_type" not in response.json()
    elif row.bucket == "already_completed":  # a status body, not an error body
        assert response.status_code == row.status
        assert response.headers.get("X-Comfy-Error-Type", "already_completed") == "already_completed"
        assert response.json()["status"] == "ALREADY_COMPLETED"
    else:
        assert_error(response, row.status, row.bucket, retry_after_expected=row.retry_after)
    if row.retry_after:
        assert retry_after(response) <= 60
    if row.refusal:
        _nothing_admitted(rig.services, rig.callers[-1].workspace)


# -- 4. refusals leave the key free -----------------------------------------------------------------


def _refuse_unfunded(rig: Rig, key: str) -> tuple[ApiClient, requests.Response, Callable[[], None]]:
    c = rig.caller(credits=price(rig.services, FLUX) - 1)
    refused = c.submit(FLUX, _flux("unfunded"), headers={"Idempotency-Key": key})
    return c, refused, lambda: rig.services.accounts.set_credits(c.workspace, price(rig.services, FLUX))


def _refuse_byok(rig: Rig, key: str) -> tuple[ApiClient, requests.Response, Callable[[], None]]:
    c = rig.caller()
    return c, c.submit(FLUX, _flux("byok"), headers={"Idempotency-Key": key, "X-Provider-Api-Key": "sk"}), \
        lambda: None


def _refuse_schema(rig: Rig, key: str) -> tuple[ApiClient, requests.Response, Callable[[], None]]:
    c = rig.caller()
    return c, c.submit(FLUX, {"prompt": 5}, headers={"Idempotency-Key": key}), lambda: None


def _refuse_rate(rig: Rig, key: str) -> tuple[ApiClient, requests.Response, Callable[[], None]]:
    c = rig.caller(rate_limit="2 per 2 seconds")
    for _ in range(2):  # spend the window's allowance
        assert c.status(FLUX, str(uuid.uuid4())).status_code == 404
    refused = c.submit(FLUX, _flux("too fast"), headers={"Idempotency-Key": key})

    def next_window() -> None:
        assert retry_after(refused) <= 2
        wait_for(lambda: not rate_counters(rig.services, c.workspace), timeout_s=5, interval_s=0.05,
                 what="the rate window over")
    return c, refused, next_window


REFUSALS = {
    "402": (402, "insufficient_credits", _refuse_unfunded),
    "403-byok": (403, "not_enabled", _refuse_byok),
    "422": (422, "invalid_input", _refuse_schema),
    "429-rate-limited": (429, "rate_limited", _refuse_rate),
}


@pytest.mark.parametrize(("status", "bucket", "refuse"), list(REFUSALS.values()), ids=list(REFUSALS))
def test_a_refused_submit_leaves_its_key_free(rig: Rig, status: int, bucket: str, refuse) -> None:
    key = f"retry-me-{uuid.uuid4()}"
    caller, refused, fix = refuse(rig, key)
    assert_error(refused, status, bucket, retry_after_expected=None)
    assert not rig.services.redis.exists(idempotency_key_name(caller.workspace, key))

    fix()
    body = _flux("valid at last")
    accepted = caller.submit(FLUX, body, headers={"Idempotency-Key": key})

    assert accepted.status_code == 201, accepted.text
    assert "Idempotent-Replayed" not in accepted.headers
    again = caller.submit(FLUX, body, headers={"Idempotency-Key": key})
    assert again.status_code == 201 and again.headers.get("Idempotent-Replayed") == "true"
    assert again.json()["request_id"] == accepted.json()["request_id"]


def test_a_full_backlog_leaves_the_key_free(rig: Rig) -> None:
    key = f"backlog-{uuid.uuid4()}"
    c = rig.caller(max_queued=1)
    body = _flux("waits for room")
    with saturated(rig.stack):
        waiting = c.submit_ok(FLUX, _flux("fills the backlog"))
        refused = c.submit(FLUX, body, headers={"Idempotency-Key": key})
        assert_error(refused, 429, "queue_backlog_full", retry_after_expected=True)
        assert not rig.services.redis.exists(idempotency_key_name(c.workspace, key))

        assert c.cancel(FLUX, waiting).status_code == 202  # room again
        accepted = c.submit(FLUX, body, headers={"Idempotency-Key": key})

        assert accepted.status_code == 201, accepted.text
        assert "Idempotent-Replayed" not in accepted.headers
        assert c.cancel(FLUX, accepted.json()["request_id"]).status_code == 202


# -- 5. billing through real workers ---------------------------------------------------------------


@pytest.mark.parametrize(("model", "body", "error_type", "settled"), [
    (FLUX, lambda: _flux("billed success"), None, "charge"),
    (TTS, lambda: _tts("billed speech"), None, "charge"),
    (FLUX, lambda: _flux("refused, free", "[stub:refuse]"), "content_policy_violation", "release"),
    (GEMINI, lambda: _gemini("refused, billed", "[stub:refuse]"), "content_policy_violation", "charge"),
], ids=["flux-success", "tts-success", "flux-refusal-released", "gemini-refusal-charged"])
def test_billing_through_the_workers(stack, services, model: str, body, error_type: str | None,
                                     settled: str) -> None:
    cost, start = price(services, model), 1_000
    entry = services.catalog.by_id(model)
    if error_type == "content_policy_violation":  # the catalog says who pays for a refusal
        assert entry.charges_on_policy_rejection is (settled == "charge")
    with make_caller(stack, "billing", credits=start) as caller:
        request_id = caller.submit_ok(model, body())
        final = caller.wait_status(model, request_id)

        assert final.get("error_type") == error_type
        assert settlements(ledger(services, caller.workspace)) == {request_id: [("hold", cost), (settled, cost)]}
        row = workspace(services, caller.workspace)
        expected = start - cost if settled == "charge" else start
        assert (row.credits, row.held, row.queued) == (expected, 0, 0), row
        assert ledger(services, caller.workspace)[-1].balance == expected
        charged = services.redis.hget(keys.request(request_id), "charged")
        assert (int(charged) if charged else 0) == (cost if settled == "charge" else 0)


def test_cancelled_requests_are_released(stack, services) -> None:
    cost, start = price(services, FLUX), 1_000
    with make_caller(stack, "billing-cancel", credits=start) as caller:
        running = caller.submit_ok(FLUX, _flux("cancelled while running", "[stub:latency=30]"))
        caller.wait_status(FLUX, running, "IN_PROGRESS")
        with saturated(stack, threads=WORKER_CONCURRENCY - 1):  # the last thread runs `running`
            queued = caller.submit_ok(FLUX, _flux("cancelled while queued"))
            assert caller.status_body(FLUX, queued)["status"] == "IN_QUEUE"
            assert workspace(services, caller.workspace).held == 2 * cost
            assert caller.cancel(FLUX, queued).status_code == 202
            assert caller.cancel(FLUX, running).status_code == 202
            assert caller.status_body(FLUX, queued)["error_type"] == "cancelled"  # at once
        assert caller.wait_status(FLUX, running, timeout_s=10)["error_type"] == "cancelled"

        assert settlements(ledger(services, caller.workspace)) == {
            running: [("hold", cost), ("release", cost)], queued: [("hold", cost), ("release", cost)]}
        row = workspace(services, caller.workspace)
        assert (row.credits, row.held, row.queued) == (start, 0, 0), row


# -- the rate limit, across gunicorn's processes -------------------------------------------------


def test_the_rate_limit_holds_across_front_door_processes(stack, services) -> None:
    allowance = 10
    # A minute-long window: the whole burst lands in it, so the count is exact.
    with make_caller(stack, "rate", rate_limit=f"{allowance}/minute") as caller:
        first = _post(caller.session, caller, TTS, _tts("first call"))  # 1 of the allowance
        assert first.status_code == 201, first.text
        request_id = first.json()["request_id"]
        policy = f'"minute";q={allowance};w=60'
        assert (first.headers["RateLimit-Policy"], _left(first)[0]) == (policy, allowance - 1)

        def call(session: requests.Session, i: int) -> requests.Response:
            if i % 3 == 0:
                return _post(session, caller, TTS, _tts(f"burst {i}"))
            route = "/status" if i % 3 == 1 else ""
            return session.get(caller.url(TTS, request_id, route), headers=caller.headers(), timeout=30)

        answers = fan_out(call, 90)

        assert_no_5xx(answers)
        passed = [a for a in answers if a.status_code < 400]
        assert len(passed) == allowance - 1, Counter(a.status_code for a in answers)
        for limited in (a for a in answers if a.status_code >= 400):
            assert_error(limited, 429, "rate_limited", retry_after_expected=True)
            assert retry_after(limited) <= 60
            assert limited.headers["RateLimit-Policy"] == policy and _left(limited) == (0, retry_after(limited))
        # Each answer let through says what its own count left: one count each, whichever process answered.
        assert {a.headers["RateLimit-Policy"] for a in passed} == {policy}
        assert sorted(_left(a)[0] for a in passed) == list(range(allowance - 1))
        # A limited submit queued nothing: the holds are the first call plus the submits that passed.
        submitted = [a for a in passed if a.request.method == "POST"]
        holds = [e for e in ledger(services, caller.workspace) if e.type == "hold"]
        assert len(holds) == 1 + len(submitted)


def _left(answer: requests.Response) -> tuple[int, int]:
    """A one-window RateLimit field's calls left and seconds to the window's reset."""
    name, remaining, reset = answer.headers["RateLimit"].split(";")
    assert name == '"minute"' and remaining.startswith("r=") and reset.startswith("t="), answer.headers["RateLimit"]
    return int(remaining[2:]), int(reset[2:])


def test_the_rate_limited_retry_after_covers_the_rest_of_the_window(stack, services) -> None:
    with make_caller(stack, "rate-hint", rate_limit="1 per 2 seconds") as caller:
        assert caller.status(FLUX, str(uuid.uuid4())).status_code == 404  # the window's one call
        counter = wait_for(lambda: rate_counters(services, caller.workspace), what="the window's counter")[0]
        wait_for(lambda: services.redis.pttl(counter) <= 1_450, interval_s=0.01, what="0.55 s into the window")

        limited = caller.status(FLUX, str(uuid.uuid4()))
        left_ms = services.redis.pttl(counter)

        assert_error(limited, 429, "rate_limited", retry_after_expected=True)
        assert retry_after(limited) * 1000 >= left_ms, (retry_after(limited), left_ms)


# -- bad input never reaches a worker --------------------------------------------------------------


def _raw(data: bytes | Any, headers: dict[str, str] | None = None):
    def send(c: ApiClient) -> requests.Response:
        return c.session.post(c.url(FLUX), data=data, headers=c.headers({"Content-Type": JSON, **(headers or {})}),
                              timeout=10)
    return send


def _chunked_over_limit() -> Any:
    yield json.dumps({"prompt": "padded"}).encode()
    for _ in range(MAX_BODY_BYTES // 65536 + 1):  # past the limit in insignificant whitespace
        yield b" " * 65536


BAD_INPUT = {
    "413-content-length": (413, _raw(json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode())),
    "413-chunked": (413, lambda c: _raw(_chunked_over_limit())(c)),
    "400-broken-json": (400, _raw(b"{not json")),
    "400-empty": (400, _raw(b"")),
    "400-not-utf8": (400, _raw(b'{"prompt": "\xff\xfe"}')),
    "400-array": (400, _raw(b'[{"prompt": "x"}]')),
    "400-null": (400, _raw(b"null")),
    "422-missing-field": (422, _raw(b"{}")),
    "422-wrong-type": (422, _raw(b'{"prompt": ["x"]}')),
    "422-too-long": (422, _raw(json.dumps({"prompt": "x" * 10_001}).encode())),
    "400-key-too-long": (400, _raw(b'{"prompt": "x"}', {"Idempotency-Key": "k" * 256})),
    "400-key-empty": (400, _raw(b'{"prompt": "x"}', {"Idempotency-Key": ""})),
    "400-key-not-ascii": (400, _raw(b'{"prompt": "x"}', {"Idempotency-Key": "cl\u00e9"})),
}


@pytest.mark.parametrize(("status", "send"), list(BAD_INPUT.values()), ids=list(BAD_INPUT))
def test_bad_input_is_refused_before_any_worker(rig: Rig, status: int, send) -> None:
    caller = rig.caller()
    before = sequence(rig.services, "bfl")

    response = send(caller)

    body = assert_error(response, status, "invalid_input")
    if status == 422:
        assert all({"loc", "msg", "type"} <= d.keys() for d in body["detail"]), body
    else:
        assert isinstance(body["detail"], str)
    assert sequence(rig.services, "bfl") == before, "a refused body was admitted"
    _nothing_admitted(rig.services, caller.workspace)
    assert list(rig.services.redis.scan_iter(match=keys.idempotency(caller.workspace, "*"))) == []


def test_a_key_of_255_characters_is_accepted(rig: Rig) -> None:
    caller = rig.caller()
    accepted = caller.submit(FLUX, _flux("long key"), headers={"Idempotency-Key": "k" * 255})
    assert accepted.status_code == 201, accepted.text


ODD_IDS = {
    "long": "a" * 2000,
    "word": "not-a-request-id",
    "uuid4": "0b7e8a58-35b0-4a3e-9c1f-2f6f4e0f8a11",
    "dots": "%2E%2E",  # encoded, or the client itself resolves the dot segment
    "nul": "%00",
    "unicode": "%E2%9C%93",
}


@pytest.mark.parametrize("odd", list(ODD_IDS.values()), ids=list(ODD_IDS))
def test_odd_request_ids_are_request_not_found(rig: Rig, odd: str) -> None:
    caller, other = rig.caller(), rig.caller()
    real = caller.submit_ok(FLUX, _flux("the real one"))
    ids = {"odd": odd, "upper-cased real": real.upper(), "real plus a char": real + "0", "real, short": real[:-1]}
    bodies = set()
    for name, request_id in ids.items():
        for route in (caller.status, caller.result, caller.cancel, other.status):
            response = route(FLUX, request_id)
            assert_error(response, 404, "request_not_found")
            bodies.add(response.content)
    assert len(bodies) == 1, bodies


@pytest.mark.parametrize("raw", [b"[" * 200_000, b'{"prompt": "x", "seed": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"],
                         ids=["deep-array", "deep-inside-an-object"])
def test_a_body_nested_too_deep_is_400(rig: Rig, raw: bytes) -> None:
    caller = rig.caller()
    before = sequence(rig.services, "bfl")
    response = _raw(raw)(caller)
    assert_error(response, 400, "invalid_input")
    assert sequence(rig.services, "bfl") == before
    _nothing_admitted(rig.services, caller.workspace)


def test_a_utf16_body_is_no_5xx(rig: Rig) -> None:
    caller = rig.caller()
    before = sequence(rig.services, "bfl")

    response = _raw(json.dumps({"prompt": unique_prompt("utf-16")}).encode("utf-16"))(caller)

    assert response.status_code in (201, 400), (response.status_code, response.text)
    if response.status_code == 400:  # refusing non-UTF-8 JSON (RFC 8259 8.1) is fine too
        assert_error(response, 400, "invalid_input")
        assert sequence(rig.services, "bfl") == before
        _nothing_admitted(rig.services, caller.workspace)


def test_a_lone_surrogate_escape_with_an_idempotency_key_is_no_5xx(rig: Rig) -> None:
    caller = rig.caller()
    raw = b'{"prompt": "lone surrogate \\ud800 ' + uuid.uuid4().hex.encode() + b'"}'
    without_key = _raw(raw)(caller)
    assert without_key.status_code == 201, without_key.text  # the body itself is accepted

    with_key = _raw(raw, {"Idempotency-Key": "surrogate"})(caller)

    assert with_key.status_code == 201, (with_key.status_code, with_key.text)
    replay = _raw(raw, {"Idempotency-Key": "surrogate"})(caller)
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert replay.json()["request_id"] == with_key.json()["request_id"]


def test_an_id_holding_an_encoded_slash_is_request_not_found(rig: Rig) -> None:
    caller = rig.caller()
    for route in (caller.status, caller.result, caller.cancel):
        assert_error(route(FLUX, "..%2F..%2Fetc"), 404, "request_not_found")


@pytest.mark.parametrize("case", ["request-id-5000-chars", "idempotency-key-9000-chars"])
def test_over_long_ids_and_keys_reach_the_app_and_get_contract_errors(rig: Rig, case: str) -> None:
    caller = rig.caller()
    if case.startswith("request-id"):
        assert_error(caller.status(FLUX, "a" * 5000), 404, "request_not_found")
    else:
        assert_error(caller.submit(FLUX, _flux("huge key"), headers={"Idempotency-Key": "k" * 9000}), 400,
                     "invalid_input")
    _nothing_admitted(rig.services, caller.workspace)


def _raw_exchange(base_url: str, request: bytes) -> tuple[str, dict[str, str], bytes]:
    """Send bytes no HTTP client would and read the answer until the server
    closes: its status line, its headers (lower-cased names) and its body."""
    with socket.create_connection((urlsplit(base_url).hostname, urlsplit(base_url).port), timeout=10) as raw:
        raw.sendall(request)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return lines[0], {name.lower(): value for name, _, value in (line.partition(": ") for line in lines[1:])}, body


def test_what_gunicorn_refuses_before_the_app_is_still_a_contract_error(rig: Rig) -> None:
    """Past the server's line limits, and for a header that is not HTTP, the
    worker class answers instead of the app, in the same shape."""
    caller = rig.caller()
    assert_error(caller.status(FLUX, "a" * 9000), 414, "invalid_input")
    assert_error(caller.submit(FLUX, _flux("huge key"), headers={"Idempotency-Key": "k" * 20_000}), 431,
                 "invalid_input")

    status_line, headers, body = _raw_exchange(caller.base_url,
                                               b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo-Colon-Here\r\n\r\n")
    assert status_line.startswith("HTTP/1.1 400 "), (status_line, body[:300])
    assert headers["content-type"] == "application/json" and headers["x-comfy-error-type"] == "invalid_input"
    assert headers["x-comfy-request-id"] and json.loads(body)["error_type"] == "invalid_input"
    _nothing_admitted(rig.services, caller.workspace)


def test_a_malformed_chunked_body_is_invalid_input_and_admits_nothing(rig: Rig) -> None:
    caller = rig.caller()
    request = (f"POST /v2/models/{FLUX}/requests HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {caller.api_key}\r\n"
               "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               "zz\r\n{\"prompt\": \"x\"}\r\n0\r\n\r\n").encode()
    status_line, headers, body = _raw_exchange(caller.base_url, request)
    assert status_line.startswith("HTTP/1.1 400 "), (status_line, body[:300])
    assert headers["x-comfy-error-type"] == "invalid_input" and headers["x-comfy-request-id"]
    assert "InvalidChunkSize" in json.loads(body)["detail"]
    _nothing_admitted(rig.services, caller.workspace)


# -- 6. security -----------------------------------------------------------------------------------


def test_api_keys_are_stored_only_as_hashes(stack, services) -> None:
    with make_caller(stack, "hashed") as caller:
        request_id = caller.submit_ok(FLUX, _flux("hashing"), headers={"Idempotency-Key": "hash-me"})
        caller.wait_status(FLUX, request_id)
        legacy = services.accounts.mint_legacy_key()
        assert requests.get(caller.url(FLUX, request_id, "/status"), headers={"Authorization": f"Bearer {legacy}"},
                            timeout=10).status_code == 403

        for raw in (caller.api_key, legacy):
            token = raw.removeprefix("rq_").encode()
            assert redis_occurrences(services.redis, token) == [], "a raw API key is stored in Redis"
            digest = hashlib.sha256(raw.encode()).hexdigest()
            assert services.redis.exists(keys.api_key(digest))
        assert services.redis.get(keys.api_key(hashlib.sha256(caller.api_key.encode()).hexdigest())).decode() \
            == caller.workspace
        for name in ("web", "worker"):
            assert caller.api_key not in stack.log_text(name), f"the key is in the {name} log"


def test_request_ids_are_unique_and_not_sequential(stack, services) -> None:
    with make_caller(stack, "ids") as caller, saturated(stack):  # nothing runs: the test stays quick
        answers = fan_out(lambda s, i: _post(s, caller, TTS, _tts(f"id {i}")), 1000)
        assert [a.status_code for a in answers] == [201] * 1000
        ids = [a.json()["request_id"] for a in answers]
        for request_id in ids:  # clean-up, straight through the store
            services.store.cancel(request_id=request_id, workspace=caller.workspace, model=TTS, provider="openai")

    assert all(ID_PATTERN.match(i) for i in ids)
    assert len(set(ids)) == 1000
    assert len({i.replace("-", "")[:12] for i in ids}) == 1000  # 48 random leading bits, no collision
    numbers = [uuid.UUID(i).int for i in ids]
    ascending = sum(b > a for a, b in zip(numbers, numbers[1:]))
    assert 350 < ascending < 650, f"{ascending} of 999 neighbours ascend: an order shows through"
    ordered = sorted(numbers)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 2 ** 80, "two ids lie next to each other"
    wait_for(lambda: broker_drained(services, "openai"), timeout_s=30, what="the cancelled deliveries dropped")


def test_another_workspaces_id_is_indistinguishable_from_an_unknown_one(rig: Rig) -> None:
    owner, stranger = rig.caller("owner"), rig.caller("stranger")
    request_id = owner.submit_ok(FLUX, _flux("mine", "[stub:latency=1]"))
    unknown = rig.services.ids.mint("ws_nobody", FLUX)

    for route in ("status", "result", "cancel"):
        theirs = getattr(stranger, route)(FLUX, request_id)
        never = getattr(stranger, route)(FLUX, unknown)
        assert_error(theirs, 404, "request_not_found")
        assert theirs.content == never.content
        assert theirs.status_code == never.status_code
        # each call's own: its id, its date, and the caller's window after it was counted (one more spent)
        own = ("X-Comfy-Request-Id", "Date", "RateLimit")
        same_headers = {k: v for k, v in theirs.headers.items() if k not in own}
        assert same_headers == {k: v for k, v in never.headers.items() if k not in own}
        assert theirs.headers["RateLimit"].startswith('"second";r=') and never.headers["RateLimit"].startswith(
            '"second";r=')

    final = owner.wait_status(FLUX, request_id)
    assert "error_type" not in final  # the stranger's cancel changed nothing
