"""Request history and cost against the real stack (gunicorn, Celery workers,
the stub provider, Redis): a workspace lists its own requests, filtered and a
page at a time, another workspace sees none of them, and each request's cost
agrees with the ledger after a success, a cancel in the queue and a provider
failure."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from .harness import FLUX, TTS, ApiClient, RunningStack, ledger_by_request, make_caller, saturated_worker, unique_prompt

#: What each ledger history means for the cost: held until the charge or the release.
LEDGER_STATE = {("hold",): "held", ("hold", "charge"): "charged", ("hold", "release"): "released"}


def listing(caller: ApiClient, path: str = "/v2/requests", **query: Any) -> dict[str, Any]:
    response = caller.session.get(f"{caller.base_url}{path}", params=query, headers=caller.headers(), timeout=10)
    assert response.status_code == 200, (response.status_code, response.text)
    return response.json()


def every_page(caller: ApiClient, **query: Any) -> tuple[list[dict[str, Any]], int]:
    entries, pages, cursor = [], 0, None
    while True:
        body = listing(caller, **query, **({"cursor": cursor} if cursor else {}))
        entries += body["requests"]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            return entries, pages


def iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def test_history_and_cost_agree_with_the_ledger(stack: RunningStack, caller: ApiClient,
                                                other_caller: ApiClient) -> None:
    started = datetime.now(timezone.utc) - timedelta(seconds=1)
    succeeded = [caller.submit_ok(FLUX, {"prompt": unique_prompt("history ok", "[stub:latency=0]")})
                 for _ in range(3)]
    failed = caller.submit_ok(FLUX, {"prompt": unique_prompt("history fails", "[stub:status=500]")})
    speech = caller.submit_ok(TTS, {"input": unique_prompt("history speech"), "voice": "alloy"})
    for request_id in (*succeeded, failed):
        caller.wait_status(FLUX, request_id)
    caller.wait_status(TTS, speech)
    with saturated_worker(other_caller):
        cancelled = caller.submit_ok(FLUX, {"prompt": unique_prompt("history cancelled", "[stub:latency=0]")})
        assert caller.status_body(FLUX, cancelled)["status"] == "IN_QUEUE"
        assert caller.cancel(FLUX, cancelled).status_code == 202
    submitted = [*succeeded, failed, speech, cancelled]

    # newest first, all of them, each entry its status body with the model
    entries, pages = every_page(caller, limit=2)
    assert [e["request_id"] for e in entries] == submitted[::-1] and pages == 3
    for entry in entries:
        model = TTS if entry["request_id"] == speech else FLUX
        assert entry == {**caller.status_body(model, entry["request_id"]), "model": model}

    # filters
    def ids(**query: Any) -> list[str]:
        return [e["request_id"] for e in every_page(caller, **query)[0]]

    assert ids(error_type="provider_error") == [failed]
    assert ids(error_type="cancelled") == [cancelled]
    assert ids(status="COMPLETED", model=TTS) == [speech]
    assert ids(status="IN_PROGRESS") == []
    assert [e["request_id"] for e in listing(caller, f"/v2/models/{FLUX}/requests", limit=100)["requests"]] == \
        [cancelled, failed, *succeeded[::-1]]
    assert ids(since=iso(started), until=iso(datetime.now(timezone.utc) + timedelta(seconds=5))) == submitted[::-1]
    assert ids(since=iso(datetime.now(timezone.utc) + timedelta(seconds=5))) == []

    # another workspace sees none of them
    assert not set(submitted) & set(e["request_id"] for e in every_page(other_caller, limit=100)[0])
    with make_caller(stack, "history-stranger") as stranger:
        assert listing(stranger) == {"requests": [], "next_cursor": None}
        assert listing(stranger, f"/v2/models/{FLUX}/requests") == {"requests": [], "next_cursor": None}

    # a bad filter is 400 invalid_input
    bad = caller.session.get(f"{caller.base_url}/v2/requests", params={"status": "DONE"}, headers=caller.headers(),
                             timeout=10)
    assert (bad.status_code, bad.json()["error_type"]) == (400, "invalid_input")

    # cost: what the quote said was held, then charged or released as the ledger has it
    quote = caller.session.get(f"{caller.base_url}/v2/models/{FLUX}/cost", headers=caller.headers(), timeout=10)
    assert quote.status_code == 200 and quote.json()["model"] == FLUX
    ledger = ledger_by_request(stack.services, caller.workspace)
    expected = {**{r: "charged" for r in succeeded}, speech: "charged", failed: "released", cancelled: "released"}
    amounts = {e.request_id: e.amount for e in stack.services.accounts.ledger(caller.workspace) if e.type == "hold"}
    for entry in entries:
        request_id = entry["request_id"]
        assert entry["cost"]["state"] == expected[request_id] == LEDGER_STATE[tuple(ledger[request_id])], request_id
        assert entry["cost"]["credits"] == amounts[request_id]
        model = TTS if request_id == speech else FLUX
        result = caller.result(model, request_id)
        assert result.headers["X-Comfy-Cost-State"] == expected[request_id]
        assert result.headers["X-Comfy-Cost-Credits"] == str(amounts[request_id])
    assert amounts[succeeded[0]] == quote.json()["credits"]
