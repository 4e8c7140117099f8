"""Status polls served by a read replica (REDIS_READ_URL), on a real primary
and a real replica: the replica answers polls, a request it does not have yet
is read on the primary, rate counting stays on the primary in batches, and
the replica gone costs a poll nothing but its fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
import redis

from router_queue.services import Services
from router_queue.settings import Settings
from router_queue.store import keys
from router_queue.store.rate_counts import SyncedRateCounts
from router_queue.store.scripts import load_script
from router_queue.web.app import create_app
from tests.redis_servers import PrivateRedis, wait_for
from tests.unit.conftest import RecordingDispatcher

FLUX = "/v2/models/bfl/flux-2-pro"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[PrivateRedis, PrivateRedis]]:
    (tmp_path / "primary").mkdir()
    (tmp_path / "replica").mkdir()
    primary = PrivateRedis(tmp_path / "primary", persist=False)
    primary.start()
    replica = PrivateRedis(tmp_path / "replica", persist=False, extra=("--replicaof", "127.0.0.1", str(primary.port)))
    try:
        replica.start()
        wait_for(lambda: redis.Redis(port=replica.port).info("replication")["master_link_status"] == "up",
                 timeout_s=20, what="the replica's link to its primary")
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def _front(primary: PrivateRedis, replica: PrivateRedis, rate_limit: str = "1000/second"):
    settings = Settings(redis_url=primary.url, redis_read_url=replica.url, public_base_url="http://router.test",
                        default_rate_limit=rate_limit)
    services = Services.build(settings, dispatcher=RecordingDispatcher())
    workspace = services.accounts.create_workspace("reads", queue_enabled=True, credits=10_000)
    auth = {"X-API-Key": services.accounts.mint_key(workspace)}
    return services, create_app(settings, services=services).test_client(), auth


def _submit(http, auth) -> str:
    answer = http.post(f"{FLUX}/requests", data=json.dumps({"prompt": "read me"}),
                       headers={**auth, "Content-Type": "application/json"})
    assert answer.status_code == 201, answer.json
    return answer.json["request_id"]


def _script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


def test_polls_are_read_on_the_replica_and_a_request_it_lacks_on_the_primary(pair):
    primary, replica = pair
    services, http, auth = _front(primary, replica)
    request_id = _submit(http, auth)
    wait_for(lambda: services.store.reads.exists(keys.request(request_id)), timeout_s=5, what="replication")
    replica_client = redis.Redis(port=replica.port)
    assert http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).status_code == 200  # loads the script there
    before, primary_before = _script_calls(replica_client), _script_calls(redis.Redis(port=primary.port))
    for _ in range(5):
        answer = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth)
        assert answer.status_code == 200 and answer.json["status"] == "IN_QUEUE"
    assert _script_calls(replica_client) - before == 5
    # the primary ran at most the rate counts' syncs, never the reads
    assert _script_calls(redis.Redis(port=primary.port)) - primary_before <= 2

    # A replica that has not received the request yet: the primary answers, never 404.
    replica_client.execute_command("REPLICAOF", "NO", "ONE")  # it stops following: new writes miss it
    fresh = _submit(http, auth)
    answer = http.get(f"{FLUX}/requests/{fresh}/status", headers=auth)
    assert answer.status_code == 200 and answer.json["request_id"] == fresh


def test_a_replica_that_cannot_answer_costs_a_poll_nothing_but_the_primary_read(pair):
    primary, replica = pair
    services, http, auth = _front(primary, replica)
    request_id = _submit(http, auth)
    replica.stop()
    answer = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth)
    assert answer.status_code == 200 and answer.json["request_id"] == request_id


def test_polls_read_on_the_replica_are_still_rate_limited_and_cost_the_primary_a_write_per_sync(pair):
    primary, replica = pair
    services, http, auth = _front(primary, replica, rate_limit="20/minute")
    request_id = _submit(http, auth)  # one call of the 20
    wait_for(lambda: services.store.reads.exists(keys.request(request_id)), timeout_s=5, what="replication")
    primary_client = redis.Redis(port=primary.port)
    syncs = int(primary_client.info("commandstats").get("cmdstat_incrby", {}).get("calls", 0))
    polls = [http.get(f"{FLUX}/requests/{request_id}/status", headers=auth) for _ in range(25)]
    answers = [poll.status_code for poll in polls]
    assert answers[:19] == [200] * 19
    # where the window stands as this process knows it: the primary's count at its sync, and its own since
    assert [poll.headers["RateLimit"].split(";t=")[0] for poll in polls[:3]] == [
        '"minute";r=18', '"minute";r=17', '"minute";r=16']
    assert polls[19].headers["RateLimit"].startswith('"minute";r=0;t=')
    assert answers[19:] == [429] * 6
    limited = http.get(f"{FLUX}/requests/{request_id}/status", headers=auth)
    assert limited.headers["X-Comfy-Error-Type"] == "rate_limited" and int(limited.headers["Retry-After"]) >= 1
    # 26 polls, counted on the primary in a few syncs (one per SYNC_S at most), not a write each
    synced = int(primary_client.info("commandstats")["cmdstat_incrby"]["calls"]) - syncs
    assert 1 <= synced <= 5


def test_batched_counts_refuse_past_the_limit_and_start_again_in_a_new_window(pair):
    primary, _ = pair
    client = redis.Redis(port=primary.port)
    now = [100.0]
    counts = SyncedRateCounts(load_script(client, "rate_add"), sync_s=0.1, clock=lambda: now[0])
    window = keys.rate_window("test")
    windows, args = [window], [3, 2]  # 3 calls per 2 s
    counted = [counts.spend(windows, args) for _ in range(3)]
    assert [reply[0] for reply in counted] == [0, 0, 0]
    assert [reply[1][0] for reply in counted] == [1, 2, 3]  # where the window stands, as rate.lua answers
    assert all(0 < reply[1][1] <= 2000 for reply in counted)
    refused = counts.spend(windows, args)
    assert refused[0] == 1 and 0 < refused[1] <= 2000
    assert int(client.get(window)) == 1  # synced once, at the first call; the rest counted here
    now[0] += 0.2
    assert counts.spend(windows, args)[0] == 1  # the sync adds the 4 counted since: still spent
    assert int(client.get(window)) == 5
    client.delete(window)  # the window ended on the primary (as its expiry would)
    now[0] += 2.0
    restarted = counts.spend(windows, args)
    assert restarted[0] == 0 and restarted[1][0] == 1 and 1900 <= restarted[1][1] <= 2000
    assert int(client.get(window)) == 1


def test_a_stalled_replica_is_passed_over_after_one_poll_waited_for_it(pair):
    primary, replica = pair
    settings = Settings(redis_url=primary.url, redis_read_url=replica.url, public_base_url="http://router.test")
    services = Services.build(settings, dispatcher=RecordingDispatcher(), wait_s=0.3)
    workspace = services.accounts.create_workspace("stall", queue_enabled=True, credits=10_000)
    auth = {"X-API-Key": services.accounts.mint_key(workspace)}
    http = create_app(settings, services=services).test_client()
    request_id = _submit(http, auth)
    wait_for(lambda: services.store.reads.exists(keys.request(request_id)), timeout_s=5, what="replication")
    replica_client = redis.Redis(port=replica.port)
    assert http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).status_code == 200
    before = _script_calls(replica_client)
    replica.pause()
    try:
        answers = [http.get(f"{FLUX}/requests/{request_id}/status", headers=auth) for _ in range(5)]
    finally:
        replica.resume()
    assert [a.status_code for a in answers] == [200] * 5 and {a.json["status"] for a in answers} == {"IN_QUEUE"}
    # only the first of the five was sent to the stalled replica (it ran once the replica woke)
    wait_for(lambda: _script_calls(replica_client) >= before + 1, timeout_s=5, what="the buffered read")
    assert _script_calls(replica_client) == before + 1
