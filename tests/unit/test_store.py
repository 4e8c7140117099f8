"""The store's Lua contracts, on fakeredis and on a real Redis."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from router_queue.states import COMPLETED, IN_PROGRESS, IN_QUEUE
from router_queue.store import keys
from router_queue.store.record import Submission
from router_queue.store.requests_values import Lease, Pace
from tests.unit.support import record_of

MODEL = "bfl/flux-2-pro"


def lease(token="t1", *, lease_s=30.0, queue_timeout_s=3600.0, max_takeovers=3, resume_key=""):
    return Lease(token=token, lease_s=lease_s, queue_timeout_s=queue_timeout_s,
                 max_takeovers=max_takeovers, resume_key=resume_key)


def admit(services, workspace, *, key_hash="", fingerprint="", body='{"prompt": "x"}', now=None):
    request_id = services.ids.mint(workspace, MODEL)
    outcome = services.store.admit(
        Submission(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl", body=body,
        fingerprint=fingerprint, idempotency_key_hash=key_hash, now=now),
    )
    return request_id, outcome


def test_admit_writes_the_record_and_grants_a_free_slot_under_a_grant_lease(services, workspace):
    request_id, outcome = admit(services, workspace, now=1000.0)
    assert (outcome.outcome, outcome.request_id, outcome.position) == ("ADMITTED", request_id, 0)
    view = services.store.status_view(request_id, "bfl")
    assert view.record.status == IN_QUEUE
    assert view.record.workspace == workspace
    assert view.record.created_at == 1000.0
    assert view.position == 0
    assert services.store.in_flight("bfl") == 1  # the slot is the grant's until its delivery claims it
    grant_lease_end = 1000.0 + services.store.republish_after_s
    assert services.store.reap("bfl", grant_lease_end - 1, again_at=grant_lease_end - 1) == []
    assert services.store.reap("bfl", grant_lease_end + 1, again_at=grant_lease_end + 60) == [(request_id, False)]
    assert services.store.reap("bfl", grant_lease_end + 2, again_at=grant_lease_end + 60) == []  # looked at again later
    record, body = services.store.load(request_id)
    assert body == b'{"prompt": "x"}'


def test_positions_count_requests_ahead(services, workspace):
    ids = [admit(services, workspace)[0] for _ in range(5)]
    assert [services.store.status_view(i, "bfl").position for i in ids] == [0, 1, 2, 3, 4]
    services.store.claim(record_of(services, ids[0], "bfl"), lease())
    services.store.cancel(request_id=ids[2], workspace=workspace, model=MODEL, provider="bfl")
    assert [services.store.status_view(i, "bfl").position for i in ids[1:]] == [0, None, 1, 2]


def test_queue_is_refused_for_a_workspace_without_queued_delivery(services):
    workspace = services.accounts.create_workspace("off", queue_enabled=False)
    request_id, outcome = admit(services, workspace)
    assert outcome.outcome == "NOT_ENABLED"
    assert services.store.status_view(request_id, "bfl").record is None
    assert services.store.queue_depth("bfl") == 0


def test_same_idempotency_key_replays_and_other_body_conflicts(services, workspace):
    first, outcome = admit(services, workspace, key_hash="k", fingerprint="f1")
    assert outcome.outcome == "ADMITTED"
    _, replay = admit(services, workspace, key_hash="k", fingerprint="f1")
    assert (replay.outcome, replay.request_id) == ("REPLAY", first)
    _, conflict = admit(services, workspace, key_hash="k", fingerprint="f2")
    assert conflict.outcome == "IDEM_CONFLICT"
    assert services.store.queue_depth("bfl") == 1
    ttl = services.redis.ttl(keys.idempotency(workspace, "k"))
    assert 0 < ttl <= services.store.idempotency_ttl_s


def test_idempotency_keys_are_scoped_to_the_workspace(services, workspace):
    other = services.accounts.create_workspace("other", queue_enabled=True)
    _, mine = admit(services, workspace, key_hash="k", fingerprint="f")
    _, theirs = admit(services, other, key_hash="k", fingerprint="f")
    assert mine.outcome == theirs.outcome == "ADMITTED"
    assert mine.request_id != theirs.request_id


def test_concurrent_submits_with_one_key_create_one_request(services, workspace):
    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda _: admit(services, workspace, key_hash="k", fingerprint="f")[1], range(64)))
    admitted = [o for o in outcomes if o.outcome == "ADMITTED"]
    assert len(admitted) == 1
    assert {o.request_id for o in outcomes} == {admitted[0].request_id}
    assert services.store.queue_depth("bfl") == 1


def test_claim_lets_exactly_one_delivery_through(services, workspace):
    request_id, _ = admit(services, workspace)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda n: services.store.claim(record_of(services, request_id, "bfl"), lease(f"t{n}")), range(32)))
    assert results.count("CLAIMED") == 1
    assert set(results) == {"CLAIMED", "LEASED"}
    view = services.store.status_view(request_id, "bfl")
    assert view.record.status == IN_PROGRESS and view.record.started_at is not None
    assert view.position is None
    assert services.store.in_flight("bfl") == 1


def test_complete_keeps_the_first_outcome_and_sets_retention(services, workspace):
    request_id, _ = admit(services, workspace)
    services.store.claim(record_of(services, request_id, "bfl"), lease())
    assert services.store.complete(record_of(services, request_id, "bfl"), output=b"\x00bytes", content_type="image/png") == COMPLETED
    assert services.store.complete(record_of(services, request_id, "bfl"), error_type="provider_error", detail="late") == "ALREADY_COMPLETED"
    view = services.store.status_view(request_id, "bfl")
    assert view.record.status == COMPLETED
    assert view.record.error_type is None
    assert view.record.content_type == "image/png"
    assert services.store.result(request_id) == b"\x00bytes"
    assert 0 < view.record.ttl_s <= services.store.retention_s
    assert 0 < services.redis.ttl(keys.result(request_id)) <= services.store.retention_s


def test_a_claim_never_moves_a_completed_request_back(services, workspace):
    request_id, _ = admit(services, workspace)
    services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")
    assert services.store.claim(record_of(services, request_id, "bfl"), lease()) == COMPLETED
    assert services.store.status_view(request_id, "bfl").record.status == COMPLETED


def test_cancel_of_a_queued_request_completes_it_at_once(services, workspace):
    request_id, _ = admit(services, workspace)
    outcome = services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")
    assert outcome == "CANCELLED"
    record = services.store.status_view(request_id, "bfl").record
    assert (record.status, record.error_type) == (COMPLETED, "cancelled")
    assert services.store.queue_depth("bfl") == 0
    assert services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL,
                                 provider="bfl") == "ALREADY_COMPLETED"


def test_cancel_of_a_running_request_flags_it_for_the_worker(services, workspace):
    request_id, _ = admit(services, workspace)
    services.store.claim(record_of(services, request_id, "bfl"), lease())
    assert not services.store.cancel_requested(request_id)
    assert services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL,
                                 provider="bfl") == "REQUESTED"
    assert services.store.cancel_requested(request_id)
    assert services.store.status_view(request_id, "bfl").record.status == IN_PROGRESS


def test_cancel_by_another_workspace_or_model_changes_nothing(services, workspace):
    request_id, _ = admit(services, workspace)
    other = services.accounts.create_workspace("other", queue_enabled=True)
    assert services.store.cancel(request_id=request_id, workspace=other, model=MODEL, provider="bfl") == "MISSING"
    assert services.store.cancel(request_id=request_id, workspace=workspace, model="bfl/other",
                                 provider="bfl") == "MISSING"
    assert services.store.status_view(request_id, "bfl").record.status == IN_QUEUE


def test_completion_feeds_the_pace_averages(services, workspace):
    request_id, _ = admit(services, workspace)
    services.store.claim(record_of(services, request_id, "bfl"), lease())
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    waiting, _ = admit(services, workspace)  # the pace is read for a request that is sent Retry-After
    pace = services.store.status_view(waiting, "bfl").pace
    assert pace.avg_run_s is not None and pace.avg_run_s >= 0
    assert pace.avg_gap_s is not None
    assert services.store.pace("bfl") == pace
    # a COMPLETED request is sent no Retry-After (pacing.py): its status read skips the pace
    assert services.store.status_view(request_id, "bfl").pace == Pace(None, None)


def test_a_status_read_takes_the_ttl_only_of_a_completed_record(services, workspace):
    request_id, _ = admit(services, workspace)
    view = services.store.status_view(request_id, "bfl")
    assert view.record.ttl_s is None and view.pace is not None and view.position == 0
    services.store.claim(record_of(services, request_id, "bfl"), lease())
    view = services.store.status_view(request_id, "bfl")
    assert (view.record.status, view.record.ttl_s, view.position) == (IN_PROGRESS, None, None)
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    view = services.store.status_view(request_id, "bfl")
    assert view.record.status == COMPLETED and 0 < view.record.ttl_s <= services.store.retention_s
    missing = services.store.status_view(services.ids.mint(workspace, MODEL), "bfl")
    assert (missing.record, missing.position, missing.pace) == (None, None, Pace(None, None))


def test_a_provider_at_its_cap_leaves_requests_waiting_without_a_slot(services, workspace):
    services.store.max_in_flight = lambda provider: 1
    first, second = admit(services, workspace)[0], admit(services, workspace)[0]
    assert services.store.status_view(second, "bfl").position == 1  # behind the granted first
    assert services.store.claim(record_of(services, first, "bfl"), lease("a")) == "CLAIMED"
    # a stray message for the waiting one (an operator's requeue) starts nothing
    assert services.store.claim(record_of(services, second, "bfl"), lease("b")) == "WAITING"
    assert services.store.status_view(second, "bfl").record.status == IN_QUEUE
    assert services.store.status_view(second, "bfl").position == 0
    assert services.store.in_flight("bfl") == 1
    services.store.complete(record_of(services, first, "bfl"), output=b"{}", content_type="application/json")
    assert services.store.in_flight("bfl") == 1  # the freed slot went to the second at once
    assert services.store.claim(record_of(services, second, "bfl"), lease("b")) == "CLAIMED"


def test_a_request_past_its_queue_timeout_is_never_run(services, workspace):
    request_id, _ = admit(services, workspace, now=1000.0)
    assert services.store.claim(record_of(services, request_id, "bfl"), lease(queue_timeout_s=60), now=1061.0) == "QUEUE_TIMEOUT"
    record = services.store.status_view(request_id, "bfl").record
    assert (record.status, record.error_type, record.started_at) == (COMPLETED, "queue_timeout", None)
    assert services.store.queue_depth("bfl") == 0


def test_expire_queued_times_out_only_what_waited_too_long(services, workspace):
    old, _ = admit(services, workspace, now=1000.0)
    young, _ = admit(services, workspace, now=1050.0)
    assert services.store.expire_queued(old, "bfl", workspace, 60, now=1070.0)
    assert not services.store.expire_queued(young, "bfl", workspace, 60, now=1070.0)
    assert [r.id for r in services.store.queue_head("bfl")] == [young]


def test_only_the_retry_a_holder_named_resumes_and_an_expired_lease_is_taken_over(services, workspace):
    request_id, _ = admit(services, workspace)
    record = record_of(services, request_id, "bfl")
    assert services.store.claim(record, lease("a", lease_s=0.2, resume_key="task:0")) == "CLAIMED"
    assert services.store.claim(record, lease("a2", lease_s=0.2, resume_key="task:0")) == "LEASED"  # redelivered
    assert services.store.renew(request_id, "bfl", "a", 0.2, successor="task:1")
    assert services.store.claim(record, lease("a3", lease_s=0.2, resume_key="task:1")) == "RESUMED"
    assert services.store.claim(record, lease("a4", lease_s=0.2, resume_key="task:1")) == "LEASED"  # used once
    assert services.store.claim(record_of(services, request_id, "bfl"), lease("b")) == "LEASED"
    assert services.store.reap("bfl", time.time() + 1, again_at=time.time() + 1) == [(request_id, True)]
    time.sleep(0.3)
    assert services.store.claim(record_of(services, request_id, "bfl"), lease("b")) == "RESUMED"
    assert not services.store.renew(request_id, "bfl", "a3", 30)  # the old holder lost it
    assert services.store.renew(request_id, "bfl", "b", 30)


def test_a_request_that_keeps_losing_its_worker_gives_up(services, workspace):
    request_id, _ = admit(services, workspace)
    services.store.claim(record_of(services, request_id, "bfl"), lease("t0", lease_s=0, max_takeovers=2))
    outcomes = [services.store.claim(record_of(services, request_id, "bfl"), lease(f"t{n}", lease_s=0, max_takeovers=2))
                for n in range(1, 4)]
    assert outcomes == ["RESUMED", "RESUMED", "EXHAUSTED"]
    record = services.store.status_view(request_id, "bfl").record
    assert (record.status, record.error_type) == (COMPLETED, "provider_error")
    assert services.store.in_flight("bfl") == 0


def test_renew_many_extends_every_held_lease(services, workspace):
    ids = [admit(services, workspace)[0] for _ in range(3)]
    for n, request_id in enumerate(ids):
        services.store.claim(record_of(services, request_id, "bfl"), lease(f"t{n}", lease_s=1))
    services.store.renew_many([(i, "bfl", f"t{n}") for n, i in enumerate(ids)], 60)
    assert services.store.reap("bfl", time.time() + 30, again_at=time.time() + 30) == []


def test_an_admission_reaching_redis_past_its_deadline_writes_nothing(services, workspace):
    """The front door has answered 503 by then: the admit must not happen later."""
    services.store.write_deadline_s = 0.8
    request_id, outcome = admit(services, workspace, key_hash="k", fingerprint="f", now=time.time() - 5)
    assert outcome.outcome == "EXPIRED"
    assert services.store.status_view(request_id, "bfl").record is None
    assert services.store.queue_depth("bfl") == 0 and services.store.in_flight("bfl") == 0
    assert services.accounts.get(workspace).queued == services.accounts.get(workspace).held == 0
    assert services.accounts.ledger(workspace) == []
    assert not services.redis.exists(keys.idempotency(workspace, "k"))
    # in time, the same admission goes through
    _, on_time = admit(services, workspace, key_hash="k", fingerprint="f")
    assert on_time.outcome == "ADMITTED"


def test_a_cancel_reaching_redis_past_its_deadline_changes_nothing(services, workspace, monkeypatch):
    request_id, _ = admit(services, workspace)
    monkeypatch.setattr(services.store, "_deadline", lambda now: repr(now - 1))  # Redis stalled past it
    assert services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL,
                                 provider="bfl") == "EXPIRED"
    monkeypatch.undo()
    assert services.store.status_view(request_id, "bfl").record.status == IN_QUEUE


def test_reap_never_touches_a_lease_renewed_meanwhile(services, workspace):
    """The sweeper's read of expired leases and its postponing are one step:
    a worker's renewal between them cannot be overwritten."""
    request_id, _ = admit(services, workspace)
    services.store.claim(record_of(services, request_id, "bfl"), lease("t", lease_s=30))
    now = time.time()
    assert services.store.reap("bfl", now, again_at=now + 1) == []  # its lease runs 30 s more
    lease_end = services.redis.zscore(keys.running("bfl"), request_id)
    assert lease_end > now + 29


def test_purge_expired_drops_only_entries_whose_record_is_gone(services, workspace):
    kept, _ = admit(services, workspace)
    gone, _ = admit(services, workspace)
    services.redis.delete(keys.request(gone))  # its retention ran out while still indexed
    assert services.store.purge_expired(["bfl", "vertexai"]) == 2  # queue and running
    assert services.store.queue_depth("bfl") == 1
    assert services.redis.zscore(keys.queue("bfl"), kept) is not None
    assert services.store.purge_expired(["bfl"]) == 0


def test_progress_only_grows_and_only_from_the_lease_holder_of_a_running_request(services, workspace):
    request_id, _ = admit(services, workspace)
    store = services.store
    assert not store.record_progress(request_id, "t", 0.2)  # not running yet
    store.claim(record_of(services, request_id, "bfl"), lease("t"))
    assert store.record_progress(request_id, "t", 0.2)
    assert not store.record_progress(request_id, "someone-else", 0.9)
    assert not store.record_progress(request_id, "t", 0.1)  # never backwards
    assert not store.record_progress(request_id, "t", 1.5)  # not a fraction
    assert store.record_progress(request_id, "t", 0.6)
    assert store.status_view(request_id, "bfl").record.progress == 0.6
    store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    assert not store.record_progress(request_id, "t", 0.9)  # finished


def test_a_change_is_announced_to_whoever_follows_the_request(services, workspace):
    if type(services.redis).__module__.startswith("fakeredis"):
        pytest.skip("fakeredis's pub/sub inside Lua is not what this test is about")
    request_id, _ = admit(services, workspace)
    notices = services.store.event_feed()
    try:
        notices.get_message(timeout=1)  # the psubscribe's own answer
        services.store.claim(record_of(services, request_id, "bfl"), lease("t"))
        services.store.record_progress(request_id, "t", 0.5)
        services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
        seen = []
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            message = notices.get_message(timeout=0.5)
            if message and message["channel"] == keys.events_channel(request_id).encode():
                seen.append(message["data"])
    finally:
        notices.close()
    assert seen == [b"IN_PROGRESS", b"PROGRESS", b"COMPLETED"]


def test_a_waiting_request_keeps_its_body_apart_and_a_compact_record(services, workspace):
    """The body (often past 64 bytes) has a key of its own, so the record stays
    a listpack while the request waits; the body goes once the request is done."""
    body = '{"prompt": "' + "a long prompt " * 20 + '"}'
    request_id, _ = admit(services, workspace, body=body, key_hash="a" * 64, fingerprint="f" * 64)
    assert services.store.load(request_id)[1] == body.encode()
    if not type(services.redis).__module__.startswith("fakeredis"):
        assert services.redis.object("encoding", keys.request(request_id)) == b"listpack"
    services.store.claim(record_of(services, request_id, "bfl"), lease("t"))
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    assert services.redis.exists(keys.body(request_id)) == 0
    assert services.store.load(request_id)[1] is None


def test_a_record_admitted_before_bodies_had_their_own_key_still_loads_its_body(services, workspace):
    request_id, _ = admit(services, workspace, body='{"prompt": "new"}')
    services.redis.delete(keys.body(request_id))
    services.redis.hset(keys.request(request_id), "body", '{"prompt": "old"}')
    assert services.store.load(request_id)[1] == b'{"prompt": "old"}'


def test_an_admission_adds_to_the_workspaces_counts_exactly_from_what_they_were(services, workspace):
    """admit.lua writes the counts it read back in one HSET: the same values HINCRBY would leave."""
    ws_key = keys.workspace(workspace)
    services.redis.hset(ws_key, mapping={"queued": 2, "queued_bytes": 10, "held": 5, "webhooks_pending": 1,
                                         "webhook_secret": "whsec_test", "credits": 1000})
    body = '{"prompt": "count me"}'
    request_id = services.ids.mint(workspace, MODEL)
    outcome = services.store.admit(Submission(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl",
                                   body=body, price=7, webhook_url="https://example.com/hook"))
    assert outcome.outcome == "ADMITTED"
    counts = services.redis.hmget(ws_key, "queued", "queued_bytes", "held", "webhooks_pending")
    assert [int(v) for v in counts] == [3, 10 + len(body), 12, 2]
    _, entry = services.redis.xrevrange(keys.ledger(workspace), count=1)[0]
    assert (entry[b"type"], entry[b"held"], entry[b"balance"]) == (b"hold", b"12", b"1000")
    # without a price or a webhook, those two counts are left as they were
    admit(services, workspace)
    assert [int(v) for v in services.redis.hmget(ws_key, "queued", "held", "webhooks_pending")] == [4, 12, 2]


@pytest.mark.parametrize("ending", ["charge", "release", "cancel"])
def test_an_ending_settles_the_workspaces_counts_exactly_from_what_they_were(services, workspace, ending):
    """complete.lua and finish_unbilled write held, credits and queued_bytes back in one HSET."""
    ws_key = keys.workspace(workspace)
    body = '{"prompt": "settle me"}'
    request_id = services.ids.mint(workspace, MODEL)
    services.store.admit(Submission(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl", body=body, price=9))
    services.redis.hset(ws_key, mapping={"held": 20, "credits": 500, "queued_bytes": len(body) + 4})
    if ending == "cancel":
        services.store.cancel(request_id=request_id, workspace=workspace, model=MODEL, provider="bfl")
    else:
        services.store.claim(record_of(services, request_id, "bfl"), lease())
        services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json",
                                billable=ending == "charge")
    credits = 500 - 9 if ending == "charge" else 500
    assert [int(v) for v in services.redis.hmget(ws_key, "held", "credits", "queued_bytes")] == [11, credits, 4]
    _, entry = services.redis.xrevrange(keys.ledger(workspace), count=1)[0]
    assert (entry[b"held"], entry[b"balance"], entry[b"amount"]) == (b"11", str(credits).encode(), b"9")
    # bytes larger than the count left (a count set by hand): floored at 0, as before
    other = services.ids.mint(workspace, MODEL)
    services.store.admit(Submission(request_id=other, workspace=workspace, model=MODEL, provider="bfl", body=body, price=1))
    services.redis.hset(ws_key, "queued_bytes", 3)
    services.store.cancel(request_id=other, workspace=workspace, model=MODEL, provider="bfl")
    assert int(services.redis.hget(ws_key, "queued_bytes")) == 0
