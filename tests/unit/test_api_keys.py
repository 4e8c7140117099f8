"""API keys as an operator manages them (``store/apikeys.py``, ``router-queue
key …``) and as the front door resolves them (``web/auth.py``): listed by id
and never shown again, last use noted at most once a minute, revoked, rotated
with an overlap, every change audited; each legacy key in a namespace of its own."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest
import redis

from router_queue.cli import main
from router_queue.store import keys
from router_queue.store.apikeys import LAST_USED_EVERY_S, hash_key, key_id
from router_queue.web import auth as auth_module
from router_queue.web.app import create_app
from tests.unit.support import Clock, cli_runner
from tests.unit.sync_support import NATIVE, FinishingDispatcher, run

FLUX = "/v2/models/bfl/flux-2-pro"
#: A well-formed request id nobody minted: a valid key reads 404 for it, a refused one 401.
NOBODYS = "00000000-0000-9000-8000-000000000001"


def status_of(http, api_key: str) -> int:
    return http.get(f"{FLUX}/requests/{NOBODYS}/status", headers={"X-API-Key": api_key}).status_code


@pytest.fixture
def clock(app) -> Clock:
    made = Clock()
    app.extensions["router_queue"].keys.clock = made
    return made


# -- the store -------------------------------------------------------------------------------


def test_a_minted_key_is_listed_by_id_and_label_never_by_itself(services, workspace):
    api_keys = services.accounts.keys
    api_key, info = api_keys.mint(workspace, label="ci runner", now=100.0)
    assert info.id == key_id(hash_key(api_key)) and info.id.startswith("key_") and len(info.id) == 20
    listed = api_keys.list(workspace)
    assert [(k.id, k.label, k.created_at, k.last_used_at, k.expires_at) for k in listed] == [
        (info.id, "ci runner", 100.0, None, None)]
    assert api_key.removeprefix("rq_") not in repr(listed)
    assert api_keys.find(api_key).id == api_keys.find(info.id).id == info.id
    with pytest.raises(LookupError):
        api_keys.mint("ws_nope")


def test_last_use_is_written_at_most_once_a_minute(services, workspace):
    api_keys = services.accounts.keys
    api_key, info = api_keys.mint(workspace)
    for at in (1000.0, 1001.0, 1000.0 + LAST_USED_EVERY_S - 1):
        assert api_keys.resolve(api_key, now=at).workspace == workspace
    assert api_keys.find(info.id).last_used_at == 1000.0
    api_keys.resolve(api_key, now=1000.0 + LAST_USED_EVERY_S)
    assert api_keys.find(info.id).last_used_at == 1000.0 + LAST_USED_EVERY_S


def test_revoke_by_id_or_by_key_and_the_audit(services, workspace):
    api_keys = services.accounts.keys
    first, first_info = api_keys.mint(workspace, label="one")
    second, _ = api_keys.mint(workspace, label="two")
    assert api_keys.revoke(first_info.id).id == first_info.id
    assert api_keys.revoke(second).label == "two"
    assert api_keys.resolve(first) is None and api_keys.resolve(second) is None
    assert api_keys.list(workspace) == []
    assert not services.redis.exists(keys.key_record(first_info.id))
    with pytest.raises(LookupError, match="no key"):
        api_keys.revoke(first_info.id)
    assert [(a["action"], a["label"]) for a in api_keys.audit(workspace)] == [
        ("revoke", "two"), ("revoke", "one"), ("mint", "two"), ("mint", "one")]


def test_a_rotated_pair_both_work_for_the_overlap_then_the_old_one_stops(services, workspace):
    api_keys = services.accounts.keys
    old, old_info = api_keys.mint(workspace, label="deploy")
    # the overlap ends half a second from now
    new, ended, successor = api_keys.rotate(old, overlap_s=30, now=time.time() - 29.5)
    assert successor.label == "deploy" and successor.rotated_from == old_info.id and ended.rotated_to == successor.id
    assert api_keys.resolve(old).workspace == api_keys.resolve(new).workspace == workspace
    assert 0 < api_keys.resolve(old).left_s <= 0.5 and api_keys.resolve(new).left_s is None
    listed = {k.id: k for k in api_keys.list(workspace)}
    assert listed[old_info.id].expires_at == pytest.approx(ended.expires_at)
    assert listed[successor.id].rotated_from == old_info.id
    with pytest.raises(LookupError, match="rotated already"):
        api_keys.rotate(old_info.id)
    time.sleep(0.6)
    assert api_keys.resolve(old) is None and api_keys.resolve(new).workspace == workspace
    assert [k.id for k in api_keys.list(workspace)] == [successor.id]
    rotation = api_keys.audit(workspace)[0]
    assert rotation["action"] == "rotate" and rotation["key_id"] == old_info.id
    assert rotation["successor"] == successor.id and rotation["overlap_s"] == 30


def test_a_rotation_without_overlap_stops_the_old_key_at_once(services, workspace):
    api_keys = services.accounts.keys
    old, _ = api_keys.mint(workspace)
    new, _, _ = api_keys.rotate(old, overlap_s=0)
    assert api_keys.resolve(old) is None and api_keys.resolve(new).workspace == workspace


def test_keys_minted_before_the_index_are_indexed_once(services, workspace):
    digest = hash_key("rq_an-old-key")
    services.redis.set(keys.api_key(digest), workspace)  # as minted before keys had records
    services.redis.set(keys.api_key(hash_key("rq_an-old-legacy-key")), "-")
    api_keys = services.accounts.keys
    assert api_keys.resolve("rq_an-old-key").workspace == workspace
    assert api_keys.index_unrecorded() == 2 and api_keys.index_unrecorded() == 0
    assert [k.id for k in api_keys.list(workspace)] == [key_id(digest)]
    assert [k.id for k in api_keys.list("-")] == [key_id(hash_key("rq_an-old-legacy-key"))]
    assert api_keys.revoke(key_id(digest)).workspace == workspace
    assert api_keys.resolve("rq_an-old-key") is None


# -- the front door --------------------------------------------------------------------------


@pytest.mark.parametrize("door", ["lane", "flask"])
def test_a_revoked_key_is_refused_once_the_cache_lets_it_go(app, http, services, workspace, clock, door):
    api_key = services.accounts.mint_key(workspace)
    client = http if door == "lane" else app.test_client()
    if door == "flask":  # the result route is Flask's alone
        read = lambda: client.get(f"{FLUX}/requests/{NOBODYS}", headers={"X-API-Key": api_key}).status_code
    else:
        read = lambda: status_of(client, api_key)
    assert read() == 404
    services.accounts.keys.revoke(api_key)
    clock.now += auth_module.CACHE_TTL_S - 0.1
    assert read() == 404  # still cached
    clock.now += 0.2
    assert read() == 401
    assert auth_module.CACHE_TTL_S <= 5.0  # the contract's bound


def test_a_cached_rotated_out_key_stops_when_its_overlap_does(http, services, workspace, clock):
    old = services.accounts.mint_key(workspace)
    new, _, _ = services.accounts.keys.rotate(old, overlap_s=30, now=time.time() - 29.7)
    assert status_of(http, old) == 404 and status_of(http, new) == 404
    time.sleep(0.4)  # the overlap is over; the resolver's clock has not moved, its entry ends with the key
    clock.now += 0.4
    assert status_of(http, old) == 401 and status_of(http, new) == 404


@pytest.fixture
def round_trips(monkeypatch) -> list[int]:
    """Counts every command or pipeline sent to Redis (one round trip each)."""
    sent = [0]
    original = redis.connection.AbstractConnection.send_packed_command

    def counted(self, *args, **kwargs):
        sent[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    return sent


def test_a_warm_poll_or_submit_costs_one_round_trip_and_a_cache_miss_one_more(http, services, workspace, auth, clock,
                                                                  round_trips):
    request_id = http.post(f"{FLUX}/requests", json={"prompt": "p"}, headers=auth).json["request_id"]
    poll = f"{FLUX}/requests/{request_id}/status"
    assert http.get(poll, headers=auth).status_code == 200  # the cache is warm
    before = round_trips[0]
    for _ in range(50):
        assert http.get(poll, headers=auth).status_code == 200
    assert round_trips[0] - before == 50
    before = round_trips[0]
    for i in range(10):  # a submit: admit.lua alone (the test's dispatcher publishes nothing)
        assert http.post(f"{FLUX}/requests", json={"prompt": f"p{i}"}, headers=auth).status_code == 201
    assert round_trips[0] - before == 10
    clock.now += auth_module.CACHE_TTL_S  # the entry is stale: key_resolve.lua with the rate limit, the poll
    before = round_trips[0]
    assert http.get(poll, headers=auth).status_code == 200
    assert round_trips[0] - before == 2


def test_a_changed_rate_limit_applies_once_the_cached_resolution_ends(http, services, workspace, auth, clock):
    """The rate limit travels with the key's cached resolution: a change takes
    up to CACHE_TTL_S to apply, then applies (read with the key, one round trip)."""
    request_id = http.post(f"{FLUX}/requests", json={"prompt": "p"}, headers=auth).json["request_id"]
    poll = f"{FLUX}/requests/{request_id}/status"
    services.accounts.set_limits(workspace, rate_limit="2/minute")
    assert http.get(poll, headers=auth).status_code == 200  # cached: the old limit still holds
    clock.now += auth_module.CACHE_TTL_S
    codes = [http.get(poll, headers=auth).status_code for _ in range(3)]
    assert codes[-1] == 429


# -- legacy keys -------------------------------------------------------------------------------


@pytest.fixture
def sync_http(settings, services):
    own, _ = FinishingDispatcher.serving(dataclasses.replace(settings, sync_deadline_s=2.0), services.redis,
                                         delay_s=0.05)
    return create_app(own.settings, services=own).test_client()


def _funded_legacy_key(services) -> tuple[str, str]:
    """A legacy key, and its namespace given credits to run with."""
    api_key = services.accounts.mint_legacy_key()
    namespace = services.accounts.keys.resolve(api_key).workspace
    services.redis.hset(keys.workspace(namespace), "credits", 1000)
    return api_key, namespace


def test_two_legacy_keys_never_share_an_idempotency_key_and_a_rotation_keeps_its_own(sync_http, services):
    first, first_ns = _funded_legacy_key(services)
    second, second_ns = _funded_legacy_key(services)
    assert first_ns != second_ns and first_ns.startswith("legacy:key_")
    answers = [run(sync_http, {"X-API-Key": k}, headers={"Idempotency-Key": "same"}) for k in (first, second)]
    assert [a.status_code for a in answers] == [200, 200] and answers[0].get_data() == NATIVE
    ids = [a.headers["X-Comfy-Request-Id"] for a in answers]
    assert ids[0] != ids[1] and "Idempotent-Replayed" not in answers[1].headers
    assert [services.redis.hget(keys.request(i), "workspace").decode() for i in ids] == [first_ns, second_ns]
    # the same caller's retry attaches to its own request; so does its rotated successor's
    again = run(sync_http, {"X-API-Key": first}, headers={"Idempotency-Key": "same"})
    assert again.headers["X-Comfy-Request-Id"] == ids[0]
    successor, _, _ = services.accounts.keys.rotate(first, overlap_s=0)
    assert services.accounts.keys.resolve(successor).workspace == first_ns
    assert run(sync_http, {"X-API-Key": successor},
               headers={"Idempotency-Key": "same"}).headers["X-Comfy-Request-Id"] == ids[0]


def test_a_legacy_key_is_still_not_enabled_for_the_queue(http, services):
    legacy = services.accounts.mint_legacy_key()
    response = http.post(f"{FLUX}/requests", json={"prompt": "p"}, headers={"X-API-Key": legacy})
    assert response.status_code == 403 and response.json["error_type"] == "not_enabled"


# -- the commands ------------------------------------------------------------------------------


def test_the_key_commands_list_revoke_rotate_and_audit(app, services, workspace, caplog):
    runner = cli_runner(app)
    minted = runner.invoke(main, ["key", "mint", workspace, "--label", "laptop"])
    assert minted.exit_code == 0, minted.output
    api_key = minted.stdout.strip()
    ident = key_id(hash_key(api_key))
    listed = runner.invoke(main, ["key", "list", workspace])
    assert listed.exit_code == 0 and api_key not in listed.output
    row = listed.stdout.splitlines()[1].split("\t")
    assert row[0] == ident and row[1] == "laptop" and row[3] == "never" and row[4] == "no end"

    rotated = runner.invoke(main, ["key", "rotate", ident, "--overlap", "600"])
    assert rotated.exit_code == 0, rotated.output
    successor = rotated.stdout.strip()
    assert successor.startswith("rq_") and successor != api_key
    rows = [line.split("\t") for line in runner.invoke(main, ["key", "list", workspace]).stdout.splitlines()[1:]]
    assert {r[0] for r in rows} == {ident, key_id(hash_key(successor))}
    assert f"rotated to {key_id(hash_key(successor))}" in dict((r[0], r[5]) for r in rows)[ident]

    revoked = runner.invoke(main, ["key", "revoke", successor])
    assert revoked.exit_code == 0 and f"revoked {key_id(hash_key(successor))}" in revoked.stdout
    again = runner.invoke(main, ["key", "revoke", successor])
    assert again.exit_code == 1 and "no key" in again.output
    audit = runner.invoke(main, ["key", "audit", workspace])
    assert [line.split("\t")[1] for line in audit.stdout.splitlines()] == ["revoke", "rotate", "mint"]
    assert api_key not in audit.output and successor not in audit.output
    # one structured log line per change, the key never in it
    changes = [r for r in caplog.records if r.name == "router_queue.audit"]
    assert [r.action for r in changes] == ["mint", "rotate", "revoke"]
    assert api_key not in caplog.text and successor not in caplog.text
    missing = runner.invoke(main, ["key", "list", "ws_nope"])
    assert missing.exit_code == 1 and "no workspace" in missing.output


def test_the_audit_list_is_bounded(services, workspace, monkeypatch):
    monkeypatch.setattr("router_queue.store.apikeys.AUDIT_KEPT", 3)
    for _ in range(5):
        services.accounts.keys.mint(workspace)
    assert services.redis.llen(keys.key_audit(workspace)) == 3
    assert all(json.loads(line)["action"] == "mint" for line in services.redis.lrange(keys.key_audit(workspace), 0, -1))


@pytest.fixture(autouse=True)
def _audit_at_info(caplog):
    caplog.set_level(logging.INFO, logger="router_queue.audit")
