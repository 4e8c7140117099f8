"""A request's fields, declared once (``requests/record.py``): what admission
writes is what was submitted, what the declaration shows on status is on the
status body (and nothing it hides), what it lists on webhook events is in
their bodies, and the Lua the scripts run names the same fields (fakeredis
and a real Redis)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from router_queue.requests import record
from router_queue.requests.record import (
    ADMITTED,
    FIELDS,
    HIDDEN,
    LISTED,
    OPTIONAL_TIME,
    READ_NAMES,
    STATUS_LISTED,
    Cost,
    Field,
    RequestRecord,
    Submission,
    iso,
)
from router_queue.requests.values import Lease
from router_queue.store.admission import ADMIT_ARGS, SPLIT_ADMIT_ARGS
from router_queue.store.scripts import lib_for
from router_queue.web.bodies import status_body
from router_queue.webhooks import event as webhook_event
from tests.unit.route_support import FLUX, submit
from tests.unit.support import record_of

MODEL, PROVIDER = "bfl/flux-2-pro", "bfl"
BUILD = "return {ADMITTED_FIELDS, WEBHOOK_LISTED, SNAPSHOT_PREFIX}"


def test_the_scripts_write_and_snapshot_the_fields_the_declaration_names(client):
    admitted, listed, prefix = client.register_script(lib_for(BUILD) + BUILD)()
    assert [name.decode() for name in admitted] == [f.name for f in ADMITTED]
    assert [name.decode() for name in listed] == [f.name for f in record.WEBHOOK_LISTED]
    assert prefix.decode() == record.SNAPSHOT_PREFIX
    # place_admission reads the admitted fields as ARGV[1..], in this order, on one Redis and split
    for args in (ADMIT_ARGS, SPLIT_ADMIT_ARGS):
        assert args[:len(ADMITTED)] == tuple(f.name for f in ADMITTED)


def _fail(services, request_id: str) -> None:
    services.store.claim(record_of(services, request_id, PROVIDER), Lease("t", 30, 3600, 3))
    services.store.complete(record_of(services, request_id, PROVIDER), error_type="provider_error", detail="no")


def test_every_field_admission_carries_is_on_the_record_as_submitted(services, workspace):
    original = services.ids.mint(workspace, MODEL)
    assert services.store.admit(Submission(request_id=original, workspace=workspace, model=MODEL,
                                           provider=PROVIDER, body="{}")).outcome == "ADMITTED"
    _fail(services, original)
    submitted = Submission(request_id=services.ids.mint(workspace, MODEL), workspace=workspace, model=MODEL,
                           provider=PROVIDER, body="", priority="high", retry_of=original,
                           start_deadline_at=1_900_000_000.25, deadline_at=1_900_000_100.5,
                           traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                           batch_id="b-1", line=7, metadata={"sku": "A-17"}, bulk_id="b" * 24,
                           key_id="key_0123456789abcdef", fallback_models="bfl/flux-2-pro", model_price=39)
    assert {f.attribute for f in ADMITTED} <= {f.name for f in dataclasses.fields(Submission)}
    assert all(getattr(submitted, f.attribute) not in ("", None) for f in ADMITTED)  # every one is set here
    assert services.store.admit(submitted).outcome == "ADMITTED"
    read = services.store.status_view(submitted.request_id, PROVIDER).record
    stored, _ = services.store.dump(submitted.request_id)
    for f in ADMITTED:
        if f.name in READ_NAMES:
            assert getattr(read, f.name) == getattr(submitted, f.attribute), f.name
        assert stored[f.name] == f.codec.encode(getattr(submitted, f.attribute)), f.name
    # one not asked for is not written at all
    plain = Submission(request_id=services.ids.mint(workspace, MODEL), workspace=workspace, model=MODEL,
                       provider=PROVIDER, body="{}")
    services.store.admit(plain)
    assert not {"retry_of", "start_deadline_at", "deadline_at", "traceparent", "bulk_id", "key_id"} & set(
        services.store.dump(plain.request_id)[0])


def _every_field_set() -> RequestRecord:
    """A failed request whose record has every field a value."""
    return RequestRecord(
        id="r1", workspace="ws", model=MODEL, provider=PROVIDER, status="COMPLETED", created_at=1_700_000_000.0,
        started_at=1_700_000_001.0, completed_at=1_700_000_002.0, error_type="provider_error", detail="no",
        content_type="application/json", cancel_requested=True, attempts=2, upstream_ref='{"id": "u"}', ttl_s=60,
        progress=0.5, webhook_url="https://hooks.example.com/secret-path", start_deadline_at=1_700_000_100.0,
        deadline_at=1_700_000_200.0, retry_of="r0", batch_id="b-1", line=3, metadata={"sku": "A-17"}, bulk_id="bk1",
        fallback_models="bfl/flux-2-pro", model_price=39, model_ran="bfl/flux-2-pro",
        tried=[{"model": MODEL, "member": "default", "error_type": "rate_limited"}], cost=Cost(60, "released"))


def test_the_status_body_shows_what_the_declaration_shows_on_status_and_nothing_it_hides():
    full = _every_field_set()
    body = status_body(full, None, "http://router.test", 3600)
    for f in FIELDS:
        shown = f.into or f.name
        if f.status == HIDDEN:
            assert shown not in body, f.name
        else:
            assert shown in body, f.name
    for f in STATUS_LISTED:
        assert body[f.name] == f.codec.show(getattr(full, f.name))
    assert not {"webhook_url", "upstream_ref", "attempts"} & set(body)  # never shown to the caller
    # a listed field not set is left out, not shown as null
    bare = dataclasses.replace(full, **{f.name: None for f in STATUS_LISTED})
    assert not {f.name for f in STATUS_LISTED} & set(status_body(bare, None, "http://router.test", 3600))


def test_a_record_read_decodes_each_field_and_a_missing_record_reads_none():
    assert RequestRecord.from_values([None] * len(READ_NAMES)) is None
    values = [None] * len(READ_NAMES)
    values[READ_NAMES.index("status")] = b"IN_QUEUE"
    values[READ_NAMES.index("retry_of")] = b"r0"
    values[READ_NAMES.index("deadline_at")] = b"1700000200.5"
    values[READ_NAMES.index("hold")] = b"60"
    read = RequestRecord.from_values(values, ttl=-1)
    assert read == RequestRecord(id="", workspace="", model="", provider="", status="IN_QUEUE", created_at=0.0,
                                 retry_of="r0", deadline_at=1_700_000_200.5, cost=Cost(60, "held"))


@pytest.fixture
def deadline_listed_on_events(monkeypatch):
    """The declaration as if deadline_at were listed on webhook events (no
    field is yet), set before the scripts are loaded."""
    listed = (Field("deadline_at", OPTIONAL_TIME, webhook=LISTED),)
    monkeypatch.setattr(record, "WEBHOOK_LISTED", listed)
    return listed


def test_a_field_listed_on_webhook_events_is_in_their_bodies_as_on_status(
        deadline_listed_on_events, http, auth, services, workspace, settings):
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    hook = {"X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook"}
    with_deadline = submit(http, auth, headers={**hook, "X-Comfy-Deadline": "60"}).json["request_id"]
    without = submit(http, auth, headers=hook).json["request_id"]
    for request_id in (with_deadline, without):
        _fail(services, request_id)
    status = http.get(f"{FLUX}/requests/{with_deadline}/status", headers=auth).json
    event = services.webhooks.take(with_deadline, now=1e12, lease_s=30, token="t").event
    assert event.listed == {"deadline_at": status["deadline_at"]}
    body = json.loads(webhook_event.event_body(
        request_id=event.request_id, model=event.model, status=event.status, error_type=event.error_type,
        response_url=event.response_url, created_at=event.created_at, started_at=event.started_at,
        completed_at=event.completed_at, cost=event.cost, listed=event.listed))
    assert body["deadline_at"] == status["deadline_at"] == iso(record_of(services, with_deadline,
                                                                          PROVIDER).deadline_at)
    assert services.webhooks.take(without, now=1e12, lease_s=30, token="t").event.listed == {}
