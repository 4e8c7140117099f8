"""The store's Lua contracts, on fakeredis and on a real Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from router_queue import keys
from router_queue.states import COMPLETED, IN_PROGRESS, IN_QUEUE

MODEL = "bfl/flux-2-pro"


def admit(services, workspace, *, key_hash="", fingerprint="", body='{"prompt": "x"}', now=None):
    request_id = services.ids.mint(workspace, MODEL)
    outcome = services.store.admit(
        request_id=request_id, workspace=workspace, model=MODEL, provider="bfl", body=body,
        fingerprint=fingerprint, idempotency_key_hash=key_hash, now=now,
    )
    return request_id, outcome


def test_admit_writes_record_queue_place_and_unpublished_mark(services, workspace):
    request_id, outcome = admit(services, workspace, now=1000.0)
    assert (outcome.outcome, outcome.request_id, outcome.position) == ("ADMITTED", request_id, 0)
    view = services.store.status_view(request_id, "bfl")
    assert view.record.status == IN_QUEUE
    assert view.record.workspace == workspace
    assert view.record.created_at == 1000.0
    assert view.position == 0
    assert services.store.unpublished_before(1001.0) == [(request_id, "bfl")]
    record, body = services.store.load(request_id)
    assert body == b'{"prompt": "x"}'


def test_positions_count_requests_ahead(services, workspace):
    ids = [admit(services, workspace)[0] for _ in range(5)]
    assert [services.store.status_view(i, "bfl").position for i in ids] == [0, 1, 2, 3, 4]
    services.store.claim(ids[0], "bfl")
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
        results = list(pool.map(lambda _: services.store.claim(request_id, "bfl"), range(32)))
    assert results.count("CLAIMED") == 1
    assert set(results) == {"CLAIMED", IN_PROGRESS}
    view = services.store.status_view(request_id, "bfl")
    assert view.record.status == IN_PROGRESS and view.record.started_at is not None
    assert view.position is None
    assert services.store.unpublished_before(float("inf")) == []


def test_complete_keeps_the_first_outcome_and_sets_retention(services, workspace):
    request_id, _ = admit(services, workspace)
    services.store.claim(request_id, "bfl")
    assert services.store.complete(request_id, "bfl", output=b"\x00bytes", content_type="image/png") == COMPLETED
    assert services.store.complete(request_id, "bfl", error_type="provider_error", detail="late") == "ALREADY_COMPLETED"
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
    assert services.store.claim(request_id, "bfl") == COMPLETED
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
    services.store.claim(request_id, "bfl")
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
    services.store.claim(request_id, "bfl")
    services.store.complete(request_id, "bfl", output=b"{}", content_type="application/json")
    pace = services.store.status_view(request_id, "bfl").pace
    assert pace.avg_run_s is not None and pace.avg_run_s >= 0
    assert pace.avg_gap_s is not None


def test_unpublished_before_skips_requests_that_moved_on(services, workspace):
    waiting, _ = admit(services, workspace, now=100.0)
    cancelled, _ = admit(services, workspace, now=100.0)
    services.store.cancel(request_id=cancelled, workspace=workspace, model=MODEL, provider="bfl")
    late, _ = admit(services, workspace, now=500.0)
    assert services.store.unpublished_before(200.0) == [(waiting, "bfl")]
    services.store.mark_published(waiting)
    assert services.store.unpublished_before(200.0) == []
    assert services.store.unpublished_before(600.0) == [(late, "bfl")]
