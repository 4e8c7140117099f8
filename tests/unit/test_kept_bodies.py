"""Bodies kept past their requests' ends (issue 32, item 1; item 7): a retry
shares its chain's kept body instead of copying it, a chain's retries are
capped, and a workspace's kept bytes are a quota with an honest Retry-After;
on one Redis and a split store, fakeredis and a real Redis."""

from __future__ import annotations

import json
import time

import fakeredis
import pytest

from router_queue.requests.outcomes import Claim
from router_queue.services import Services
from router_queue.store import keys
from tests.unit.conftest import RecordingDispatcher
from tests.unit.route_support import LEASE, assert_error, failed, retry, status_of, submit
from tests.unit.support import record_of

#: The issue's body: a BFL prompt with a ~900 KB input_image.
BIG = {"prompt": "a teapot, as in the picture", "input_image": "A" * 900_000}
BIG_BYTES = len(json.dumps(BIG))
LATE = {"X-Comfy-Start-Deadline": "0.001"}


@pytest.fixture(params=[False, True], ids=["one step", "split"])
def services(client, settings, request) -> Services:
    return Services.build(settings, client, dispatcher=RecordingDispatcher(), split=request.param)


def timed_out(services, request_id: str) -> None:
    """End a request past its X-Comfy-Start-Deadline, as its first claim would."""
    record = record_of(services, request_id, "bfl")
    assert services.store.claim(record, LEASE, now=record.created_at + 1) is Claim.QUEUE_TIMEOUT


def kept_bodies(services) -> dict[str, int]:
    """Every body key and its bytes."""
    return {name.decode(): services.redis.strlen(name) for name in services.redis.scan_iter(match="*:body:*")
            if not name.endswith(b":refs")}


def used_memory(services) -> int | None:
    if isinstance(services.redis, fakeredis.FakeRedis):
        return None  # fakeredis answers no memory figures
    return int(services.redis.info("memory")["used_memory"])


def test_thirty_retries_of_a_900_kb_body_keep_it_once(http, auth, services, workspace):
    services.store.retry_max = 30  # the scenario; the cap is its own test
    original = submit(http, auth, BIG, headers=LATE).json["request_id"]
    timed_out(services, original)
    before = used_memory(services)
    for _ in range(30):
        response = retry(http, auth, original, headers=LATE)
        assert response.status_code == 201, response.get_data(as_text=True)
        timed_out(services, response.json["request_id"])
    assert kept_bodies(services) == {keys.body(original): BIG_BYTES}  # one copy, not 31
    after = used_memory(services)
    if before is not None:
        assert after - before < BIG_BYTES  # the 30 records, not 30 bodies (26.4 MiB before)
    ws = services.accounts.get(workspace)
    assert (ws.stored_bytes, ws.queued_bytes) == (BIG_BYTES, 0)  # counted once
    # the body outlives every record naming it: its TTL is the last one's
    assert services.redis.ttl(keys.body(original)) >= services.redis.ttl(keys.request(original))
    last = status_of(http, auth, response.json["request_id"])
    assert (last["status"], last["error_type"], last["retry_of"]) == ("COMPLETED", "queue_timeout", original)


def test_a_retry_runs_its_shared_body_and_a_retry_of_a_retry_shares_it_too(http, auth, services, workspace):
    original = failed(http, auth, services, body=BIG)
    first = retry(http, auth, original).json["request_id"]
    assert services.store.load(first)[1] == json.dumps(BIG).encode()  # what its worker sends
    assert services.redis.ttl(keys.body(original)) == -1  # kept while a retry sharing it waits
    services.store.claim(record_of(services, first, "bfl"), LEASE)
    services.store.complete(record_of(services, first, "bfl"), error_type="provider_error", detail="again")
    second = retry(http, auth, first).json["request_id"]
    assert services.store.load(second)[1] == json.dumps(BIG).encode()
    services.store.claim(record_of(services, second, "bfl"), LEASE)
    services.store.complete(record_of(services, second, "bfl"), output=b"{}", content_type="application/json")
    # a success sharing it keeps it: the chain's failed requests may still be retried
    assert list(kept_bodies(services)) == [keys.body(original)]
    assert retry(http, auth, original).status_code == 201


def test_concurrent_retries_keep_the_shared_body_until_the_last_ends(http, auth, services, workspace):
    original = failed(http, auth, services, body=BIG)
    one, two = (retry(http, auth, original).json["request_id"] for _ in range(2))
    services.store.cancel(request_id=one, workspace=workspace, model="bfl/flux-2-pro", provider="bfl")
    assert services.redis.ttl(keys.body(original)) == -1  # the other still waits on it
    assert services.store.load(two)[1] == json.dumps(BIG).encode()
    services.store.cancel(request_id=two, workspace=workspace, model="bfl/flux-2-pro", provider="bfl")
    assert 0 < services.redis.ttl(keys.body(original)) <= services.settings.result_retention_s
    ws = services.accounts.get(workspace)
    assert (ws.stored_bytes, ws.queued_bytes) == (BIG_BYTES, 0)


def test_a_chain_of_retries_is_capped_and_the_refusal_queues_and_charges_nothing(http, auth, services, workspace):
    assert services.store.retry_max == services.settings.retry_max_per_request == 10
    original = failed(http, auth, services)
    latest = original
    for n in range(10):  # retries of the original and of its retries count together
        response = retry(http, auth, original if n % 2 else latest)
        assert response.status_code == 201, response.get_data(as_text=True)
        latest = response.json["request_id"]
        services.store.cancel(request_id=latest, workspace=workspace, model="bfl/flux-2-pro", provider="bfl")
    credits = services.accounts.get(workspace).credits
    for request_id in (original, latest):
        refused = retry(http, auth, request_id)
        assert_error(refused, 409, "retry_limit_reached")
        assert "10 retries" in refused.json["detail"]
    ws = services.accounts.get(workspace)
    assert (ws.queued, ws.held, ws.credits) == (0, 0, credits)  # (a split store's hold was given back)
    assert submit(http, auth).status_code == 201  # a new body starts a chain of its own


def test_kept_bytes_over_the_quota_refuse_submits_and_retries_until_enough_expire(http, auth, services,
                                                                                  workspace):
    small = {"prompt": "a small teapot"}
    services.store.retention_s = 100
    first = failed(http, auth, services, body=small)
    services.store.retention_s = 200
    second = failed(http, auth, services, body={"prompt": "a second small teapot"})
    kept = services.accounts.get(workspace).stored_bytes
    assert kept == len(json.dumps(small)) + len(json.dumps({"prompt": "a second small teapot"}))
    services.accounts.set_limits(workspace, max_stored_bytes=kept + 5)
    queued, ledger = services.accounts.get(workspace).queued, len(services.accounts.ledger(workspace))

    one_must_go = submit(http, auth, small)  # room once the first kept body expires
    assert_error(one_must_go, 429, "stored_bytes_full")
    assert 90 <= int(one_must_go.headers["Retry-After"]) <= 100
    both_must_go = submit(http, auth, {"prompt": "x" * (kept - len(json.dumps({"prompt": ""})))})
    assert_error(both_must_go, 429, "stored_bytes_full")
    assert 190 <= int(both_must_go.headers["Retry-After"]) <= 200
    never_fits = submit(http, auth, {"prompt": "x" * (kept + 10)})
    assert_error(never_fits, 429, "stored_bytes_full")
    assert never_fits.headers["Retry-After"] == "3600"  # the most it names
    assert_error(retry(http, auth, second), 429, "stored_bytes_full")
    services.accounts.set_limits(workspace, max_stored_bytes=1, max_queued_bytes=1)
    assert_error(submit(http, auth, small), 429, "queued_bytes_full")  # checked first
    assert services.accounts.get(workspace).queued == queued  # nothing queued
    assert len(services.accounts.ledger(workspace)) == ledger  # nor charged

    services.accounts.set_limits(workspace, max_stored_bytes=kept + 5, max_queued_bytes=10_000)
    # the first kept body expires: its bytes are released at the next admission
    services.redis.zadd(keys.stored(workspace), {f"{first}|{len(json.dumps(small))}": time.time() - 1})
    assert submit(http, auth, small).status_code == 201
    assert services.accounts.get(workspace).stored_bytes == kept - len(json.dumps(small))


def test_the_default_stored_quota_is_10_gib_and_set_limits_sets_it(services, workspace):
    assert services.store.max_stored_bytes == 10 * 1024 ** 3
    assert services.accounts.get(workspace).max_stored_bytes is None
    services.accounts.set_limits(workspace, max_stored_bytes=1234)
    assert services.accounts.get(workspace).max_stored_bytes == 1234


@pytest.mark.parametrize("services", [True], ids=["split"], indirect=True)
def test_a_retry_of_another_workspaces_request_learns_nothing_of_its_body(http, auth, services, workspace):
    """Item 7: on a split store the queued-bytes check read the named body's
    size before ownership was checked, so a quota's 429 told a stranger's
    body from an unknown id."""
    theirs = services.accounts.mint_key(services.accounts.create_workspace("them", queue_enabled=True, credits=999))
    stranger = failed(http, {"X-API-Key": theirs}, services, body={"prompt": "p" * 5_000})
    unknown = services.ids.mint("ws_nobody", "bfl/flux-2-pro")
    services.accounts.set_limits(workspace, max_queued_bytes=1_000)
    answers = [retry(http, auth, request_id) for request_id in (stranger, unknown)]
    for answer in answers:
        assert_error(answer, 404, "request_not_found")
    assert answers[0].json == answers[1].json
