"""Region pins (docs/POOLS.md): ``router-queue workspace set-regions``, and a
pinned workspace's generations sent only to members of its regions (or
marked any_region), waiting for them rather than crossing the pin, a
fallback model's too."""

from __future__ import annotations

import json

import pytest
import requests

from router_queue.catalog import Catalog
from router_queue.cli import main
from router_queue.requests.record import Submission
from router_queue.settings import DEFAULT_CATALOG
from tests.unit import delivery_support
from tests.unit.fallback_support import NEW, OLD, deliver_for, gemini
from tests.unit.support import cli_runner

stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)

US, EU = "us-central1", "europe-west4"


def members(*extra):
    return [{"name": loc, "max_in_flight": 4, "credentials": {"kind": "google", "env": "VERTEXAI_ACCESS_TOKEN"},
             "project": "p", "location": loc} for loc in (US, EU)] + list(extra)


@pytest.fixture
def pool_of(worker_services, tmp_path):
    def build(spec):
        raw = json.loads(DEFAULT_CATALOG.read_text())
        raw["providers"]["vertexai"] = {"members": spec}
        path = tmp_path / "catalog.json"
        path.write_text(json.dumps(raw))
        worker_services.catalog = Catalog.load(path)
        worker_services.model_fallback.after_s = 5.0
        return worker_services
    return build


def admit(services, workspace, text, fallback=""):
    request_id = services.ids.mint(workspace, NEW)
    assert services.store.admit(Submission(request_id=request_id, workspace=workspace, model=NEW, provider="vertexai",
                                           body=json.dumps(gemini(text)), price=39,
                                           fallback_models=fallback)).outcome == "ADMITTED"
    return request_id


def by_location(stub_origin):
    calls = requests.get(f"{stub_origin}/stub/calls").json()["by_key"]
    return {key.split(":", 1)[1]: n for key, n in calls.items() if key.startswith("vertex_generate:")}


def test_the_operator_pins_and_clears_a_workspaces_regions(app, services, workspace):
    runner = cli_runner(app)
    pinned = runner.invoke(main, ["workspace", "set-regions", workspace, f"{EU}, us-central1"])
    assert pinned.exit_code == 0, pinned.output
    assert f"{workspace} is pinned to {EU}, us-central1" in pinned.output
    assert "bfl: no member serves it" in pinned.output  # its one key has no region
    assert services.regions.of(workspace) == (EU, US)
    assert runner.invoke(main, ["workspace", "set-regions", workspace, "--clear"]).exit_code == 0
    assert services.regions.of(workspace) == ()
    assert runner.invoke(main, ["workspace", "set-regions", workspace, "EU West"]).exit_code == 2
    assert runner.invoke(main, ["workspace", "set-regions", workspace]).exit_code == 2
    unknown = runner.invoke(main, ["workspace", "set-regions", "ws_nope", EU])
    assert unknown.exit_code == 1 and "no workspace ws_nope" in unknown.output


def test_a_pinned_workspaces_generations_go_only_to_its_regions_members(pool_of, workspace, stub_origin):
    services = pool_of(members())
    services.regions.set(workspace, (EU,))
    for n in range(3):
        assert deliver_for(services, admit(services, workspace, f"pinned {n}")) == "completed"
    assert by_location(stub_origin) == {EU: 3}
    services.regions.set(workspace, ())
    assert deliver_for(services, admit(services, workspace, "unpinned")) == "completed"
    assert by_location(stub_origin)[US] == 1  # the most headroom, first in the catalog's order


def test_a_pinned_request_waits_for_its_paused_members_and_never_crosses(pool_of, workspace, stub_origin):
    services = pool_of(members())
    services.regions.set(workspace, (EU,))
    request_id = admit(services, workspace, f"eu paused [stub:429_key={EU}]")
    assert deliver_for(services, request_id, seconds=30) is None  # still waiting on europe-west4
    assert US not in by_location(stub_origin)
    assert services.store.status_view(request_id, "vertexai").record.attempts == 0


def test_a_pin_no_member_serves_ends_the_request_unbilled(pool_of, workspace, stub_origin):
    services = pool_of(members())
    services.regions.set(workspace, ("asia-east1",))
    request_id = admit(services, workspace, "nowhere")
    assert deliver_for(services, request_id) == "provider_error"
    record = services.store.status_view(request_id, "vertexai").record
    assert "serves workspace" in record.detail and record.cost.state == "released"
    assert by_location(stub_origin) == {}


@pytest.mark.parametrize("any_region,served", [(True, "completed"), (False, "provider_error")])
def test_a_member_without_a_region_serves_a_pin_only_when_marked(pool_of, workspace, stub_origin, any_region,
                                                                served):
    services = pool_of([{"name": "global", "max_in_flight": 4, "project": "p", "location": "global",
                         "any_region": any_region,
                         "credentials": {"kind": "google", "env": "VERTEXAI_ACCESS_TOKEN"}}])
    services.regions.set(workspace, (EU,))
    assert deliver_for(services, admit(services, workspace, "global")) == served


def test_a_fallback_never_crosses_the_pin(pool_of, workspace, stub_origin):
    services = pool_of(members())
    services.regions.set(workspace, (EU,))
    request_id = admit(services, workspace, "[stub:429_model=gemini-3.1-flash-image]", fallback=OLD)
    assert deliver_for(services, request_id) == "completed"
    record = services.store.status_view(request_id, "vertexai").record
    assert record.model_ran == OLD and record.tried[0]["member"] == EU
    assert set(by_location(stub_origin)) == {EU}
