"""The store on a Redis Cluster (``REDIS_URL=redis+cluster://…``): three
primaries and a replica of each, started here; Celery's broker a Redis of its
own, as ``settings.py`` requires. Each provider's keys (its requests' too), each
workspace's and the global ones carry a hash tag of their own, so the primaries
share the store; a fault here hits the primary serving Flux's provider
(``docs/ARCHITECTURE.md``, "Redis Cluster")."""

from __future__ import annotations

from typing import Iterator

import pytest

from router_queue.store import keys
from router_queue.store.cluster import register_script
from tests.integration.harness import FLUX, RunningStack, unique_prompt, wait_for
from tests.integration.outage_support import STALL_EACH_S, Fault, outage_under_load, private_env, stalls_under_load
from tests.redis_servers import ClusterGroup, PrivateRedis

#: The hash tag of Flux's provider: its schedule and its requests' keys.
BFL = keys.provider_prefix("bfl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterGroup, RunningStack]]:
    group = ClusterGroup(tmp_path_factory.mktemp("cluster-redis"))
    broker = PrivateRedis(tmp_path_factory.mktemp("cluster-broker"))
    try:
        group.start()
        broker.start()
        objects = tmp_path_factory.mktemp("cluster-objects")  # big bodies and results: a directory store
        # REDIS_WAIT_REPLICAS: without it, a failover may lose a write its replica had not yet
        # received (docs/DELIVERY.md); the fault tests below count none lost
        with RunningStack.start(private_env(group.url, CELERY_BROKER_URL=broker.url, REDIS_READ_URL=group.url,
                                             OBJECT_STORE_URL=f"file://{objects}", REDIS_WAIT_REPLICAS="1",
                                             REDIS_WAIT_TIMEOUT_MS="200"),
                                tmp_path_factory.mktemp("cluster-logs"), label="cluster stack") as running:
            yield group, running
    finally:
        broker.stop()
        group.stop()


def test_a_request_runs_on_a_cluster_store_from_submit_to_result(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    group, running = cluster
    with running.caller("cluster-flow") as caller:
        body = {"prompt": unique_prompt("on a cluster")}
        first = caller.submit(FLUX, body, headers={"Idempotency-Key": "cluster-1"})
        assert first.status_code == 201, first.text
        request_id = first.json()["request_id"]
        replay = caller.submit(FLUX, body, headers={"Idempotency-Key": "cluster-1"})
        assert replay.json()["request_id"] == request_id
        assert caller.wait_status(FLUX, request_id)["status"] == "COMPLETED"
        assert caller.result(FLUX, request_id).status_code == 200
        assert running.stub.submits("bfl_submit", body) == 1
        waiting = caller.submit_ok(FLUX, {"prompt": unique_prompt("cancelled on a cluster", "[stub:latency=30]")})
        assert caller.cancel(FLUX, waiting).status_code in (200, 202)
        assert caller.wait_status(FLUX, waiting)["error_type"] == "cancelled"
        charged = [e.request_id for e in running.services.accounts.ledger(caller.workspace) if e.type == "charge"]
        assert request_id in charged and len(charged) == len(set(charged))
        # the workspace's side of each ending, given in a step of its own (store/owed.py): given, and once
        assert running.services.redis.hget(keys.request(request_id), "open") == b"1"  # admitted split
        workspace = running.services.accounts.get(caller.workspace)
        assert (workspace.held, workspace.queued, workspace.queued_bytes) == (0, 0, 0)
        assert running.services.redis.zcard(keys.owed("bfl")) == 0
        assert running.services.redis.hlen(keys.open_requests(caller.workspace)) == 0
    # a request's keys on its provider's primary, a workspace's on its own, each provider on a primary of its own
    with group._client(group.owner(BFL).port) as client:
        assert client.exists(keys.request(request_id), keys.result(request_id)) == 2
    with group._client(group.owner(keys.workspace_prefix(caller.workspace)).port) as client:
        assert client.exists(keys.workspace(caller.workspace), keys.ledger(caller.workspace)) == 2
    assert len({group.owner(keys.provider_prefix(p)).port for p in ("bfl", "vertexai", "openai")}) == 3


def test_a_large_body_and_its_result_on_a_cluster_store(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """A body over BODY_INLINE_MAX_BYTES goes to the object store and is
    deleted once its request ends; the result counts in the workspace's
    stored bytes, given in the workspace's own step (store/owed.py)."""
    group, running = cluster
    with running.caller("cluster-big-body") as caller:
        body = {"prompt": unique_prompt("a big body on a cluster"), "input_image": "A" * 200_000}
        request_id = caller.submit_ok(FLUX, body)
        assert caller.wait_status(FLUX, request_id)["status"] == "COMPLETED"
        result = caller.result(FLUX, request_id)
        assert result.status_code == 200
        assert running.services.redis.exists(keys.body(request_id)) == 0
        workspace = running.services.accounts.get(caller.workspace)
        assert (workspace.queued_bytes, workspace.stored_bytes) == (0, len(result.content))
        assert running.services.redis.zcard(keys.owed("bfl")) == 0
        blobs = running.services.blobs
        assert blobs is not None
        # its object, due once its pointer is gone, is deleted by beat's sweeper (each second here)
        wait_for(lambda: not [k for k in blobs.keys_under("bodies") if f"/{request_id}-" in k])


def test_a_node_without_the_scripts_is_given_them_at_the_first_call(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """What a promoted replica is: a primary holding the data but none of the
    scripts (SCRIPT FLUSH here). The first call loads each on the slot's node."""
    group, running = cluster
    with group._client(group.owner(BFL).port) as client:
        client.script_flush()
    with running.caller("cluster-noscript") as caller:
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("after a script flush")})
        assert caller.wait_status(FLUX, request_id)["status"] == "COMPLETED"
        assert "error_type" not in caller.status_body(FLUX, request_id)


def test_a_write_a_caller_is_told_of_waits_for_its_slots_replica(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """REDIS_WAIT_REPLICAS on a cluster: the script and its ``WAIT`` go to the slot's
    primary on one connection, so a stopped replica makes the write count as
    answered unreplicated (a ``WAIT`` on any other connection has no offset to wait
    for, and would answer at once that the replica had it)."""
    group, running = cluster
    store = running.services.store
    assert store.acknowledged.replication.replicas == 1
    script = register_script(running.services.redis, "redis.call('set', KEYS[1], ARGV[1]) return 'SET'")
    key = f"{BFL}:replicated"
    assert store.acknowledged.run(script, keys=[key], args=["1"]) == b"SET"
    before = store.unreplicated
    _, replica = group.serving(BFL)
    replica.pause()
    try:
        assert store.acknowledged.run(script, keys=[key], args=["2"]) == b"SET"
    finally:
        replica.resume()
    assert store.unreplicated == before + 1
    assert running.services.redis.get(key) == b"2"
    running.services.redis.delete(key)


def _evalsha_ro_calls(group: ClusterGroup, node: PrivateRedis) -> int:
    with group._client(node.port) as client:
        return int(client.info("commandstats").get("cmdstat_evalsha_ro", {}).get("calls", 0))


def test_status_polls_are_served_by_the_slots_replica(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """REDIS_READ_URL is the cluster's own URL: polls read the slot's replica
    (EVALSHA_RO), and one sent right after the 201 is read on the primary."""
    group, running = cluster
    primary, *replicas = group.serving(BFL)
    before = {node.port: _evalsha_ro_calls(group, node) for node in (primary, *replicas)}
    with running.caller("cluster-replica-reads") as caller:
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("read on a replica", "[stub:latency=1]")})
        assert caller.status(FLUX, request_id).status_code == 200  # at once: never 404
        for _ in range(20):
            assert caller.status(FLUX, request_id).status_code == 200
        assert caller.wait_status(FLUX, request_id)["status"] == "COMPLETED"
    assert _evalsha_ro_calls(group, primary) == before[primary.port]
    assert sum(_evalsha_ro_calls(group, node) - before[node.port] for node in replicas) >= 15


#: What a replica waits at least, once its primary is failed, before it asks to be
#: promoted (Redis Cluster: 500 ms plus a random delay plus its rank's).
FAILOVER_DELAY_S = 0.5


def _slot_fault(group: ClusterGroup, name: str, act: str, undo: str) -> Fault:
    """``act`` ("kill", "pause") on the primary serving Flux's provider's slot; the fault ends
    when its replica has taken the slot over, then ``undo`` ("start", "resume") brings
    the old primary back, as a replica of the new one."""
    hit: list[PrivateRedis] = []

    def begin() -> None:
        hit.append(group.owner(BFL))
        getattr(hit[0], act)()

    return Fault(name, begin, heal=lambda: getattr(hit[0], undo)(),
                 healed=lambda: bool(hit) and group.moved_from(hit[0], BFL),
                 surely_down_s=group.NODE_TIMEOUT_MS / 1000 + FAILOVER_DELAY_S, heal_within_s=40.0,
                 in_flight_s=0.05)  # SIGKILL and SIGSTOP act at once


@pytest.mark.slow
def test_cluster_failover_under_load(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """The primary serving Flux's provider's slot SIGKILLed; the cluster promotes its
    replica; the front door and workers follow the slot with no restart."""
    group, running = cluster
    outage_under_load(running, _slot_fault(group, "cluster failover", "kill", "start"))


@pytest.mark.slow
def test_cluster_stall_under_load(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """The slot's primary SIGSTOPped (a hung host): the cluster calls it down after
    its node timeout and promotes the replica; once resumed, the old primary
    follows the new one and writes nothing of its own."""
    group, running = cluster
    outage_under_load(running, _slot_fault(group, "cluster stall", "pause", "resume"))


@pytest.mark.slow
def test_no_503_during_stalls_of_the_slots_primary_was_admitted(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """Issue 32's item 12 on a cluster: the slot's primary SIGSTOPped for 8 s, ten times."""
    group, running = cluster
    stalled: list[PrivateRedis] = []

    def begin() -> None:  # whichever primary serves the slot now (an earlier stall may have moved it)
        stalled[:] = [group.owner(BFL)]
        stalled[0].pause()

    stalls_under_load(running, Fault("cluster stalls", begin, heal=lambda: stalled[0].resume(),
                                      lasts_s=STALL_EACH_S))


@pytest.mark.slow
def test_the_whole_slot_killed_under_load(cluster: tuple[ClusterGroup, RunningStack]) -> None:
    """The slot's primary and its replica SIGKILLed together, restarted from their
    append-only files 4 s later: an outage, as one Redis killed is."""
    group, running = cluster
    nodes: list[PrivateRedis] = []

    def begin() -> None:
        nodes.extend(group.serving(BFL))
        for node in nodes:
            node.kill()

    def heal() -> None:
        for node in nodes:
            node.start()

    outage_under_load(running, Fault("cluster slot killed", begin, heal=heal))
