"""The request history: the index admit.lua writes, history.lua's pages (order,
cursor, filters, bounds, isolation) on fakeredis and a real Redis, and the two
list routes as a caller sees them."""

from __future__ import annotations

import base64
import time
import uuid

import pytest

from router_queue.store import keys
from router_queue.store.record import Submission
from router_queue.store.requests_front import HISTORY_EXAMINED_PER_ENTRY
from router_queue.store.requests_values import Lease
from router_queue.web.history import decode_cursor, encode_cursor
from tests.unit.route_support import FLUX, assert_error, submit
from tests.unit.support import record_of

MODEL = "bfl/flux-2-pro"
SPEECH = "openai/gpt-4o-mini-tts"
LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)


def admit(services, workspace, *, now, model=MODEL, provider="bfl", price=0):
    request_id = services.ids.mint(workspace, model)
    outcome = services.store.admit(Submission(request_id=request_id, workspace=workspace, model=model, provider=provider,
                                   body="{}", now=now, price=price))
    assert outcome.outcome == "ADMITTED"
    return request_id


#: Seconds between renewals of a history stream's expiry (lib/history.lua, HISTORY_RENEW_S).
RENEW_S = 60


def walk(store, workspace, **kwargs):
    """Every page from the first, as lists of ids."""
    pages, after = [], None
    while True:
        page = store.history(workspace, after=after, **kwargs)
        pages.append([record.id for record, _ in page.entries])
        if page.next_after is None:
            return pages
        after = page.next_after


def test_pages_list_every_request_once_newest_first_ties_included(services, workspace):
    now = time.time()
    # three admitted in the same instant: one after the other, none lost between pages
    times = [now - 50, now - 40, now - 30, now - 30, now - 30, now - 20, now - 10]
    ids = [admit(services, workspace, now=t) for t in times]
    pages = walk(services.store, workspace, since=now - 3600, limit=2)
    listed = [i for page in pages for i in page]
    assert sorted(listed) == sorted(ids) and len(listed) == len(ids)
    created = [services.store.status_view(i, "bfl").record.created_at for i in listed]
    assert created == sorted(created, reverse=True)
    assert [len(p) for p in pages] == [2, 2, 2, 1]


def test_the_page_carries_each_record_and_its_queue_position(services, workspace):
    now = time.time()
    first, second, third = (admit(services, workspace, now=now + i) for i in range(3))
    services.store.claim(record_of(services, first, "bfl"), LEASE)
    page = services.store.history(workspace, since=now - 60, limit=10)
    assert [(r.id, r.status, position) for r, position in page.entries] == [
        (third, "IN_QUEUE", 1), (second, "IN_QUEUE", 0), (first, "IN_PROGRESS", None)]


def test_filters_status_error_type_model_and_time(services, workspace):
    now = time.time()
    done = admit(services, workspace, now=now - 40)
    failed = admit(services, workspace, now=now - 30)
    speech = admit(services, workspace, now=now - 20, model=SPEECH, provider="openai")
    queued = admit(services, workspace, now=now - 10)
    for request_id, error in ((done, ""), (failed, "provider_error")):
        record = record_of(services, request_id, "bfl")
        services.store.claim(record, LEASE)
        services.store.complete(record, output=b"x", content_type="image/png", error_type=error, detail=error)
    store = services.store

    def ids(**kwargs):
        return [i for page in walk(store, workspace, limit=100, **{"since": now - 3600, **kwargs}) for i in page]

    assert ids() == [queued, speech, failed, done]
    assert ids(status="COMPLETED") == [failed, done]
    assert ids(status="IN_QUEUE") == [queued, speech]
    assert ids(error_type="provider_error") == [failed]
    assert ids(model=SPEECH) == [speech]
    assert ids(model=MODEL) == [queued, failed, done]
    assert ids(since=now - 30) == [queued, speech, failed]  # since is inclusive
    assert ids(until=now - 20) == [failed, done]  # until is exclusive
    assert ids(since=now - 30, until=now - 10, model=MODEL) == [failed]


def test_a_sparse_filter_examines_a_bounded_slice_per_page(services, workspace):
    now = time.time()
    for i in range(60):
        admit(services, workspace, now=now - 100 + i)
    page = services.store.history(workspace, since=now - 3600, limit=2, status="COMPLETED")
    assert page.entries == [] and page.next_after is not None  # nothing yet, and more to read
    pages = walk(services.store, workspace, since=now - 3600, limit=2, status="COMPLETED")
    assert pages == [[]] * (60 // (2 * HISTORY_EXAMINED_PER_ENTRY))


def test_another_workspace_never_appears(services, workspace):
    other = services.accounts.create_workspace("other", queue_enabled=True)
    now = time.time()
    mine = admit(services, workspace, now=now)
    theirs = admit(services, other, now=now)
    assert walk(services.store, workspace, since=now - 60, limit=10) == [[mine]]
    assert walk(services.store, other, since=now - 60, limit=10) == [[theirs]]
    # an entry planted in the history names another workspace's record: never listed
    services.redis.xadd(keys.history(workspace), {"i": uuid.UUID(theirs).bytes})
    assert walk(services.store, workspace, since=now - 60, limit=10) == [[mine]]


def test_only_admissions_are_indexed_and_old_entries_are_trimmed(services):
    poor = services.accounts.create_workspace("poor", queue_enabled=True, credits=10)
    now = time.time()
    request_id = services.ids.mint(poor, MODEL)
    refused = services.store.admit(Submission(request_id=request_id, workspace=poor, model=MODEL, provider="bfl", body="{}",
                                   now=now, price=60))
    assert refused.outcome == "INSUFFICIENT_CREDITS"
    assert services.redis.xlen(keys.history(poor)) == 0
    retention = services.store.retention_s
    old = admit(services, poor, now=now - retention - 10)
    assert services.redis.xlen(keys.history(poor)) == 1
    new = admit(services, poor, now=now)
    (entry_id, fields), = services.redis.xrange(keys.history(poor))
    assert str(uuid.UUID(bytes=fields[b"i"])) == new != old
    assert int(entry_id.split(b"-")[0]) == int(now * 1000)  # the admission time, in ms
    assert [e for e, _ in services.redis.xrange(keys.model_history(poor, MODEL))] == [entry_id]
    # renewed at most once a minute, so a minute over the retention (lib/history.lua, history_renewals)
    assert retention < services.redis.ttl(keys.history(poor)) <= retention + RENEW_S


def test_the_cursor_round_trips_and_refuses_forgeries():
    assert decode_cursor(encode_cursor("1764650000123-4")) == "1764650000123-4"
    from router_queue.errors import InvalidInput
    for forged in ("", "abc", base64.urlsafe_b64encode(b"h2|1-").decode(),
                   base64.urlsafe_b64encode(b"h1|1764650000123-4").decode(),
                   base64.urlsafe_b64encode(b"h2|1-99999999999999999999").decode(),
                   base64.urlsafe_b64encode(b"h2|1.5-0").decode()):
        with pytest.raises(InvalidInput):
            decode_cursor(forged)


def test_bounds_at_the_start_of_time_list_nothing(services, workspace):
    admit(services, workspace, now=time.time())
    assert services.store.history(workspace, since=0, until=0).entries == []
    assert services.store.history(workspace, since=0, after="0-0").entries == []
    assert services.store.history(workspace, since=-5, until=-1).entries == []


# -- the routes -------------------------------------------------------------------------------


def page(http, auth, query="", path="/v2/requests"):
    response = http.get(f"{path}{'?' if query else ''}{query}", headers=auth)
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.json


def test_the_list_answers_status_bodies_with_model_and_created_at(http, auth, services, workspace):
    handles = [submit(http, auth, {"prompt": f"p{i}"}).json for i in range(3)]
    services.store.cancel(request_id=handles[0]["request_id"], workspace=workspace, model=MODEL, provider="bfl")
    body = page(http, auth)
    assert body["next_cursor"] is None
    listed = body["requests"]
    assert [e["request_id"] for e in listed] == [h["request_id"] for h in reversed(handles)]
    for entry in listed:
        status = http.get(f"{FLUX}/requests/{entry['request_id']}/status", headers=auth).json
        assert entry == {**status, "model": MODEL}
        assert entry["created_at"] and entry["cost"]["state"] in ("held", "released")
    assert listed[-1]["error_type"] == "cancelled" and listed[-1]["cost"]["state"] == "released"


def test_the_list_pages_with_its_cursor(http, auth):
    ids = [submit(http, auth, {"prompt": f"p{i}"}).json["request_id"] for i in range(5)]
    seen, cursor, pages = [], None, 0
    while True:
        body = page(http, auth, "limit=2" + (f"&cursor={cursor}" if cursor else ""))
        seen += [e["request_id"] for e in body["requests"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1] and pages == 3


def test_the_models_list_holds_that_model_only(http, auth):
    flux = submit(http, auth).json["request_id"]
    speech = submit(http, auth, {"input": "hello", "voice": "alloy"},
                    path="/v2/models/openai/gpt-4o-mini-tts")
    assert speech.status_code == 201, speech.get_data(as_text=True)
    assert [e["request_id"] for e in page(http, auth, path=f"{FLUX}/requests")["requests"]] == [flux]
    assert [e["request_id"] for e in page(http, auth, f"model={SPEECH}")["requests"]] == [speech.json["request_id"]]
    assert len(page(http, auth)["requests"]) == 2
    assert_error(http.get("/v2/models/bfl/nope/requests", headers=auth), 404, "model_not_found")
    assert_error(http.get(f"{FLUX}/requests?model={MODEL}", headers=auth), 400, "invalid_input")


def test_another_workspaces_key_sees_none_and_no_key_is_refused(http, auth, services):
    submit(http, auth)
    stranger = services.accounts.mint_key(services.accounts.create_workspace("eve", queue_enabled=True))
    assert page(http, {"X-API-Key": stranger}) == {"requests": [], "next_cursor": None}
    assert page(http, {"X-API-Key": stranger}, path=f"{FLUX}/requests") == {"requests": [], "next_cursor": None}
    assert_error(http.get("/v2/requests"), 401, "unauthorized")
    assert_error(http.get(f"{FLUX}/requests"), 401, "unauthorized")


@pytest.mark.parametrize("query", [
    "limit=0", "limit=101", "limit=ten", "limit=-1", "limit=1.5", "status=DONE", "status=", "error_type=oops",
    "model=bfl", "model=nope/nope", "since=yesterday", "since=2026-12-02", "since=2026-12-02T04:00:00",
    "until=2026-13-02T04:00:00Z", "since=2026-12-02T04:00:60Z", "cursor=!!", "cursor=YWJj", "sort=asc",
    "limit=1&limit=2", "since=2026-12-02T05:00:00Z&until=2026-12-02T04:00:00Z",
])
def test_a_bad_filter_is_invalid_input(http, auth, query):
    assert_error(http.get(f"/v2/requests?{query}", headers=auth), 400, "invalid_input")


def test_filters_through_the_route(http, auth, services):
    queued = submit(http, auth, {"prompt": "a"}).json["request_id"]
    failed = submit(http, auth, {"prompt": "b"}).json["request_id"]
    record = record_of(services, failed, "bfl")
    services.store.claim(record, LEASE)
    services.store.complete(record, error_type="provider_error", detail="no")
    assert [e["request_id"] for e in page(http, auth, "status=COMPLETED")["requests"]] == [failed]
    assert [e["request_id"] for e in page(http, auth, "error_type=provider_error")["requests"]] == [failed]
    assert [e["request_id"] for e in page(http, auth, "status=IN_QUEUE")["requests"]] == [queued]
    assert page(http, auth, "since=2100-01-01T00:00:00Z")["requests"] == []
    assert len(page(http, auth, "since=2000-01-01T00:00:00%2B02:00&until=2100-01-01T00:00:00.5Z")["requests"]) == 2


def test_a_page_is_one_call_against_the_rate(http, auth, services, workspace):
    services.accounts.set_limits(workspace, rate_limit="2/minute")
    assert http.get("/v2/requests", headers=auth).status_code == 200
    assert http.get("/v2/requests?limit=0", headers=auth).status_code == 400  # refused, still counted
    assert_error(http.get("/v2/requests", headers=auth), 429, "rate_limited")


def test_an_admission_stamped_before_the_last_entry_is_listed_at_its_ms(services, workspace):
    """Ids only grow: a front door whose clock is behind another's lists its
    admission at the stream's last ms, in both streams, and trims by it."""
    now = time.time()
    ahead = admit(services, workspace, now=now)
    behind = admit(services, workspace, now=now - 5)
    ids = [entry_id for entry_id, _ in services.redis.xrange(keys.history(workspace))]
    ms = int(now * 1000)
    assert ids == [f"{ms}-0".encode(), f"{ms}-1".encode()]
    assert [e for e, _ in services.redis.xrange(keys.model_history(workspace, MODEL))] == ids
    assert walk(services.store, workspace, since=now - 60, limit=10) == [[behind, ahead]]


def test_a_model_stream_ahead_of_its_workspaces_misses_the_entry_and_is_trimmed(services, workspace):
    now = time.time()
    retention = services.store.retention_s
    model_stream = keys.model_history(workspace, MODEL)
    old_ms = int((now - retention - 60) * 1000)
    services.redis.xadd(model_stream, {"i": ""}, id=f"{old_ms}-0")
    services.redis.xadd(model_stream, {"i": ""}, id=f"{int((now + 60) * 1000)}-0")  # planted ahead
    admitted = admit(services, workspace, now=now)
    assert [e for e, _ in services.redis.xrange(model_stream)] == [f"{int((now + 60) * 1000)}-0".encode()]
    assert walk(services.store, workspace, since=now - 60, limit=10) == [[admitted]]
    assert retention < services.redis.ttl(model_stream) <= retention + RENEW_S


def test_the_history_expiry_is_renewed_within_a_minute_and_never_leaves_less_than_the_retention(services, workspace):
    retention = services.store.retention_s
    streams = (keys.history(workspace), keys.model_history(workspace, MODEL))
    start = float(int(time.time()))

    def ttls() -> list[int]:
        return [services.redis.ttl(stream) for stream in streams]

    admit(services, workspace, now=start)
    assert all(retention < ttl <= retention + RENEW_S for ttl in ttls())
    for stream in streams:  # marks: a renewal would overwrite them
        services.redis.expire(stream, retention + 7)
    admit(services, workspace, now=start + RENEW_S - 1)  # within the minute: the streams still last
    assert ttls() == [retention + 7] * 2
    other = "bfl/other-model"
    admit(services, workspace, now=start + RENEW_S - 1, model=other)  # a model's first entry: its stream renewed
    assert retention < services.redis.ttl(keys.model_history(workspace, other)) <= retention + RENEW_S
    assert services.redis.ttl(keys.history(workspace)) == retention + 7
    admit(services, workspace, now=start + RENEW_S + 1)  # past the minute: less than the retention would be left
    assert all(retention < ttl <= retention + RENEW_S for ttl in ttls())
    # what each renewal promised: the retention from every admission until the next renewal
    until = services.redis.hmget(keys.workspace(workspace), "history_until", f"history_until|{MODEL}")
    assert [int(value) for value in until] == [int(start + RENEW_S + 1) + retention + RENEW_S] * 2
    # a shorter retention (a new setting) is not left waiting on the longer one
    services.store.retention_s = retention - 3600
    for stream in streams:
        services.redis.expire(stream, retention + 7)
    admit(services, workspace, now=start + RENEW_S + 2)
    assert all(retention - 3600 < ttl <= retention - 3600 + RENEW_S for ttl in ttls())
