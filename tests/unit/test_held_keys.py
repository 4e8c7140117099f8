"""A key revoked (or past its rotation's overlap) loses the connections held
open with it: its event streams end and its held synchronous calls answer
401 while their generations run on (``web/auth.py``, ``HeldKey``; the notice
on the process's one subscription, ``web/stream.py``, ``EventHub``)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from router_queue.errors import Unauthorized
from router_queue.store.requests_values import Lease
from router_queue.web.app import create_app
from router_queue.web.auth import CACHE_TTL_S, HeldKey, KeyResolver
from router_queue.web.front import EXTENSION
from tests.unit.support import Clock, frames, record_of

FLUX = "/v2/models/bfl/flux-2-pro"
LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)
#: Seconds a test waits for what the notice should bring about at once.
BOUND_S = 10.0


def test_a_held_key_is_checked_fresh_on_a_notice_and_through_the_cache_when_due(services, workspace):
    clock = Clock()
    resolver = KeyResolver(services.accounts, clock=clock)
    api_key = services.accounts.mint_key(workspace)
    held = HeldKey(resolver, api_key)
    held.followed()
    assert held.due_in() == CACHE_TTL_S  # once, a cache lifetime after it was followed
    assert resolver.lookup(api_key)[0] is not None  # cached by the call that opened it
    services.accounts.keys.revoke(api_key)
    clock.now += CACHE_TTL_S - 0.5
    held.check()  # the cache's answer still stands: without a notice, not refused yet
    assert held.due_in() is None  # no end: checked again only on a notice
    held.noticed = True  # the hub heard the key's channel
    assert held.due_in() == 0.0
    with pytest.raises(Unauthorized):
        held.check()  # fresh from Redis, whatever the cache held
    assert resolver.lookup(api_key)[0] is None  # and this process's other calls are refused at once too


def test_a_held_key_rotated_out_is_checked_again_when_its_overlap_ends(services, workspace):
    clock = Clock()
    resolver = KeyResolver(services.accounts, clock=clock)
    api_key = services.accounts.mint_key(workspace)
    held = HeldKey(resolver, api_key)
    services.accounts.keys.rotate(api_key, overlap_s=30, now=time.time() - 29.5)  # it stops in 0.5 s
    held.noticed = True
    held.check()  # still in its overlap
    due = held.due_in()
    assert due is not None and 0 < due <= 0.5
    time.sleep(0.6)
    clock.now += 0.6
    assert held.due_in() == 0.0
    with pytest.raises(Unauthorized):
        held.check()


@pytest.fixture
def real_redis_only(services):
    if type(services.redis).__module__.startswith("fakeredis"):
        pytest.skip("fakeredis blocks every thread while one waits on pub/sub; this needs a real Redis")


def _reader(response) -> tuple[threading.Thread, list[dict]]:
    got: list[dict] = []
    reader = threading.Thread(target=frames, args=(response,), kwargs={"out": got}, daemon=True)
    reader.start()
    return reader, got


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["revoke", "rotate"])
def test_a_stream_ends_when_its_key_is_revoked_or_its_overlap_ends(real_redis_only, app, http, services, workspace,
                                                                  how):
    api_key = services.accounts.mint_key(workspace)
    auth = {"X-API-Key": api_key}
    request_id = http.post(f"{FLUX}/requests", json={"prompt": "followed"}, headers=auth).json["request_id"]
    events = f"{FLUX}/requests/{request_id}/events"
    reader, got = _reader(http.get(events, headers=auth, buffered=False))
    _until(lambda: got, "the stream's first event")
    front = app.extensions[EXTENSION]
    if how == "revoke":
        services.accounts.keys.revoke(api_key)
    else:
        services.accounts.keys.rotate(api_key, overlap_s=1)
    reader.join(BOUND_S)
    assert not reader.is_alive(), "the stream outlived its key"
    assert [f["event"] for f in got] == ["in_queue"]
    _until(lambda: front.events.following() == 0 and front.held.holding() == 0, "the stream let go")
    assert http.get(events, headers=auth).status_code == 401  # reconnecting is refused
    assert services.store.status_view(request_id, "bfl").record.status == "IN_QUEUE"  # the request is untouched


def test_a_held_sync_call_answers_401_when_its_key_is_revoked_and_its_generation_runs_on(
        real_redis_only, settings, services, workspace):
    services.settings = dataclasses.replace(settings, sync_deadline_s=60.0)
    app = create_app(services.settings, services=services)
    front = app.extensions[EXTENSION]
    api_key = services.accounts.mint_key(workspace)
    kept = services.accounts.mint_key(workspace, "kept")
    answer = {}

    def call() -> None:
        answer["response"] = app.test_client().post(FLUX, json={"prompt": "held"}, headers={"X-API-Key": api_key})

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    _until(lambda: front.events.following() == 1, "the call held")
    services.accounts.keys.revoke(api_key)
    caller.join(BOUND_S)
    assert not caller.is_alive(), "the held call outlived its key"
    refused = answer["response"]
    assert refused.status_code == 401 and refused.json["error_type"] == "unauthorized"
    request_id = refused.headers["X-Comfy-Request-Id"]
    assert request_id in refused.json["detail"] and "runs on" in refused.json["detail"]
    assert front.held.holding() == 0 and front.events.following() == 0
    record = record_of(services, request_id, "bfl")
    services.store.claim(record, LEASE)
    services.store.complete(record, output=b'{"ok":1}', content_type="application/json")
    collected = app.test_client().get(f"{FLUX}/requests/{request_id}", headers={"X-API-Key": kept})
    assert collected.status_code == 200 and collected.data == b'{"ok":1}'
    assert collected.headers["X-Comfy-Cost-State"] == "charged"
