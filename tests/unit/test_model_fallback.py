"""Fallback between models (X-Comfy-Fallback-Models, docs/POOLS.md): the
header checked at submit, a 429's pause per model, and a request that runs
on the model it named once every member of its own model's pool kept it
waiting past FALLBACK_AFTER_SECONDS; without the header, none of it."""

from __future__ import annotations

import json
import time

import pytest
import requests

from router_queue.batches.drain import drain
from router_queue.catalog import Catalog
from router_queue.requests.record import Submission
from router_queue.services import Services
from router_queue.settings import DEFAULT_CATALOG
from router_queue.states import COMPLETED
from router_queue.store.members import MemberStore
from tests.pool_catalogs import LOCATIONS, pool_catalog, vertex_members
from tests.unit import delivery_support
from tests.unit.conftest import RecordingDispatcher
from tests.unit.fallback_support import NEW, OLD, deliver_for, gemini
from tests.unit.route_support import assert_error, status_of, submit

stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)

NEW_PATH = f"/v2/models/{NEW}"


@pytest.fixture
def vertex_pool(worker_services, tmp_path):
    """Vertex AI as a pool of two locations, fallbacks due after 5 s."""
    worker_services.catalog = Catalog.load(pool_catalog(tmp_path, members=vertex_members()))
    worker_services.model_fallback.after_s = 5.0
    return worker_services


def admitted(services, workspace, text, fallback=""):
    request_id = services.ids.mint(workspace, NEW)
    outcome = services.store.admit(Submission(request_id=request_id, workspace=workspace, model=NEW,
                                              provider="vertexai", body=json.dumps(gemini(text)), price=39,
                                              fallback_models=fallback))
    assert outcome.outcome == "ADMITTED"
    return request_id


def by_model(stub_origin):
    calls = requests.get(f"{stub_origin}/stub/calls").json()["by_key"]
    return {key.split(":", 1)[1]: n for key, n in calls.items() if key.startswith("vertex_model:")}


@pytest.mark.parametrize("header,complaint", [
    ("vertexai/gemini-9", "no model"),
    ("bfl/flux-2-pro", "takes Flux2ProInput"),
    (NEW, "is the model this request is for"),
    (f"{OLD},{OLD}", "twice"),
    (f"{OLD},", "separated by commas"),
    (",".join([OLD] * 4), "at most 3"),
])
def test_a_fallback_header_that_cannot_be_honoured_is_invalid_input_and_admits_nothing(http, auth, services, header,
                                                                                    complaint):
    refused = submit(http, auth, gemini("x"), path=NEW_PATH, headers={"X-Comfy-Fallback-Models": header})
    assert_error(refused, 400, "invalid_input")
    assert complaint in refused.json["detail"]
    assert services.store.queue_depth("vertexai") == 0


def charges(services, workspace):
    return [(e.request_id, e.amount, e.model) for e in services.accounts.ledger(workspace) if e.type == "charge"]


def test_a_dearer_fallback_is_held_and_the_model_that_ran_is_charged(http, auth, vertex_pool, workspace, tmp_path):
    # OLD dearer than the path's model (39)
    vertex_pool.catalog = Catalog.load(pool_catalog(tmp_path, members=vertex_members(), prices={OLD: 60}))
    accepted = submit(http, auth, gemini("x"), path=NEW_PATH, headers={"X-Comfy-Fallback-Models": OLD})
    assert accepted.status_code == 201, accepted.get_data(as_text=True)
    request_id = accepted.json["request_id"]
    assert status_of(http, auth, request_id, path=NEW_PATH)["cost"] == {"credits": 60, "state": "held"}
    assert vertex_pool.accounts.get(workspace).held == 60
    assert deliver_for(vertex_pool, request_id) == "completed"  # on its own model: no trouble
    assert status_of(http, auth, request_id, path=NEW_PATH)["cost"] == {"credits": 39, "state": "charged"}
    assert charges(vertex_pool, workspace) == [(request_id, 39, NEW)]
    after = vertex_pool.accounts.get(workspace)
    assert (after.credits, after.held) == (1000 - 39, 0)  # the rest of the hold went back


def test_a_cheaper_fallback_that_ran_is_charged_its_own_price(vertex_pool, workspace, tmp_path):
    vertex_pool.catalog = Catalog.load(pool_catalog(tmp_path, members=vertex_members(), prices={OLD: 20}))
    request_id = admitted(vertex_pool, workspace, "cat [stub:429_model=gemini-3.1-flash-image]", fallback=OLD)
    assert deliver_for(vertex_pool, request_id) == "completed"
    record = vertex_pool.store.status_view(request_id, "vertexai").record
    assert record.model_ran == OLD and record.cost.as_json() == {"credits": 20, "state": "charged"}
    assert charges(vertex_pool, workspace) == [(request_id, 20, OLD)]
    after = vertex_pool.accounts.get(workspace)
    assert (after.credits, after.held) == (1000 - 20, 0)


def test_a_split_store_charges_the_model_that_ran_and_gives_the_rest_back(client, vertex_pool, tmp_path):
    """On a Redis Cluster the workspace's side is its own step (ws_settle.lua): the same amounts."""
    split = Services.build(vertex_pool.settings, client, dispatcher=RecordingDispatcher(), split=True)
    split.catalog = Catalog.load(pool_catalog(tmp_path, members=vertex_members(), prices={OLD: 20}))
    split.model_fallback.after_s = 5.0
    workspace = split.accounts.create_workspace("split", queue_enabled=True, credits=1000)
    request_id = admitted(split, workspace, "cat [stub:429_model=gemini-3.1-flash-image]", fallback=OLD)
    assert split.accounts.get(workspace).held == 39
    assert deliver_for(split, request_id) == "completed"
    assert split.store.status_view(request_id, "vertexai").record.cost.as_json() == {"credits": 20, "state": "charged"}
    assert charges(split, workspace) == [(request_id, 20, OLD)]
    after = split.accounts.get(workspace)
    assert (after.credits, after.held) == (1000 - 20, 0)


def test_a_hold_the_workspace_cannot_cover_names_the_dearer_fallback(http, auth, services, workspace, tmp_path):
    services.catalog = Catalog.load(pool_catalog(tmp_path, prices={OLD: 60}))
    services.accounts.set_credits(workspace, 50)  # enough for the path's model (39), not for its fallback
    refused = submit(http, auth, gemini("x"), path=NEW_PATH, headers={"X-Comfy-Fallback-Models": OLD})
    assert_error(refused, 402, "insufficient_credits")
    assert "holds 60 credits" in refused.json["detail"]
    assert services.store.queue_depth("vertexai") == 0
    assert submit(http, auth, gemini("x"), path=NEW_PATH).status_code == 201  # without it, 39 fits


def test_an_accepted_header_is_kept_and_shows_nothing_until_a_fallback(http, auth, services):
    accepted = submit(http, auth, gemini("x"), path=NEW_PATH, headers={"X-Comfy-Fallback-Models": f" {OLD} "})
    assert accepted.status_code == 201, accepted.get_data(as_text=True)
    request_id = accepted.json["request_id"]
    assert services.store.status_view(request_id, "vertexai").record.fallback_models == OLD
    body = status_of(http, auth, request_id, path=NEW_PATH)
    assert "model_ran" not in body and "tried" not in body


def test_a_429_pauses_a_member_for_its_model_alone(client):
    pool = Catalog.load(DEFAULT_CATALOG).members("bfl")
    members = MemberStore(client)
    members.rate_limited("bfl", pool[0], retry_after_s=30, model=NEW)
    assert members.take("bfl", pool, "r1", hold_s=60, model=NEW).member is None
    assert members.take("bfl", pool, "r3", hold_s=60, model=OLD).member == "default"  # another model's quota
    members.rate_limited("bfl", pool[0], retry_after_s=30)  # a 429 naming no model pauses every one
    assert members.take("bfl", pool, "r4", hold_s=60, model=OLD).member is None


def test_a_model_429_everywhere_falls_back_after_the_wait_and_bills_once(vertex_pool, workspace, stub_origin):
    request_id = admitted(vertex_pool, workspace, "cat [stub:429_model=gemini-3.1-flash-image]", fallback=OLD)
    assert deliver_for(vertex_pool, request_id) == "completed"
    record = vertex_pool.store.status_view(request_id, "vertexai").record
    assert (record.status, record.error_type, record.attempts) == (COMPLETED, None, 0)
    assert record.model_ran == OLD and record.content_type == "application/json"
    assert len(record.tried) == 1 and record.tried[0]["model"] == NEW
    assert record.tried[0]["member"] in LOCATIONS and record.tried[0]["error_type"] == "rate_limited"
    calls = by_model(stub_origin)
    assert calls["gemini-2.5-flash-image"] == 1 and calls["gemini-3.1-flash-image"] >= 2  # both members asked
    charges = [e for e in vertex_pool.accounts.ledger(workspace) if e.type == "charge"]
    assert [(e.request_id, e.amount, e.model) for e in charges] == [(request_id, 39, OLD)]  # the model that ran


def test_without_the_header_a_model_429_everywhere_waits_as_before(vertex_pool, workspace, stub_origin):
    request_id = admitted(vertex_pool, workspace, "cat [stub:429_model=gemini-3.1-flash-image]")
    assert deliver_for(vertex_pool, request_id, seconds=30) is None  # still waiting on its pool
    record = vertex_pool.store.status_view(request_id, "vertexai").record
    assert (record.model_ran, record.tried, record.attempts) == (None, None, 0)
    assert "gemini-2.5-flash-image" not in by_model(stub_origin)


def test_a_start_deadline_sooner_than_the_wait_brings_the_fallback_forward(vertex_pool, workspace):
    vertex_pool.model_fallback.after_s = 1000.0
    request_id = vertex_pool.ids.mint(workspace, NEW)
    assert vertex_pool.store.admit(Submission(
        request_id=request_id, workspace=workspace, model=NEW, provider="vertexai", price=39, fallback_models=OLD,
        body=json.dumps(gemini("dog [stub:429_model=gemini-3.1-flash-image]")),
        start_deadline_at=time.time() + 20)).outcome == "ADMITTED"
    assert deliver_for(vertex_pool, request_id, seconds=100) == "completed"
    assert vertex_pool.store.status_view(request_id, "vertexai").record.model_ran == OLD


def test_a_fallback_that_fails_too_ends_as_the_request_would(vertex_pool, workspace, stub_origin):
    request_id = admitted(vertex_pool, workspace, "cat [stub:status=400]", fallback=OLD)
    assert deliver_for(vertex_pool, request_id) not in (None, "completed")
    record = vertex_pool.store.status_view(request_id, "vertexai").record
    assert record.model_ran is None and record.error_type is not None  # a request's own failure: no fallback


def test_a_batch_line_names_its_fallback_models_as_the_header_would(http, auth, services, workspace):
    lines = [{"model": NEW, "body": gemini("a"), "fallback_models": [OLD]},
             {"model": NEW, "body": gemini("b"), "fallback_models": ["bfl/flux-2-pro"]},
             {"model": NEW, "body": gemini("c"), "fallback_models": OLD}]
    sent = http.post("/v2/batches", data="".join(json.dumps(line) + "\n" for line in lines),
                     headers={**auth, "Content-Type": "application/x-ndjson"})
    assert sent.status_code == 201, sent.get_data(as_text=True)
    assert sent.json["counts"] == {"lines": 3, "accepted": 1, "refused": 2}
    batch_id = sent.json["batch_id"]
    assert drain(services, workspace, batch_id).stopped == "done"
    results = [json.loads(line) for line in
               http.get(f"/v2/batches/{batch_id}/results", headers=auth).get_data(as_text=True).splitlines()]
    assert [r.get("error_type") for r in results] == [None, "invalid_input", "invalid_input"]
    assert "takes Flux2ProInput" in results[1]["detail"] and "a list of model ids" in results[2]["detail"]
    record = services.store.status_view(results[0]["request_id"], "vertexai").record
    assert record.fallback_models == OLD


def test_a_batch_line_with_a_dearer_fallback_holds_it_and_keeps_its_model_price(http, auth, services, workspace,
                                                                             tmp_path):
    services.catalog = Catalog.load(pool_catalog(tmp_path, prices={OLD: 60}))
    line = {"model": NEW, "body": gemini("a"), "fallback_models": [OLD]}
    sent = http.post("/v2/batches", data=json.dumps(line) + "\n", headers={**auth, "Content-Type": "application/x-ndjson"})
    assert sent.status_code == 201, sent.get_data(as_text=True)
    assert drain(services, workspace, sent.json["batch_id"]).stopped == "done"
    results = http.get(f"/v2/batches/{sent.json['batch_id']}/results", headers=auth).get_data(as_text=True)
    record = services.store.status_view(json.loads(results)["request_id"], "vertexai").record
    assert (record.model_price, record.cost.as_json()) == (39, {"credits": 60, "state": "held"})
