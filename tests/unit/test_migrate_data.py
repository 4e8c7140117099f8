"""What an earlier version wrote in a shape only it read (its shared draining
and webhook due sets, records and events from before costs were kept) is
rewritten by ``router-queue ops migrate-keys``, requests minted before ids
carried their provider's code (version 8) are deleted only when the operator
says so, and a store not yet migrated is refused at start
(``store/migrate_data.py``; fakeredis and a real Redis)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time

import pytest
from standardwebhooks import Webhook

from router_queue.cli import main
from router_queue.errors import StoreLost
from router_queue.store import keys
from router_queue.store.migrate import current_name
from router_queue.store.requests_values import Lease
from router_queue.web.app import create_app
from router_queue.webhooks import event as webhook_event
from tests import earlier_store as earlier
from tests.unit.route_support import FLUX, assert_error, submit
from tests.unit.support import cli_runner, context_of, deliver_webhook, record_of
from tests.unit.webhook_support import Receiver
from workers.sweeper import sweep

MODEL = "bfl/flux-2-pro"


@pytest.fixture
def hooked(services, workspace, settings):
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True, webhook_lease_s=30)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    return services


@pytest.fixture
def receiver():
    made = Receiver()
    yield made
    made.close()


def as_process_starting(services) -> None:
    """What a process of this version that starts on the store next sees."""
    services.accounts.epoch.known = None


def migrate_keys(app, *flags: str) -> list[str]:
    done = cli_runner(app).invoke(main, ["ops", "migrate-keys", *flags])
    assert done.exit_code == 0, done.output
    return done.output.splitlines()


def test_a_store_an_earlier_version_wrote_is_refused_until_migrated(app, http, auth, services, client,
                                                                   caplog: pytest.LogCaptureFixture):
    request_id = submit(http, auth, {"prompt": "before the upgrade"}).json["request_id"]
    earlier.mark_earlier_layout(client)
    as_process_starting(services)
    with caplog.at_level(logging.CRITICAL):
        with pytest.raises(StoreLost, match="router-queue ops migrate-keys"):
            create_app(services.settings, services=services)
        ready = http.get("/readyz")
    assert_error(ready, 503, "service_unavailable")
    assert "router-queue ops migrate-keys" in ready.json["detail"] and "migrate-keys" in caplog.text
    with pytest.raises(StoreLost):
        sweep(context_of(services))
    listed = cli_runner(app).invoke(main, ["ops", "depths"])
    assert listed.exit_code == 1 and "ops migrate-keys" in listed.output

    assert migrate_keys(app)[1] == ("rewrote 0 draining marks, 0 due webhook events, 0 completed records' costs "
                                    "and 0 webhook events an earlier version wrote")
    assert client.get(keys.layout()) == keys.LAYOUT.encode()
    assert http.get("/readyz").status_code == 200
    assert http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json["status"] == "IN_QUEUE"


def test_a_provider_drained_by_an_earlier_version_stays_drained(app, http, auth, services, client):
    submit(http, auth, {"prompt": "before the upgrade"})
    earlier.drain_as_before(client, "bfl")
    earlier.mark_earlier_layout(client)
    assert migrate_keys(app)[1].startswith("rewrote 1 draining marks,")
    assert not client.exists(earlier.OLD_DRAINING)
    refused = submit(http, auth, {"prompt": "while draining"})
    assert_error(refused, 503, "service_unavailable")
    assert services.store.draining(["bfl", "vertexai"]) == {"bfl"}
    sweep(context_of(services))
    assert services.store.draining(["bfl", "vertexai"]) == {"bfl"}


def complete(services, request_id, **kwargs):
    services.store.complete(record_of(services, request_id, "bfl"), **kwargs)


def test_records_completed_before_costs_were_kept_read_their_cost_after_migration(app, http, auth, services,
                                                                                   client, workspace):
    price = services.catalog.by_id(MODEL).price_credits
    charged, released, waiting = (submit(http, auth, {"prompt": f"cost {n}"}).json["request_id"] for n in range(3))
    complete(services, charged, output=b"{}", content_type="application/json")
    services.store.cancel(request_id=released, workspace=workspace, model=MODEL, provider="bfl")
    for request_id in (charged, released):
        earlier.forget_cost(client, request_id)
    earlier.mark_earlier_layout(client)
    assert "0 due webhook events, 2 completed records' costs" in migrate_keys(app)[1]
    costs = {request_id: http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json["cost"]
             for request_id in (charged, released, waiting)}
    assert costs == {charged: {"credits": price, "state": "charged"}, released: {"credits": 0, "state": "released"},
                     waiting: {"credits": price, "state": "held"}}
    listed = {row["request_id"]: row["cost"] for row in
              http.get("/v2/requests", headers=auth).json["requests"]}
    assert listed == costs
    assert migrate_keys(app)[1].endswith("0 completed records' costs and 0 webhook events an earlier version wrote")


def test_an_event_an_earlier_version_owed_is_delivered_after_migration(app, http, auth, hooked, client, workspace,
                                                                       receiver):
    secret = webhook_event.new_secret()
    hooked.accounts.webhook_secret(workspace, secret, rotate=True)
    headers = {**auth, "X-Comfy-Webhook-Url": receiver.url}
    fresh, older = (http.post(f"{FLUX}/requests", json={"prompt": "hook"}, headers=headers).json["request_id"]
                    for _ in range(2))
    for request_id in (fresh, older):
        complete(hooked, request_id, output=b"{}", content_type="application/json")
    earlier.owe_event_as_before(client, older, "bfl")
    earlier.forget_cost(client, older)
    earlier.mark_earlier_layout(client)

    assert migrate_keys(app)[1] == ("rewrote 0 draining marks, 1 due webhook events, 1 completed records' costs "
                                    "and 1 webhook events an earlier version wrote")
    assert not client.exists(earlier.OLD_WEBHOOKS_DUE)
    assert hooked.webhooks.pending() == 2
    now = time.time()
    assert sorted(hooked.webhooks.due(now=now + 1, again_at=now + 31)) == sorted([fresh, older])
    context = context_of(hooked)
    assert [deliver_webhook(context, request_id) for request_id in (fresh, older)] == ["delivered", "delivered"]
    bodies = {event["request_id"]: event for event in
              (Webhook(secret).verify(body, sent) for sent, body in receiver.got)}
    price = hooked.catalog.by_id(MODEL).price_credits
    for request_id in (fresh, older):
        assert bodies[request_id]["cost"] == {"credits": price, "state": "charged"}
        assert bodies[request_id]["cost"] == http.get(f"{FLUX}/requests/{request_id}/status",
                                                      headers=auth).json["cost"]
    assert hooked.webhooks.pending() == 0 and not hooked.webhooks.owed(older)


def test_events_queued_behind_one_an_earlier_version_owed_name_their_provider_and_cost(app, http, auth, hooked,
                                                                                      client):
    request_id = http.post(f"{FLUX}/requests", json={"prompt": "hook"},
                           headers={**auth, "X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook",
                                    "X-Comfy-Webhook-Events": "started,completed"}).json["request_id"]
    hooked.store.claim(record_of(hooked, request_id, "bfl"),
                       Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3))
    complete(hooked, request_id, output=b"{}", content_type="application/json")
    queued = hooked.webhooks.queued(request_id)
    assert [event["type"] for event in queued] == ["completed"]
    client.delete(keys.webhook_next(request_id))
    client.rpush(keys.webhook_next(request_id),
                 json.dumps({k: v for k, v in queued[0].items() if k not in ("provider", "cost_credits",
                                                                             "cost_state")}))
    earlier.owe_event_as_before(client, request_id, "bfl")
    earlier.mark_earlier_layout(client)
    migrate_keys(app)
    assert hooked.webhooks.queued(request_id) == [queued[0]]
    assert hooked.webhooks.event(request_id)["provider"] == "bfl"


#: A well-formed id no request has: how an unknown id is answered.
UNKNOWN = "00000000-0000-9000-8000-000000000001"
#: Each route that reads a request by its id: (method, what follows the id).
BY_ID = (("GET", "/status"), ("GET", ""), ("PUT", "/cancel"), ("POST", "/retry"))


def written_as_version_8(http, auth, hooked, client) -> list[str]:
    """Two requests as an earlier version wrote them under version-8 ids: one
    completed, its webhook event owed; one waiting."""
    headers = {**auth, "X-Comfy-Webhook-Url": "http://127.0.0.1:9/hook"}
    completed, waiting = (http.post(f"{FLUX}/requests", json={"prompt": f"v8 {n}"}, headers=headers).json["request_id"]
                          for n in range(2))
    complete(hooked, completed, output=b"{}", content_type="application/json")
    return [earlier.write_as_version_8(client, request_id, "bfl") for request_id in (completed, waiting)]


def assert_answered_as_unknown(http, auth, request_id) -> None:
    for method, after in BY_ID:
        answer, unknown = (http.open(f"{FLUX}/requests/{id_}{after}", method=method, headers=auth)
                           for id_ in (request_id, UNKNOWN))
        assert_error(answer, 404, "request_not_found")
        assert answer.json["detail"] == unknown.json["detail"], (method, after)


def test_version_8_requests_left_are_not_read_and_refuse_the_migration_naming_them_and_the_flag(
        app, http, auth, hooked, client):
    old_ids = written_as_version_8(http, auth, hooked, client)
    left = earlier.version_8_keys(client)
    assert len(left) == 6  # two records and bodies, a result, an event, and its due set
    last_expiry = time.time() + max(client.pttl(key) for key in left) / 1000
    for old_id in old_ids:
        assert_answered_as_unknown(http, auth, old_id)
    earlier.mark_earlier_layout(client)

    refused = cli_runner(app).invoke(main, ["ops", "migrate-keys"])
    assert refused.exit_code == 1
    said = " ".join(refused.output.split())
    assert ("2 requests minted before ids carried their provider's code (version 8) are still in the store "
            "(6 keys, the last expiring at ") in said
    assert "`router-queue ops migrate-keys --drop-version-8` to delete them" in said
    expiring = re.search(r"the last expiring at (\S+Z)\)", said)
    assert expiring and abs(time.mktime(time.strptime(expiring[1], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
                            - last_expiry) < 5
    assert sorted(earlier.version_8_keys(client)) == sorted(left)
    assert client.get(keys.layout()) == earlier.OLD_LAYOUT.encode()
    as_process_starting(hooked)
    with pytest.raises(StoreLost, match="router-queue ops migrate-keys"):
        create_app(hooked.settings, services=hooked)


def test_with_the_flag_version_8_requests_are_deleted_the_layout_marked_and_their_ids_answer_404(
        app, http, auth, hooked, client):
    old_ids = written_as_version_8(http, auth, hooked, client)
    earlier.mark_earlier_layout(client)
    done = migrate_keys(app, "--drop-version-8")
    assert ("deleted 2 requests minted before ids carried their provider's code (version 8), 6 keys") in done
    assert earlier.version_8_keys(client) == []
    assert client.get(keys.layout()) == keys.LAYOUT.encode()
    as_process_starting(hooked)
    hooked.accounts.epoch.check()  # a process starting on it is not refused
    for old_id in old_ids:
        assert_answered_as_unknown(http, auth, old_id)
    assert "deleted 0 requests minted before ids carried their provider's code (version 8), 0 keys" \
        in migrate_keys(app, "--drop-version-8")
    assert hooked.webhooks.pending() == 1  # the event the request owes under its own id only


def test_keys_of_an_earlier_layout_of_a_version_8_id_keep_the_global_tag_where_migrate_keys_finds_them(client):
    old_id = earlier.version_8_id(client.set(keys.id_secret(), "s") and client, "ws_1", "bfl/flux-2-pro")
    for kind in ("req", "result", "body", "webhook"):
        assert current_name(f"rq:{kind}:{old_id}") == current_name(f"{{rq}}:{kind}:{old_id}") \
            == f"{{rq}}:{kind}:{old_id}"
    assert current_name(f"rq:webhook:{old_id}:next") == f"{{rq}}:webhook:{old_id}:next"
