"""A store that lost its data is refused loudly, not served as an empty one
(``router_queue/store/epoch.py``)."""

from __future__ import annotations

import logging

import pytest

from router_queue.cli import main
from router_queue.errors import StoreLost
from router_queue.services import Services
from router_queue.store import keys, migrate
from router_queue.web.app import create_app
from tests.unit.conftest import RecordingDispatcher
from tests.unit.route_support import FLUX, assert_error, submit
from tests.unit.support import cli_runner, context_of
from workers.sweeper import sweep


def test_a_store_emptied_under_a_serving_front_door_is_503_not_401(http, auth, services, client,
                                                                   caplog: pytest.LogCaptureFixture):
    request_id = submit(http, auth, {"prompt": "before the loss"}).json["request_id"]
    assert http.get("/readyz").status_code == 200  # the marker written with the workspace, adopted
    client.flushdb()  # what a Redis restarted without its append-only file holds
    with caplog.at_level(logging.CRITICAL):
        unknown = http.get(f"{FLUX}/requests/{request_id}/status", headers={"X-API-Key": "rq_not_cached_here"})
        ready = http.get("/readyz")
    assert_error(unknown, 503, "service_unavailable")
    assert int(unknown.headers["Retry-After"]) >= 1
    assert_error(ready, 503, "service_unavailable")
    assert "lost its data" in ready.json["detail"]
    assert "the store lost its data" in caplog.text
    with pytest.raises(StoreLost):
        sweep(context_of(services))


def test_a_new_deployment_is_no_false_alarm(http, services):
    """No workspace yet: an unknown key is 401, and ready; the store is marked as the process starts."""
    assert services.redis.get(keys.epoch()) is not None
    assert_error(http.get(f"{FLUX}/requests/x/status", headers={"X-API-Key": "rq_unknown"}), 401, "unauthorized")
    assert http.get("/readyz").status_code == 200
    services.accounts.create_workspace("first")
    assert http.get("/readyz").status_code == 200  # the marker adopted, not taken for a replacement
    assert_error(http.get(f"{FLUX}/requests/x/status", headers={"X-API-Key": "rq_unknown"}), 401, "unauthorized")


def test_data_from_before_the_marker_is_marked_not_refused(http, services, workspace):
    services.redis.delete(keys.epoch())
    services.accounts.epoch.known = None  # a process started on data from before the marker
    assert http.get("/readyz").status_code == 200
    assert services.redis.get(keys.epoch()) is not None
    assert http.get("/readyz").status_code == 200


def test_a_process_that_served_nothing_before_the_loss_still_refuses(http, settings, client, services):
    """Two web workers started on a new store; one served every call before Redis came
    back empty. The other one's /readyz is 503 too, not a new deployment's 200."""
    other = create_app(settings, services=Services.build(settings, client, dispatcher=RecordingDispatcher()))
    workspace = services.accounts.create_workspace("first", queue_enabled=True, credits=1000)
    auth = {"X-API-Key": services.accounts.mint_key(workspace)}
    assert submit(http, auth, {"prompt": "served by the first worker"}).status_code == 201
    client.flushdb()
    ready = other.test_client().get("/readyz")
    assert_error(ready, 503, "service_unavailable")
    assert "lost its data" in ready.json["detail"]


def test_a_process_that_started_on_an_empty_store_adopts_the_marker_at_its_first_key(http, auth, services, client):
    """Booted before the first workspace, it never checked; its first resolved key adopts the marker."""
    services.accounts.epoch.known = None
    assert submit(http, auth, {"prompt": "the first call"}).status_code == 201
    client.flushdb()
    assert_error(http.get(f"{FLUX}/requests/x/status", headers={"X-API-Key": "rq_other"}), 503,
                 "service_unavailable")


def _one_tag_path(name: str) -> str:
    """What followed the one tag in a key's name before each family had its own."""
    tag, _, path = name.partition("}:")
    if not tag.startswith("{ws:"):
        return path  # a provider's and a request's keys, and the global ones, kept their names
    workspace = tag.removeprefix("{ws:")
    kind, _, rest = path.partition(":")
    if kind == "rate":
        return path
    if kind == "webhooks":
        what, _, origin = rest.partition(":")
        return f"webhooks:{what}:{workspace}" + (f"|{origin}" if origin else "")
    return f"{kind}:{workspace}" + (f":{rest}" if rest else "")


def _to_legacy_layout(client, prefix: str) -> int:
    """Rename every key to an earlier layout, as an earlier version wrote it:
    before the hash tag (``rq``) or under the one tag (``{rq}``)."""
    client.delete(keys.layout())
    names = [name.decode() for name in client.scan_iter(match="{*")]
    for name in names:
        client.rename(name, f"{prefix}:{_one_tag_path(name)}")
    # rate windows are left to expire, not moved
    return len([name for name in names if f"{prefix}:{_one_tag_path(name)}" != name
                and not _one_tag_path(name).startswith("rate:")])


@pytest.mark.parametrize("prefix", [keys.UNTAGGED_PREFIX, keys.PREFIX])
def test_a_store_in_an_earlier_key_layout_is_refused_until_migrated(app, http, auth, services, client, settings,
                                                                    caplog: pytest.LogCaptureFixture, prefix):
    request_id = submit(http, auth, {"prompt": "written before the tag"}).json["request_id"]
    before = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json
    legacy = _to_legacy_layout(client, prefix)
    services.accounts.epoch.known = None  # a process of this version starting on that store
    with caplog.at_level(logging.CRITICAL):
        with pytest.raises(StoreLost, match="migrate-keys"):
            create_app(settings, services=services)  # a front door does not start on it
        ready = http.get("/readyz")
        refused = http.get(f"{FLUX}/requests/{request_id}/status", headers={"X-API-Key": "rq_not_cached_here"})
    assert_error(ready, 503, "service_unavailable")
    assert "migrate-keys" in ready.json["detail"] and "migrate-keys" in caplog.text
    assert_error(refused, 503, "service_unavailable")  # not a 401 for a key it cannot see
    with pytest.raises(StoreLost):
        sweep(context_of(services))

    listed = cli_runner(app).invoke(main, ["workspace", "list"])
    assert listed.exit_code == 1 and "ops migrate-keys" in listed.output  # not "holds no router-queue data"
    migrated = cli_runner(app).invoke(main, ["ops", "migrate-keys"])
    assert migrated.exit_code == 0, migrated.output
    assert migrated.output.splitlines()[0] == f"moved {legacy} keys to today's layout"
    assert list(client.scan_iter(match=migrate.LEGACY_MATCHES[0])) == []
    assert http.get("/readyz").status_code == 200
    after = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth)
    assert after.status_code == 200 and after.json == before  # the same request, the same state
    again = cli_runner(app).invoke(main, ["ops", "migrate-keys"])
    assert again.exit_code == 0 and again.output.splitlines()[0] == "moved 0 keys to today's layout"


def test_migration_leaves_a_key_whose_new_name_is_taken(client):
    client.set("rq:config:id-secret", "old")
    client.set(keys.id_secret(), "new")
    client.set("rq:workspaces-unrelated", "x")
    done = migrate.migrate(client)
    assert done.renamed == 1 and done.clashes == ["rq:config:id-secret"]
    assert client.get(keys.id_secret()) == b"new" and client.get("rq:config:id-secret") == b"old"


def test_migration_keeps_each_keys_value_type_and_ttl_across_scan_pages(client):
    for n in range(25):
        client.hset(f"rq:req:{n}", "status", "COMPLETED")
        client.expire(f"rq:req:{n}", 1000)
    client.zadd("rq:queue:bfl", {"a": 1})
    client.hset("{rq}:ws:ws_1", "credits", 5)
    client.sadd("{rq}:workspaces", "ws_1")
    done = migrate.migrate(client, batch=4)
    assert done.renamed == 27 and done.clashes == []
    assert client.hget(keys.workspace("ws_1"), "credits") == b"5" and client.get(keys.layout()) == keys.LAYOUT.encode()
    assert client.hget(keys.request("7"), "status") == b"COMPLETED" and 990 < client.ttl(keys.request("7")) <= 1000
    assert client.zscore(keys.queue("bfl"), "a") == 1.0 and client.ttl(keys.queue("bfl")) == -1
