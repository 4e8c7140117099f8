"""A request's cost: held from its admission, then charged or released in the
same step as the ledger's entry, for every way a request ends; shown the same
in its status, the history, the webhook event and the result's headers; and
the model's quote is what admission holds (fakeredis and a real Redis)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from router_queue.store import keys
from router_queue.store.record import Cost, Submission
from router_queue.store.requests_values import Lease
from router_queue.webhooks import event as webhook_event
from tests.unit.route_support import FLUX, assert_error, submit
from tests.unit.support import record_of

MODEL = "bfl/flux-2-pro"


def lease(token="t", **kwargs):
    return Lease(token=token, **{"lease_s": 30, "queue_timeout_s": 3600, "max_takeovers": 3, **kwargs})


def price(services) -> int:
    return services.catalog.by_id(MODEL).price_credits


def ledger_cost(services, workspace, request_id) -> Cost:
    """What the ledger says of one request: held until a charge or release."""
    entries = [e for e in services.accounts.ledger(workspace) if e.request_id == request_id]
    assert entries and entries[0].type == "hold", entries
    state = {"hold": "held", "charge": "charged", "release": "released"}[entries[-1].type]
    assert len(entries) <= 2, entries
    return Cost(entries[0].amount, state)


def cost_of(services, request_id) -> Cost:
    return services.store.status_view(request_id, "bfl").record.cost


def start(services, request_id, **kwargs):
    services.store.claim(record_of(services, request_id, "bfl"), lease(**kwargs))


def succeed(services, request_id):
    start(services, request_id)
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")


def fail(services, request_id, *, billable=None, error_type="provider_error"):
    start(services, request_id)
    services.store.complete(record_of(services, request_id, "bfl"), error_type=error_type, detail="no",
                            billable=billable)


def cancel(services, request_id, workspace):
    services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")


def queue_timeout_by_sweeper(services, request_id, workspace):
    record = record_of(services, request_id, "bfl")
    assert services.store.expire_queued(request_id, "bfl", workspace, 0, now=record.created_at + 1)


def queue_timeout_at_claim(services, request_id, workspace):
    start(services, request_id, queue_timeout_s=-1)


def workers_kept_dying(services, request_id, workspace):
    start(services, request_id, token="a", max_takeovers=0)
    services.redis.hset(keys.request(request_id), "lease_until", 0)
    start(services, request_id, token="b", max_takeovers=0)


def cancel_while_running(services, request_id, workspace):
    start(services, request_id)
    cancel(services, request_id, workspace)
    services.store.complete(record_of(services, request_id, "bfl"), error_type="cancelled", detail="stopped",
                            billable=False)


ENDINGS = {
    "succeeded": (lambda s, r, w: succeed(s, r), "charged", None),
    "cancelled in the queue": (cancel, "released", "cancelled"),
    "cancelled while running": (cancel_while_running, "released", "cancelled"),
    "queue timeout (sweeper)": (queue_timeout_by_sweeper, "released", "queue_timeout"),
    "queue timeout (claim)": (queue_timeout_at_claim, "released", "queue_timeout"),
    "provider failure, unbilled": (lambda s, r, w: fail(s, r), "released", "provider_error"),
    "provider refusal the policy bills": (
        lambda s, r, w: fail(s, r, billable=True, error_type="content_policy_violation"),
        "charged", "content_policy_violation"),
    "workers kept dying": (workers_kept_dying, "released", "provider_error"),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_each_ending_settles_the_cost_as_the_ledger_does(http, auth, services, workspace, ending):
    end, state, error_type = ENDINGS[ending]
    request_id = submit(http, auth).json["request_id"]
    assert cost_of(services, request_id) == Cost(price(services), "held") == ledger_cost(services, workspace,
                                                                                       request_id)
    end(services, request_id, workspace)
    record = record_of(services, request_id, "bfl")
    assert (record.status, record.error_type) == ("COMPLETED", error_type)
    assert record.cost == Cost(price(services), state) == ledger_cost(services, workspace, request_id)
    # a second ending changes nothing, in the record or the ledger
    succeed_again = services.store.complete(record, output=b"{}", content_type="application/json")
    assert succeed_again == "ALREADY_COMPLETED"
    assert cost_of(services, request_id) == ledger_cost(services, workspace, request_id)
    # the status, the history and the result's headers say the same
    status = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json
    assert status["cost"] == {"credits": price(services), "state": state}
    assert http.get("/v2/requests", headers=auth).json["requests"][0]["cost"] == status["cost"]
    result = http.get(f"{FLUX}/requests/{request_id}", headers=auth)
    assert result.headers["X-Comfy-Cost-Credits"] == str(price(services))
    assert result.headers["X-Comfy-Cost-State"] == state
    assert result.headers.get("X-Comfy-Credits-Used") == (str(price(services)) if state == "charged" else None)


def test_a_pending_result_names_the_hold(http, auth, services):
    request_id = submit(http, auth).json["request_id"]
    pending = http.get(f"{FLUX}/requests/{request_id}", headers=auth)
    assert pending.status_code == 202
    assert (pending.headers["X-Comfy-Cost-State"], pending.json["cost"]["state"]) == ("held", "held")
    assert pending.headers["X-Comfy-Cost-Credits"] == str(price(services))


def test_a_free_request_is_charged_nothing_with_no_ledger_entry(services, workspace):
    request_id = services.ids.mint(workspace, MODEL)
    services.store.admit(Submission(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl", body="{}", price=0))
    assert cost_of(services, request_id) == Cost(0, "held")
    succeed(services, request_id)
    assert cost_of(services, request_id) == Cost(0, "charged")
    assert services.accounts.ledger(workspace) == []


def test_the_quote_is_what_admission_holds(http, auth, services, workspace):
    quote = http.get(f"{FLUX}/cost", headers=auth)
    assert quote.status_code == 200
    assert quote.json == {"model": MODEL, "credits": price(services)}
    request_id = submit(http, auth).json["request_id"]
    assert ledger_cost(services, workspace, request_id).credits == quote.json["credits"]
    assert_error(http.get(f"{FLUX}/cost"), 401, "unauthorized")
    assert_error(http.get("/v2/models/bfl/nope/cost", headers=auth), 404, "model_not_found")


def test_the_webhook_event_carries_the_settled_cost(http, auth, services, workspace, settings):
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    charged = submit(http, auth, headers={"X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook"}).json["request_id"]
    succeed(services, charged)
    released = submit(http, auth, headers={"X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook"}).json["request_id"]
    cancel(services, released, workspace)
    for request_id, state in ((charged, "charged"), (released, "released")):
        event = services.webhooks.take(request_id, now=1e12, lease_s=30, token="t").event
        assert event.cost == {"credits": price(services), "state": state}
        body = json.loads(webhook_event.event_body(request_id=event.request_id, model=event.model, status=event.status,
                                          error_type=event.error_type, response_url=event.response_url,
                                          created_at=event.created_at, started_at=event.started_at,
                                          completed_at=event.completed_at, cost=event.cost))
        assert body["cost"] == http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json["cost"]


def test_a_started_event_carries_the_hold(http, auth, services, workspace, settings):
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    request_id = submit(http, auth, headers={"X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook",
                                             "X-Comfy-Webhook-Events": "started,completed"}).json["request_id"]
    start(services, request_id)
    event = services.webhooks.take(request_id, now=1e12, lease_s=30, token="t").event
    assert (event.event, event.cost) == ("started", {"credits": price(services), "state": "held"})
