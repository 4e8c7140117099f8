"""A store an earlier version left (its shared draining and webhook due sets, a
request completed and its event owed before costs were kept, a request minted
before ids carried their provider's code) on a real Redis (a Redis Cluster with
``TEST_STORE=cluster``): refused until ``router-queue ops migrate-keys`` runs
(with ``--drop-version-8`` while version-8 requests are left), then read
through the normal paths, the status, the result and the webhook a receiver
gets, and the version-8 id answered 404 (``store/migrate_data.py``).

The stack starts without its webhooks worker, as if the service were
stopped for the upgrade: the events owed meanwhile wait in the due sets."""

from __future__ import annotations

from typing import Iterator

import pytest

from router_queue.dev.stack import free_port
from router_queue.errors import StoreLost
from router_queue.services import Services
from router_queue.settings import Settings
from tests import earlier_store as earlier
from tests.redis_servers import ClusterGroup, PrivateRedis

from .conftest import ON_CLUSTER
from .harness import FLUX, WEBHOOKS_WORKER, RunningStack, stack_env, unique_prompt, wait_for
from .webhook_support import Receiver, cli, cli_ok, workspace_with_secret


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """A stack of our own, on a Redis (or a cluster, and a broker) of its own."""
    broker = None
    if ON_CLUSTER:
        store = ClusterGroup(tmp_path_factory.mktemp("migrate-cluster"))
        broker = PrivateRedis(tmp_path_factory.mktemp("migrate-broker"), persist=False)
        broker.start()
    else:
        store = PrivateRedis(tmp_path_factory.mktemp("migrate-redis"), persist=False)
    store.start()
    try:
        env = stack_env(store.url, stub_port=free_port(), broker_url=broker.url if broker else None,
                        WEBHOOK_ALLOW_LOOPBACK_HTTP="1")
        with RunningStack.start(env, tmp_path_factory.mktemp("migrate-logs"), label="migrate stack") as running:
            yield running
    finally:
        store.stop()
        if broker is not None:
            broker.stop()


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    made = Receiver(tmp_path_factory.mktemp("migrate-receiver"))
    try:
        yield made
    finally:
        made.stop()


def test_a_store_an_earlier_version_left_is_refused_then_migrated_and_read_as_before(
        upgraded: RunningStack, receiver: Receiver) -> None:
    client = upgraded.services.redis
    caller, secret = workspace_with_secret(upgraded, "migrate")
    with caller:
        url = receiver.configure("migrate", secrets={"current": secret})
        prompts = {name: unique_prompt(f"migrate {name}") for name in ("fresh", "older")}
        ids = {name: caller.submit_ok(FLUX, {"prompt": prompt}, headers={"X-Comfy-Webhook-Url": url})
               for name, prompt in prompts.items()}
        for request_id in ids.values():
            assert caller.wait_status(FLUX, request_id)["status"] == "COMPLETED"
        before = {name: caller.status_body(FLUX, request_id) for name, request_id in ids.items()}
        wait_for(lambda: upgraded.services.webhooks.owed(ids["older"]), what="the older request's event owed")

        # what an earlier version left: a request under a version-8 id, its event in
        # the shared due set naming neither provider nor cost, its record without
        # a cost, Flux's provider drained in the shared set, and the previous
        # layout's marker
        old_id = earlier.write_as_version_8(client, ids["older"], "bfl")
        old_keys = len(earlier.version_8_keys(client))
        earlier.owe_event_as_before(client, ids["older"], "bfl")
        earlier.forget_cost(client, ids["older"])
        earlier.drain_as_before(client, "bfl")
        earlier.mark_earlier_layout(client)

        refused = cli(upgraded.env, "ops", "depths")
        assert refused.returncode != 0 and "router-queue ops migrate-keys" in refused.stderr, refused
        starting = Services.build(Settings.from_env(upgraded.env))
        try:
            with pytest.raises(StoreLost, match="router-queue ops migrate-keys"):
                starting.accounts.epoch.check()  # a process of this version starting on it
        finally:
            starting.redis.close()

        unfinished = cli(upgraded.env, "ops", "migrate-keys")
        said = " ".join(unfinished.stderr.split())
        assert unfinished.returncode != 0 and (
            f"1 requests minted before ids carried their provider's code (version 8) are still in the store "
            f"({old_keys} keys, the last expiring at ") in said and "migrate-keys --drop-version-8" in said, unfinished
        assert unfinished.stdout.splitlines()[1] == (
            "rewrote 1 draining marks, 1 due webhook events, 1 completed records' costs and "
            "1 webhook events an earlier version wrote"), unfinished
        assert len(earlier.version_8_keys(client)) == old_keys
        with pytest.raises(StoreLost, match="router-queue ops migrate-keys"):
            starting = Services.build(Settings.from_env(upgraded.env))
            try:
                starting.accounts.epoch.check()  # still refused: the marker is not written
            finally:
                starting.redis.close()

        done = cli_ok(upgraded.env, "ops", "migrate-keys", "--drop-version-8").stdout.splitlines()
        assert done[1] == ("deleted 1 requests minted before ids carried their provider's code (version 8), "
                           f"{old_keys} keys"), done
        assert earlier.version_8_keys(client) == []
        assert not client.exists(earlier.OLD_WEBHOOKS_DUE, earlier.OLD_DRAINING)
        depths = [line.split("\t") for line in cli_ok(upgraded.env, "ops", "depths").stdout.splitlines()[1:]]
        assert [row[5] for row in depths if row[0] == "bfl"] == ["yes"]  # still drained

        for name, request_id in ids.items():
            assert caller.status_body(FLUX, request_id) == before[name], name
            assert caller.result(FLUX, request_id).status_code == 200
        for answer in (caller.status(FLUX, old_id), caller.result(FLUX, old_id), caller.cancel(FLUX, old_id)):
            assert answer.status_code == 404 and answer.json()["error_type"] == "request_not_found", answer.text
        refusal = caller.submit(FLUX, {"prompt": unique_prompt("while drained")})
        assert refusal.status_code == 503, refusal.text
        cli_ok(upgraded.env, "ops", "drain", "bfl", "--off")

        upgraded.start_worker(WEBHOOKS_WORKER)  # the service started again
        attempts = receiver.wait_attempts("migrate", 2, answered=True)
        events = {attempt["event"]["request_id"]: attempt for attempt in attempts}
        assert set(events) == set(ids.values())
        for name, request_id in ids.items():
            assert events[request_id]["verified"], events[request_id]["errors"]
            assert events[request_id]["event"]["cost"] == before[name]["cost"], name
        for request_id in ids.values():
            wait_for(lambda: upgraded.services.webhooks.event(request_id).get("state") == "delivered",
                     what=f"{request_id} delivered")
        assert upgraded.services.webhooks.pending() == 0
