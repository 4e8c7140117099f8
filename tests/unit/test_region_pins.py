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
from tests.pool_catalogs import pool_catalog, vertex_members
from tests.unit import delivery_support
from tests.unit.fallback_support import NEW, OLD, deliver_for, gemini
from tests.unit.support import cli_runner

stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)

US, EU = "us-central1", "europe-west4"


def members(*extra):
    return vertex_members(locations=(US, EU)) + list(extra)


@pytest.fixture
def pool_of(worker_services, tmp_path):
    def build(spec):
        worker_services.catalog = Catalog.load(pool_catalog(tmp_path, members=spec))
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


def test_a_pin_is_read_once_per_cache_lifetime_and_the_cli_sets_it_at_once(services, workspace, monkeypatch):
    """Every delivery asks for its workspace's pin: within REGION_PIN_CACHE_SECONDS a second
    ask makes no Redis call; past it the pin is read again, a change made by another process
    seen then; set-regions in this process applies at once."""
    from router_queue.store import regions as pins
    from tests.unit.support import Clock, ServicesCliRunner

    clock = Clock()
    services.regions = pins.WorkspaceRegions(services.redis, cache_s=services.settings.region_pin_cache_s,
                                             clock=clock)
    elsewhere = pins.WorkspaceRegions(services.redis)  # another process: the CLI on another host
    reads: list[str] = []
    real_hget = services.redis.hget
    monkeypatch.setattr(services.redis, "hget", lambda key, field: reads.append(field) or real_hget(key, field))
    elsewhere.set(workspace, (EU,))
    assert services.regions.of(workspace) == (EU,) and reads == ["regions"]
    elsewhere.set(workspace, (US,))
    clock.now += services.settings.region_pin_cache_s - 0.1
    assert services.regions.of(workspace) == (EU,) and reads == ["regions"]  # reused: no round trip
    clock.now += 0.2
    assert services.regions.of(workspace) == (US,) and len(reads) == 2  # its lifetime over: read again
    assert ServicesCliRunner(services).invoke(main, ["workspace", "set-regions", workspace, "--clear"]).exit_code == 0
    assert services.regions.of(workspace) == () and len(reads) == 3  # this process's own set: at once


def test_the_pin_cache_is_bounded_and_off_at_zero(services, monkeypatch):
    from router_queue.store import regions as pins

    monkeypatch.setattr(pins, "CACHE_MAX_ENTRIES", 2)
    cached = pins.WorkspaceRegions(services.redis, cache_s=5.0)
    for n in range(5):
        cached.of(f"ws_{n}")
        assert len(cached._cache) <= 2
    uncached = pins.WorkspaceRegions(services.redis, cache_s=0.0)
    uncached.of("ws_0")
    assert len(uncached._cache) == 0
