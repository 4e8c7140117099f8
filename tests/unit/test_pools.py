"""Provider pools (docs/POOLS.md): the catalog's members, the member a
generation is sent to, and a member's 429s and refused keys, which pause or
take out the member and cost the request nothing."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis
import requests

from router_queue.catalog import Catalog, CatalogError
from router_queue.cli import main
from router_queue.provider_pools import Member, credential_variables, members_of
from router_queue.settings import DEFAULT_CATALOG, Secret
from router_queue.states import COMPLETED
from router_queue.store import keys
from router_queue.store.gauges import QueueGauges
from router_queue.store.members import FULL_WAIT_S, MemberStore, PoolCapacity
from tests.pool_catalogs import pool_catalog
from tests.unit import delivery_support
from tests.unit.delivery_support import admitted, deliver_until_done
from tests.unit.support import cli_runner, context_of

stub_origin, fresh_stub, worker_services = (delivery_support.stub_origin, delivery_support.fresh_stub,
                                            delivery_support.worker_services)

TWO_KEYS = [{"name": "key-a", "max_in_flight": 2, "credentials": {"kind": "api_key", "env": "BFL_KEY_A"}},
            {"name": "key-b", "max_in_flight": 3, "credentials": {"kind": "api_key", "env": "BFL_KEY_B"}}]


def test_a_pools_cap_is_its_members_caps_summed_and_their_keys_are_read(tmp_path):
    path = pool_catalog(tmp_path, "bfl", TWO_KEYS)
    catalog = Catalog.load(path)
    assert catalog.max_in_flight("bfl") == 5
    assert [m.name for m in catalog.members("bfl")] == ["key-a", "key-b"]
    assert {"BFL_KEY_A", "BFL_KEY_B"} <= set(credential_variables(path))
    assert "BFL_API_KEY" not in credential_variables(path)
    # a provider listing none is one member of its own cap and key
    assert [(m.name, m.max_in_flight) for m in catalog.members("openai")] == [("default", 200)]


@pytest.mark.parametrize("spec,complaint", [
    ({"members": [], }, "non-empty list"),
    ({"members": TWO_KEYS, "max_in_flight": 5}, "drop the provider's own"),
    ({"members": [TWO_KEYS[0], TWO_KEYS[0]]}, "must differ"),
    ({"members": [{**TWO_KEYS[0], "max_in_flight": 0}]}, "at least 1"),
    ({"members": [{**TWO_KEYS[0], "name": "a b"}]}, "name must be"),
    ({"members": [{**TWO_KEYS[0], "project": "p"}]}, "project and its location together"),
    ({"members": [{**TWO_KEYS[0], "secret": "sk-live"}]}, "a member is an object"),
])
def test_a_malformed_pool_is_refused_naming_the_provider(spec, complaint):
    with pytest.raises(CatalogError, match=complaint):
        members_of("bfl", spec)


def test_a_vertex_member_sends_to_its_project_and_locations_host():
    url = ("https://aiplatform.googleapis.com/v1/projects/comfy-router/locations/global/publishers/google/models/"
           "gemini-3.1-flash-image:generateContent")
    west = Member("eu", 4, None, project="p-eu", location="europe-west4")
    assert west.upstream(url) == ("https://europe-west4-aiplatform.googleapis.com/v1/projects/p-eu/locations/"
                                  "europe-west4/publishers/google/models/gemini-3.1-flash-image:generateContent")
    assert west.region == "" and members_of("vertexai", {"members": [
        {"name": "eu", "max_in_flight": 4, "project": "p", "location": "europe-west4"}]})[0].region == "europe-west4"
    assert Member("g", 4, None, project="p", location="global").upstream(url).startswith(
        "https://aiplatform.googleapis.com/v1/projects/p/locations/global/")
    assert Member("key", 4, None).upstream(url) == url


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


POOL = (Member("a", 2, None), Member("b", 3, None))


@pytest.fixture
def pool(client):
    clock = Clock()
    return MemberStore(client, grow_every_s=10.0, clock=clock), clock


def test_a_generation_goes_to_the_member_with_the_most_headroom(pool):
    store, _ = pool
    taken = [store.take("bfl", POOL, f"r{i}", hold_s=60).member for i in range(5)]
    assert taken == ["b", "a", "b", "a", "b"]  # 3 of room, then 2 and 2 (the first listed), ...
    waiting = store.take("bfl", POOL, "r5", hold_s=60)
    assert (waiting.member, waiting.wait_s) == (None, FULL_WAIT_S)
    assert store.release("bfl", "a", "r1") and not store.release("bfl", "a", "r1")  # given back once
    assert store.take("bfl", POOL, "r6", hold_s=60).member == "a"
    # the member holding a resumed generation's handle keeps it, full or not
    assert store.take("bfl", POOL, "r0", hold_s=60, prefer="b").member == "b"


def test_a_429_pauses_its_member_halves_its_cap_and_the_cap_grows_back(pool):
    store, clock = pool
    assert store.rate_limited("bfl", POOL[1], retry_after_s=30) == 1
    assert [store.take("bfl", POOL, f"r{i}", hold_s=60).member for i in range(3)] == ["a", "a", None]
    clock.now += 30  # the pause is over, and 30 s passed without a 429: its learned cap grew by one
    assert store.take("bfl", POOL, "r3", hold_s=60).member == "b"
    state = {s.member: s for s in store.states("bfl", POOL)}
    assert (state["b"].learned_cap, state["b"].rate_limited, state["b"].in_flight) == (2, 1, 1)


def test_every_member_paused_waits_until_the_first_pause_ends(pool):
    store, clock = pool
    store.rate_limited("bfl", POOL[0], retry_after_s=8)
    store.rate_limited("bfl", POOL[1], retry_after_s=3)
    waiting = store.take("bfl", POOL, "r", hold_s=60)
    assert waiting.member is None and waiting.wait_s == pytest.approx(3.0)
    clock.now += 3
    assert store.take("bfl", POOL, "r", hold_s=60).member == "b"


def test_a_learned_cap_grows_by_one_per_quiet_interval(pool):
    store, clock = pool
    store.rate_limited("bfl", POOL[1], retry_after_s=1)  # b: 3 -> 1
    clock.now += 1
    for step in range(2, 4):
        clock.now += 10
        store.take("bfl", (POOL[1],), f"probe{step}", hold_s=60)
        store.release("bfl", "b", f"probe{step}")
        assert store.states("bfl", POOL)[1].learned_cap == step


def test_a_slot_whose_worker_died_is_given_back_when_its_lease_ends(pool):
    store, clock = pool
    solo = (Member("a", 1, None),)
    assert store.take("bfl", solo, "dead", hold_s=60).member == "a"
    assert store.take("bfl", solo, "next", hold_s=60).member is None
    clock.now += 61
    assert store.take("bfl", solo, "next", hold_s=60).member == "a"
    assert store.states("bfl", solo)[0].in_flight == 1


@pytest.fixture
def pooled(worker_services, tmp_path):
    """The services with BFL a pool of two keys, key-a and key-b."""
    services = worker_services
    services.catalog = Catalog.load(pool_catalog(tmp_path, "bfl", TWO_KEYS))
    services.settings = dataclasses.replace(services.settings, provider_credentials={
        **services.settings.provider_credentials, "BFL_KEY_A": Secret("key-a"), "BFL_KEY_B": Secret("key-b")})
    return services


def by_key(stub_origin):
    return requests.get(f"{stub_origin}/stub/calls").json()["by_key"]


def test_a_member_answering_429_sends_the_requests_to_the_other_uncharged(pooled, workspace, stub_origin):
    context = context_of(pooled)
    for n in range(4):
        request_id, provider = admitted(pooled, workspace, "bfl/flux-2-pro", {"prompt": f"#{n} [stub:429_key=key-b]"})
        assert deliver_until_done(context, request_id) == "completed"
        record = pooled.store.status_view(request_id, provider).record
        assert (record.status, record.error_type, record.attempts) == (COMPLETED, None, 0)
    calls = by_key(stub_origin)
    assert calls["bfl_submit:key-a"] == 4 and calls.get("bfl_submit:key-b", 0) == 1  # b answered 429 once, then paused
    b = pooled.members.states("bfl", pooled.catalog.members("bfl"))[1]
    assert (b.rate_limited, b.learned_cap, b.in_flight) == (1, 1, 0)
    assert pooled.redis.zcard(keys.member_leases("bfl")) == 0  # every slot given back


def test_a_member_whose_key_is_refused_is_taken_out_and_the_operator_told(pooled, workspace, stub_origin, caplog):
    context = context_of(pooled)
    request_id, provider = admitted(pooled, workspace, "bfl/flux-2-pro", {"prompt": "x [stub:401_key=key-b]"})
    pooled.members.rate_limited("bfl", pooled.catalog.members("bfl")[0], retry_after_s=0.01)  # a's pause: b goes first
    assert deliver_until_done(context, request_id) == "completed"
    assert pooled.store.status_view(request_id, provider).record.attempts == 0
    assert by_key(stub_origin) == {"bfl_submit:key-b": 1, "bfl_submit:key-a": 1}
    assert pooled.members.states("bfl", pooled.catalog.members("bfl"))[1].revoked == 1
    assert any("member key-b refused our credential (HTTP 401)" in r.getMessage() for r in caplog.records)


def test_a_lone_providers_refused_key_still_fails_the_request(worker_services, workspace):
    context = context_of(worker_services)
    request_id, provider = admitted(worker_services, workspace, "bfl/flux-2-pro", {"prompt": "x [stub:401_key=k]"})
    assert deliver_until_done(context, request_id) == "provider_error"


def test_the_operator_sees_each_member_on_the_page_the_cli_and_metrics(pooled, workspace, app):
    context = context_of(pooled)
    request_id, _ = admitted(pooled, workspace, "bfl/flux-2-pro", {"prompt": "seen [stub:429_key=key-b]"})
    pooled.members.rate_limited("bfl", pooled.catalog.members("bfl")[0], retry_after_s=0.01)  # b is tried first
    assert deliver_until_done(context, request_id) == "completed"
    shown = cli_runner(app).invoke(main, ["ops", "members"])
    assert shown.exit_code == 0, shown.output
    header, *rows = [line.split("\t") for line in shown.output.splitlines()]
    assert header == ["provider", "member", "in_flight", "cap", "learned_cap", "paused_s", "out_s", "sent", "429s",
                      "refused"]
    table = {(row[0], row[1]): row for row in rows}
    assert table["bfl", "key-b"][3:5] == ["3", "1"] and float(table["bfl", "key-b"][5]) > 0
    assert table["bfl", "key-b"][7:9] == ["1", "1"] and table["bfl", "key-a"][7] == "1"
    assert ("openai", "default") in table
    metrics = {(s.name, s.labels.get("member")): s.value for family in QueueGauges(pooled.redis, pooled.catalog).collect()
               for s in family.samples if s.labels.get("provider") == "bfl"}
    assert metrics["router_queue_pool_member_cap", "key-b"] == 1
    assert metrics["router_queue_pool_member_paused", "key-b"] == 1
    assert metrics["router_queue_pool_member_in_flight", "key-a"] == 0


def test_deploys_example_pool_of_two_vertex_locations_loads():
    path = DEFAULT_CATALOG.parents[1] / "deploy" / "catalog" / "vertex-two-locations.json"
    catalog = Catalog.load(path)
    members = catalog.members("vertexai")
    assert [(m.name, m.region) for m in members] == [("us-central1", "us-central1"), ("europe-west4", "europe-west4")]
    assert catalog.max_in_flight("vertexai") == 200 and credential_variables(path) == credential_variables(DEFAULT_CATALOG)
    entry = catalog.by_id("vertexai/gemini-3.1-flash-image")
    assert entry.upstream("", members[1]).startswith(
        "https://europe-west4-aiplatform.googleapis.com/v1/projects/comfy-router-eu/locations/europe-west4/")


def test_the_schedule_grants_no_more_than_the_pool_has_room_for(client):
    clock = Clock()
    store = MemberStore(client, clock=clock)
    capacity = PoolCapacity(client, lambda provider: POOL, ttl_s=0.5, clock=clock, wait=True)
    assert capacity("bfl") == 5
    store.rate_limited("bfl", POOL[1], retry_after_s=10)  # b paused, its learned cap 1
    assert capacity("bfl") == 5  # read again only after its ttl
    clock.now += 0.5
    assert capacity("bfl") == 2  # a alone
    clock.now += 10
    assert capacity("bfl") == 3  # b back, at its learned cap


def test_a_paused_member_keeps_the_rest_waiting_in_the_fair_queue(pooled, workspace):
    pooled.store.max_in_flight = PoolCapacity(pooled.redis, pooled.catalog.members, ttl_s=0, wait=True)
    pooled.members.rate_limited("bfl", pooled.catalog.members("bfl")[1], retry_after_s=60)  # key-b paused
    for n in range(5):
        admitted(pooled, workspace, "bfl/flux-2-pro", {"prompt": f"#{n}"})
    assert pooled.redis.zcard(keys.running("bfl")) == 2  # key-a's two slots granted, three wait their turn
    assert pooled.redis.zcard(keys.queue("bfl")) == 5


def test_the_pools_capacity_never_waits_on_redis_in_the_callers_path(client):
    """The figure last read is answered at once (the catalog's before any); an
    old one is read again in the background, and a Redis that does not answer
    leaves the last figure standing."""
    store, clock = MemberStore(client), Clock()
    store.clock = clock
    capacity = PoolCapacity(client, lambda provider: POOL, ttl_s=0.5, clock=clock)
    store.rate_limited("bfl", POOL[1], retry_after_s=60)  # only a's 2 are free now
    assert capacity("bfl") == 5  # the catalog's, answered before any read
    deadline = time.monotonic() + 5
    while capacity("bfl") != 2:
        assert time.monotonic() < deadline, "the background read never landed"
        time.sleep(0.01)

    class Unreachable:
        def hgetall(self, key):
            raise redis.ConnectionError("stalled")

    capacity.client = Unreachable()
    clock.now += 1
    assert capacity.refresh("bfl") == 2  # kept as it was
