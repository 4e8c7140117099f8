"""A store split into per-slot steps (a Redis Cluster's): what a request's
start and end owe its workspace is owed by the provider's step and given by
the workspace's own (``store/owed.py``, ``ws_settle.lua``), once, whoever
gives it, in whichever order, and after the caller died between the two."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from router_queue.errors import RateLimited, StoreLost
from router_queue.requests.record import Submission
from router_queue.requests.values import Lease
from router_queue.services import Services
from router_queue.states import COMPLETED
from router_queue.store import keys, migrate
from router_queue.store.admission import ABANDON_AFTER_S, SPLIT_ADMIT_ARGS
from router_queue.store.gauges import QueueGauges
from router_queue.store.owed import RECONCILE_AFTER_S
from router_queue.store.scripts import argv
from router_queue.store.webhooks import DeliveryLimits
from router_queue.web import ratelimit
from tests.unit.conftest import RecordingDispatcher
from tests.unit.support import record_of
from workers.context import WorkerContext
from workers.leases import LeaseKeeper
from workers.sweeper import sweep

MODEL = "bfl/flux-2-pro"
PROVIDER = "bfl"
PRICE = 60


@pytest.fixture
def split(client, settings):
    """Services whose store runs its steps split, on one Redis."""
    return Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True)


def _workspace(services, credits: int = 1000) -> str:
    ws = services.accounts.create_workspace("w", queue_enabled=True, credits=credits)
    services.accounts.set_limits(ws, max_queued=100)
    return ws


def _admit(services, ws: str, body: str = '{"prompt": "p"}') -> str:
    request_id = services.ids.mint(ws, MODEL)
    admission = services.store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider=PROVIDER,
                                     body=body, price=PRICE))
    assert admission.outcome.value == "ADMITTED"
    return request_id


def _claim(services, request_id: str) -> None:
    assert services.store.claim(record_of(services, request_id, PROVIDER),
                                Lease(f"t-{request_id}", 30, 3600, 3)).value == "CLAIMED"


def _complete(services, request_id: str, **outcome) -> None:
    assert services.store.complete(record_of(services, request_id, PROVIDER), **outcome).value == COMPLETED


def _ledger(services, ws: str) -> list[tuple[str, int]]:
    return [(entry.type, entry.amount) for entry in services.accounts.ledger(ws)]


def _owed(services) -> list[dict]:
    return [json.loads(m) for m in services.redis.zrange(keys.owed(PROVIDER), 0, -1)]


def _every_ending(services) -> str:
    """A charged success, a released failure, a cancel while queued and a
    queue timeout, on one workspace; returns it."""
    ws = _workspace(services)
    done, failed, cancelled, timed_out = (_admit(services, ws) for _ in range(4))
    for request_id in (done, failed):
        _claim(services, request_id)
    _complete(services, done, output=b"{}", content_type="application/json")
    _complete(services, failed, error_type="provider_error", detail="upstream 500")
    assert services.store.cancel(request_id=cancelled, workspace=ws, model=MODEL, provider=PROVIDER).value \
        == "CANCELLED"
    assert services.store.expire_queued(timed_out, PROVIDER, ws, queue_timeout_s=0, now=time.time() + 5)
    return ws


def test_a_split_store_leaves_the_workspace_as_one_step_does(services, split):
    one_step = services.accounts.get(_every_ending(services))
    services = split
    ws = _every_ending(services)
    split_ws = services.accounts.get(ws)
    assert (split_ws.credits, split_ws.held, split_ws.queued, split_ws.queued_bytes) \
        == (one_step.credits, one_step.held, one_step.queued, one_step.queued_bytes) == (1000 - PRICE, 0, 0, 0)
    assert sorted(_ledger(services, ws)) == sorted([("hold", PRICE)] * 4 + [("charge", PRICE)]
                                                   + [("release", PRICE)] * 3)
    assert _owed(services) == []
    assert services.redis.hlen(keys.open_requests(ws)) == 0


def test_one_step_store_owes_nothing_and_keeps_no_open_entries(services):
    ws = _every_ending(services)
    assert _owed(services) == []
    assert services.redis.exists(keys.open_requests(ws)) == 0


def test_an_effect_given_twice_or_out_of_order_counts_once(split, monkeypatch):
    ws = _workspace(split)
    request_id = _admit(split, ws)
    given = []
    monkeypatch.setattr(split.store.effects, "_apply", lambda provider, owed: given.extend(owed) or 0)
    _claim(split, request_id)
    _complete(split, request_id, output=b"{}", content_type="application/json")
    start, end = given
    monkeypatch.undo()
    apply = split.store.effects._apply
    assert apply(PROVIDER, [end]) == 1  # the end before the start it follows
    assert split.accounts.get(ws).queued == 1  # the start not given yet: still counted waiting
    assert apply(PROVIDER, [end, start, start, end]) == 1
    workspace = split.accounts.get(ws)
    assert (workspace.credits, workspace.held, workspace.queued, workspace.queued_bytes) == (1000 - PRICE, 0, 0, 0)
    assert _ledger(split, ws) == [("hold", PRICE), ("charge", PRICE)]
    assert split.redis.hlen(keys.open_requests(ws)) == 0


def test_effects_left_owed_by_a_failed_workspace_step_are_given_by_the_sweeper(split, monkeypatch):
    ws = _workspace(split)
    request_id = _admit(split, ws)
    _claim(split, request_id)
    monkeypatch.setattr(split.store.effects, "_apply", _redis_down)
    _complete(split, request_id, output=b"{}", content_type="application/json")
    monkeypatch.undo()
    assert split.accounts.get(ws).held == PRICE
    assert [e["kind"] for e in _owed(split)] == ["end"]
    assert _gauge(split, "router_queue_workspace_effects_owed") == 1
    context = WorkerContext(split, requests.Session(), split.dispatcher, LeaseKeeper(split.store, 30))
    assert sweep(context, now=time.time()).effects_reconciled == 0  # its caller may still give it
    assert sweep(context, now=time.time() + RECONCILE_AFTER_S + 1).effects_reconciled == 1
    assert sweep(context, now=time.time() + RECONCILE_AFTER_S + 2).effects_reconciled == 0
    workspace = split.accounts.get(ws)
    assert (workspace.credits, workspace.held) == (1000 - PRICE, 0)
    assert _owed(split) == []
    assert _gauge(split, "router_queue_workspace_effects_owed") == 0


def _gauge(services, name: str) -> float:
    """The provider's sample of a scrape-time gauge (store/gauges.py)."""
    for family in QueueGauges(services.redis, services.catalog).collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == {"provider": PROVIDER}:
                return sample.value
    raise AssertionError(f"{name} not scraped")


def _redis_down(provider, owed):
    import redis

    raise redis.ConnectionError("the workspace's node did not answer")


KILLED_BETWEEN_STEPS = textwrap.dedent("""
    import os, signal, sys
    import redis
    from router_queue.services import Services
    from router_queue.settings import Settings
    from tests.unit.conftest import RecordingDispatcher
    from tests.unit.support import record_of

    url, request_id = sys.argv[1], sys.argv[2]
    client = redis.Redis.from_url(url)
    services = Services.build(Settings(redis_url="redis://unused", public_base_url="http://router.test"), client,
                              dispatcher=RecordingDispatcher(), split=True)
    services.store.effects.between_steps = lambda: os.kill(os.getpid(), signal.SIGKILL)
    services.store.complete(record_of(services, request_id, "bfl"), output=b"{}", content_type="application/json")
    print("the step after the provider's ran")
""")


def test_a_process_killed_between_the_steps_loses_nothing_and_charges_once(real_redis, real_redis_url, settings):
    services = Services.build(settings, real_redis, dispatcher=RecordingDispatcher(), split=True)
    ws = _workspace(services)
    request_id = _admit(services, ws)
    _claim(services, request_id)
    killed = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_STEPS, real_redis_url, request_id],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    assert "ran" not in killed.stdout
    assert services.store.status_view(request_id, PROVIDER).record.status == COMPLETED  # the provider's step
    assert services.accounts.get(ws).held == PRICE  # the workspace's step never ran
    assert services.store.effects.reconcile(PROVIDER, time.time() + RECONCILE_AFTER_S + 1) == 1
    assert services.store.effects.reconcile(PROVIDER, time.time() + RECONCILE_AFTER_S + 1) == 0
    workspace = services.accounts.get(ws)
    assert (workspace.credits, workspace.held, workspace.queued, workspace.queued_bytes) == (1000 - PRICE, 0, 0, 0)
    assert _ledger(services, ws) == [("hold", PRICE), ("charge", PRICE)]


def _split_after(services, client, settings) -> Services:
    """The store served split from now on, as ``ops migrate-keys`` leaves it:
    refused until then (its requests have no open entries)."""
    split = Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True)
    with pytest.raises(StoreLost, match="router-queue ops migrate-keys"):
        split.accounts.epoch.check()
    migrate.migrate(client, consistency=split.consistency)
    split.accounts.epoch.check()
    return split


def test_a_store_split_from_its_first_workspace_is_served_without_a_migration(split):
    _admit(split, _workspace(split))
    split.accounts.epoch.check()  # not refused
    assert split.redis.get(keys.split_steps()) == b"1"


def test_a_request_admitted_before_the_store_was_split_is_given_its_effects_once(services, client, settings):
    ws = _workspace(services)
    started, waiting = _admit(services, ws), _admit(services, ws)
    _claim(services, started)  # its start given by the one-step store
    split = _split_after(services, client, settings)
    assert split.redis.hgetall(keys.open_requests(ws)) == {started.encode(): b"e", waiting.encode(): b"qe"}
    given = []
    apply = split.store.effects._apply
    split.store.effects._apply = lambda provider, owed: given.extend(owed) or apply(provider, owed)
    _claim(split, waiting)
    for request_id in (started, waiting):
        _complete(split, request_id, output=b"{}", content_type="application/json")
    assert len(given) == 3
    assert apply(PROVIDER, given) == 0  # every one again, as a sweeper after a lost acknowledgement
    workspace = split.accounts.get(ws)
    assert (workspace.credits, workspace.held, workspace.queued, workspace.queued_bytes) \
        == (1000 - 2 * PRICE, 0, 0, 0)
    assert sorted(_ledger(split, ws)) == sorted([("hold", PRICE), ("hold", PRICE), ("charge", PRICE),
                                                 ("charge", PRICE)])
    assert split.redis.hlen(keys.open_requests(ws)) == 0


def test_an_effect_an_earlier_version_owed_for_a_request_admitted_before_the_split_is_given_once(
        services, client, settings):
    ws = _workspace(services)
    waiting = _admit(services, ws)
    earlier = Services.build(settings, client, dispatcher=RecordingDispatcher(), split=True)
    earlier.store.effects._apply = lambda provider, owed: 0  # its caller died: the start stays owed
    _claim(earlier, waiting)
    [start] = _owed(earlier)
    client.delete(keys.owed(PROVIDER))
    client.zadd(keys.owed(PROVIDER), {json.dumps({**start, "unopened": 1}): start["at"]})  # as it was written
    split = _split_after(services, client, settings)
    assert _owed(split) == [start] and split.redis.hget(keys.open_requests(ws), waiting) == b"qe"
    assert split.store.effects.reconcile(PROVIDER, time.time() + RECONCILE_AFTER_S + 1) == 1
    assert split.accounts.get(ws).queued == 0
    _complete(split, waiting, output=b"{}", content_type="application/json")
    assert split.accounts.get(ws).held == 0 and split.redis.hlen(keys.open_requests(ws)) == 0


# -- admission in two steps (store/admission.py) --------------------------------------------------

def test_a_refusal_at_the_providers_step_gives_the_workspaces_part_back(split):
    ws = _workspace(split)
    split.store.set_draining(PROVIDER, True)
    request_id = split.ids.mint(ws, MODEL)
    refused = split.store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider=PROVIDER, body="{}",
                                price=PRICE, fingerprint="f", idempotency_key_hash="k1"))
    assert refused.outcome.value == "DRAINING"
    workspace = split.accounts.get(ws)
    assert (workspace.credits, workspace.held, workspace.queued, workspace.queued_bytes) == (1000, 0, 0, 0)
    assert _ledger(split, ws) == [("hold", PRICE), ("release", PRICE)]
    assert split.redis.zcard(keys.admitting(PROVIDER)) == 0
    split.store.set_draining(PROVIDER, False)
    again = split.store.admit(Submission(request_id=split.ids.mint(ws, MODEL), workspace=ws, model=MODEL, provider=PROVIDER,
                              body="{}", price=PRICE, fingerprint="f", idempotency_key_hash="k1"))
    assert again.outcome.value == "ADMITTED"  # the key was freed: not a replay of the refused one


def test_a_replay_of_an_admission_between_its_steps_is_told_to_wait_not_given_an_id_that_may_never_exist(split):
    ws = _workspace(split)
    first = split.ids.mint(ws, MODEL)
    replays = []

    def replay_now():
        replays.append(split.store.admit(Submission(request_id=split.ids.mint(ws, MODEL), workspace=ws, model=MODEL,
                                         provider=PROVIDER, body="{}", price=PRICE, fingerprint="f",
                                         idempotency_key_hash="k1")).outcome.value)

    split.store.admission.between_steps = replay_now
    admitted = split.store.admit(Submission(request_id=first, workspace=ws, model=MODEL, provider=PROVIDER, body="{}",
                                 price=PRICE, fingerprint="f", idempotency_key_hash="k1"))
    split.store.admission.between_steps = None
    assert replays == ["ADMITTING"]  # the front door's 409 concurrency_limit_exceeded, with Retry-After
    assert admitted.outcome.value == "ADMITTED"
    replay = split.store.admit(Submission(request_id=split.ids.mint(ws, MODEL), workspace=ws, model=MODEL, provider=PROVIDER,
                               body="{}", price=PRICE, fingerprint="f", idempotency_key_hash="k1"))
    assert (replay.outcome.value, replay.request_id) == ("REPLAY", first)


KILLED_BETWEEN_ADMISSION_STEPS = textwrap.dedent("""
    import os, signal, sys
    import redis
    from router_queue.services import Services
    from router_queue.settings import Settings
    from router_queue.requests.record import Submission
    from tests.unit.conftest import RecordingDispatcher

    url, workspace, request_id = sys.argv[1], sys.argv[2], sys.argv[3]
    client = redis.Redis.from_url(url)
    services = Services.build(Settings(redis_url="redis://unused", public_base_url="http://router.test"), client,
                              dispatcher=RecordingDispatcher(), split=True)
    services.store.admission.between_steps = lambda: os.kill(os.getpid(), signal.SIGKILL)
    services.store.admit(Submission(request_id=request_id, workspace=workspace, model="bfl/flux-2-pro",
                                    provider="bfl", body='{"prompt": "p"}', price=60, fingerprint="f",
                                    idempotency_key_hash="k1"))
    print("the provider's step ran")
""")


def test_an_admission_killed_between_its_steps_is_undone_once_and_never_placed(real_redis, real_redis_url,
                                                                               settings):
    services = Services.build(settings, real_redis, dispatcher=RecordingDispatcher(), split=True)
    ws = _workspace(services)
    request_id = services.ids.mint(ws, MODEL)
    killed = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_ADMISSION_STEPS, real_redis_url, ws, request_id],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    assert "ran" not in killed.stdout
    assert services.accounts.get(ws).held == PRICE  # the workspace's step ran
    assert services.store.status_view(request_id, PROVIDER).record is None
    [pending] = services.redis.zrange(keys.admitting(PROVIDER), 0, -1, withscores=True)
    assert _gauge(services, "router_queue_admissions_pending") == 1
    assert services.store.admission.abandon(PROVIDER, time.time()) == 0  # its caller may still place it
    assert services.store.admission.abandon(PROVIDER, pending[1] + ABANDON_AFTER_S + 1) == 1
    assert services.store.admission.abandon(PROVIDER, pending[1] + ABANDON_AFTER_S + 2) == 0
    workspace = services.accounts.get(ws)
    assert (workspace.credits, workspace.held, workspace.queued, workspace.queued_bytes) == (1000, 0, 0, 0)
    assert _ledger(services, ws) == [("hold", PRICE), ("release", PRICE)]
    # the provider's step, had the caller come back to it now, can no longer place it
    late = services.store.admission._place(keys=[keys.request(request_id), keys.queue(PROVIDER),
                                                 keys.sequence(PROVIDER), keys.schedule(PROVIDER),
                                                 keys.running(PROVIDER), keys.schedule(PROVIDER),
                                                 keys.request(request_id), keys.body(request_id),
                                                 keys.deadlines(PROVIDER), keys.body(request_id),
                                                 keys.admitting(PROVIDER)],
                                           args=_place_args(request_id, ws, pending[0]))
    assert late == [b"EXPIRED"]
    assert services.store.status_view(request_id, PROVIDER).record is None
    assert services.store.admit(Submission(request_id=services.ids.mint(ws, MODEL), workspace=ws, model=MODEL,
                                provider=PROVIDER, body="{}", price=PRICE, fingerprint="f",
                                idempotency_key_hash="k1")).outcome.value == "ADMITTED"  # its key free again


def _place_args(request_id: str, ws: str, pending: bytes) -> list:
    values = {name: "" for name in SPLIT_ADMIT_ARGS}
    values.update(id=request_id, workspace=ws, model=MODEL, provider=PROVIDER, now=repr(time.time()), price=PRICE,
                  cap=10, grant_until=repr(time.time() + 30), priority="normal", reserved='{"limits": [1, 0]}',
                  admitting=pending.decode(), body="{}", retention=3600)
    return argv(SPLIT_ADMIT_ARGS, **values)


def test_a_replay_after_the_original_record_expired_answers_its_id_as_one_redis_does(split):
    ws = _workspace(split)
    first = split.ids.mint(ws, MODEL)
    split.store.admit(Submission(request_id=first, workspace=ws, model=MODEL, provider=PROVIDER, body="{}", price=PRICE,
                      fingerprint="f", idempotency_key_hash="k1"))
    _claim(split, first)
    _complete(split, first, output=b"{}", content_type="application/json")
    split.redis.delete(keys.request(first))  # its retention ended; the key's TTL had not
    replay = split.store.admit(Submission(request_id=split.ids.mint(ws, MODEL), workspace=ws, model=MODEL, provider=PROVIDER,
                               body="{}", price=PRICE, fingerprint="f", idempotency_key_hash="k1"))
    assert (replay.outcome.value, replay.request_id) == ("REPLAY", first)


def test_a_status_poll_on_a_split_store_counts_in_its_windows_exactly(split):
    """Counted in a step of its own (the windows are not in the record's slot):
    the window's limit holds to the call, and a refused poll reads nothing."""
    ws = _workspace(split)
    request_id = _admit(split, ws)
    allowance = ratelimit.Meter(ratelimit._allowance(f"ws:{ws}", "3/minute"))
    seen, left = [], []
    for _ in range(3):
        seen.append(split.store.status_view(request_id, PROVIDER, allowance).record.status)
        left.append(dict(allowance.fields())["RateLimit"].split(";t=")[0])
    assert seen == ["IN_QUEUE"] * 3
    assert left == ['"minute";r=2', '"minute";r=1', '"minute";r=0']  # told by the step that counted
    with pytest.raises(RateLimited) as refused:
        split.store.status_view(request_id, PROVIDER, allowance)
    assert refused.value.retry_after >= 1
    with pytest.raises(RateLimited):
        split.store.history(ws, since=0, rate=allowance)


# -- the pending webhook's count, given back when the request's last event ends ---------------------

HOOK = "https://hooks.example.com/h"


def _hooked(services, credits: int = 1000) -> str:
    ws = _workspace(services, credits)
    services.accounts.webhook_secret(ws, "whsec_" + "a" * 32)
    return ws


def _completed_with_event(services, ws: str) -> str:
    """A request with a webhook, completed: its "completed" event pending."""
    request_id = services.ids.mint(ws, MODEL)
    assert services.store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider=PROVIDER, body="{}",
                                price=PRICE, webhook_url=HOOK)).outcome.value == "ADMITTED"
    _claim(services, request_id)
    _complete(services, request_id, output=b"{}", content_type="application/json")
    assert services.webhooks.event(request_id)["state"] == "pending"
    return request_id


def _delivered(services, request_id: str, token: str = "w") -> None:
    now = time.time()
    taken = services.webhooks.take(request_id, now=now, lease_s=30, token=token)
    assert taken.outcome == "TAKEN"
    assert services.webhooks.record(taken.event, token=token, now=now, outcome="delivered", status=200, error="",
                                    seconds=0.1, next_at=None) == "DELIVERED"


def _pending_webhooks(services, ws: str) -> int:
    return services.accounts.get(ws).webhooks_pending


def test_a_delivered_event_gives_its_workspaces_pending_webhook_back_once_through_the_owed_set(split):
    ws = _hooked(split)
    request_id = _completed_with_event(split, ws)
    assert _pending_webhooks(split, ws) == 1
    assert split.redis.hget(keys.open_requests(ws), request_id) == b"w"  # its end given, its webhook still owed
    given = []
    apply = split.store.effects._apply
    split.store.effects._apply = lambda provider, owed: given.extend(owed) or apply(provider, owed)
    _delivered(split, request_id)
    assert [json.loads(effect)["kind"] for effect in given] == ["webhook"]
    assert _pending_webhooks(split, ws) == 0
    assert _owed(split) == [] and split.redis.hlen(keys.open_requests(ws)) == 0
    # given again (a sweeper's copy after a lost acknowledgement), or reconciled: nothing more
    assert apply(PROVIDER, given) == 0
    split.redis.zadd(keys.owed(PROVIDER), {given[0]: 0})
    assert split.store.effects.reconcile(PROVIDER, time.time() + RECONCILE_AFTER_S + 1) == 0
    assert _pending_webhooks(split, ws) == 0


def test_a_pending_webhook_left_owed_by_a_failed_workspace_step_is_given_by_the_sweeper_once(split, monkeypatch):
    ws = _hooked(split)
    request_id = _completed_with_event(split, ws)
    monkeypatch.setattr(split.store.effects, "_apply", _redis_down)
    _delivered(split, request_id)
    monkeypatch.undo()
    assert _pending_webhooks(split, ws) == 1
    assert [e["kind"] for e in _owed(split)] == ["webhook"]
    assert split.store.effects.reconcile(PROVIDER, time.time()) == 0  # its caller may still give it
    assert split.store.effects.reconcile(PROVIDER, time.time() + RECONCILE_AFTER_S + 1) == 1
    assert split.store.effects.reconcile(PROVIDER, time.time() + RECONCILE_AFTER_S + 2) == 0
    assert _pending_webhooks(split, ws) == 0
    assert _owed(split) == [] and split.redis.hlen(keys.open_requests(ws)) == 0


def test_a_pending_webhook_given_before_its_requests_end_counts_once_and_the_end_still_counts(split, monkeypatch):
    ws = _hooked(split)
    given = []
    monkeypatch.setattr(split.store.effects, "_apply", lambda provider, owed: given.extend(owed) or 0)
    request_id = _completed_with_event(split, ws)
    _delivered(split, request_id)
    monkeypatch.undo()
    start, end, webhook = given
    apply = split.store.effects._apply
    assert apply(PROVIDER, [webhook, webhook]) == 1
    assert apply(PROVIDER, [end, start, webhook, end, start]) == 2
    workspace = split.accounts.get(ws)
    assert (workspace.credits, workspace.held, workspace.queued, workspace.queued_bytes, workspace.webhooks_pending) \
        == (1000 - PRICE, 0, 0, 0, 0)
    assert _ledger(split, ws) == [("hold", PRICE), ("charge", PRICE)]
    assert split.redis.hlen(keys.open_requests(ws)) == 0


def test_an_event_given_up_waiting_its_turn_gives_its_pending_webhook_back_through_the_owed_set(split):
    ws = _hooked(split)
    split.webhooks.limits = DeliveryLimits(max_in_flight_per_workspace=1, window_s=60)
    first, late = (_completed_with_event(split, ws) for _ in range(2))
    now = time.time()
    assert split.webhooks.take(first, now=now, lease_s=600, token="held").outcome == "TAKEN"
    assert split.webhooks.take(late, now=now + 120, lease_s=30, token="late").outcome == "GAVE_UP"
    assert _pending_webhooks(split, ws) == 1  # the first's, still being delivered
    assert _owed(split) == [] and split.redis.hget(keys.open_requests(ws), first) == b"w"
    assert split.redis.hexists(keys.open_requests(ws), late) is False


def test_an_event_that_ends_with_its_request_gives_the_pending_webhook_back_with_the_end(split):
    ws = _hooked(split)
    request_id = split.ids.mint(ws, MODEL)
    assert split.store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider=PROVIDER, body="{}",
                             price=PRICE, webhook_url=HOOK, webhook_events="started")).outcome.value == "ADMITTED"
    _claim(split, request_id)
    _delivered(split, request_id)  # its "started" event, before it completed: nothing to give back yet
    assert _pending_webhooks(split, ws) == 1 and _owed(split) == []
    _complete(split, request_id, output=b"{}", content_type="application/json")  # no event left: given with the end
    assert _pending_webhooks(split, ws) == 0
    assert _owed(split) == [] and split.redis.hlen(keys.open_requests(ws)) == 0


def test_an_event_of_a_request_admitted_before_the_store_was_split_gives_its_pending_webhook_back_once(
        services, client, settings):
    ws = _hooked(services)
    before = _completed_with_event(services, ws)  # all on one Redis: its event is left to deliver
    after = services.ids.mint(ws, MODEL)  # admitted on one Redis, completed split
    assert services.store.admit(Submission(request_id=after, workspace=ws, model=MODEL, provider=PROVIDER, body="{}",
                                price=PRICE, webhook_url=HOOK)).outcome.value == "ADMITTED"
    split = _split_after(services, client, settings)
    assert split.redis.hgetall(keys.open_requests(ws)) == {before.encode(): b"w", after.encode(): b"qew"}
    given = []
    apply = split.store.effects._apply
    split.store.effects._apply = lambda provider, owed: given.extend(owed) or apply(provider, owed)
    _claim(split, after)
    _complete(split, after, output=b"{}", content_type="application/json")
    for request_id in (before, after):
        _delivered(split, request_id)
    assert _pending_webhooks(split, ws) == 0
    assert [json.loads(effect)["kind"] for effect in given] == ["start", "end", "webhook", "webhook"]
    assert apply(PROVIDER, given) == 0  # every one again, as a sweeper after a lost acknowledgement
    workspace = split.accounts.get(ws)
    assert (workspace.credits, workspace.held, workspace.queued, workspace.webhooks_pending) \
        == (1000 - 2 * PRICE, 0, 0, 0)
