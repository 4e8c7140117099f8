"""The schedule against a plain reference model of its policy (hypothesis).

Random arrivals (workspaces with weights, own caps and priorities), starts,
completions, cancels, queue timeouts, lease expiries and lost workers drive
the store's scripts and ``ReferenceSchedule`` side by side. After every step:
the same requests hold slots, in the same grant order; no status goes
backwards; the caps hold; nothing is lost; every position the store reports
is the number of requests the model starts before it when nothing else
arrives; at the end every hold is settled exactly once.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings, strategies as st

from router_queue.requests.record import Submission
from router_queue.requests.values import Lease
from router_queue.services import Services
from router_queue.settings import Settings
from router_queue.states import COMPLETED, IN_PROGRESS, IN_QUEUE
from router_queue.store import keys
from tests.unit.support import record_of

MODEL = "vertexai/gemini-3.1-flash-image"
OTHER = "vertexai/gemini-2.5-flash-image"  # the same body: a fallback of MODEL
#: A request's models by kind: the path's, then those it names in X-Comfy-Fallback-Models.
KINDS = {"model": (MODEL,), "other": (OTHER,), "fallback": (MODEL, OTHER)}
#: How many of a workspace's first requests a grant asks about (lib/model_room.lua).
LOOKAHEAD = 8
PROVIDER = "vertexai"
QUANTUM = 720720
BANDS = {"high": 0, "normal": 1, "low": 2}
ORDER = {IN_QUEUE: 0, IN_PROGRESS: 1, COMPLETED: 2}


@dataclass
class ReferenceSchedule:
    """The policy, written plainly: lists sorted on demand, no indexes.

    A workspace's n-th queued request gets the tag max(vtime, its last tag) +
    QUANTUM // weight; a free slot goes to the lowest tag (then the older) among
    workspaces not at their own cap, and within the workspace to its first
    request by (priority, arrival); a request that leaves the queue unrun takes
    its workspace's last tag with it. Once ``cap - reserve`` slots are taken,
    the rest go only to workspaces whose first request is not low.

    With ``model_caps`` (a model's room below the cap: its 429s paused it on
    some members), a request may start only while fewer than the most room
    any of its models has are in flight; a workspace's slot then goes to the
    first of its first LOOKAHEAD requests that may (not a low one once only
    the reserve is left), and a workspace with none is passed over.
    """

    cap: int
    weights: dict[str, int]
    limits: dict[str, int]
    vtime: int = 0
    slot_seq: int = 0
    last_tag: dict[str, int] = field(default_factory=dict)
    tags: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # ws -> [(tag, slot seq)]
    waiting: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)  # ws -> [(band, seq, id)]
    granted: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    owner: dict[str, str] = field(default_factory=dict)
    reserve: int = 0
    model_caps: dict[str, int] = field(default_factory=dict)
    models: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def room(self, request_id: str) -> int:
        return max(self.model_caps.get(m, self.cap) for m in self.models.get(request_id, (MODEL,)))

    def _fitting(self, ws: str, taken: int, urgent_only: bool) -> str | None:
        for band, _, request_id in self.waiting[ws][:LOOKAHEAD]:
            if urgent_only and band >= BANDS["low"]:
                return None
            if taken < self.room(request_id):
                return request_id
        return None

    def in_flight(self, ws: str) -> int:
        return sum(1 for i in self.granted + self.running if self.owner[i] == ws)

    def admit(self, ws: str, request_id: str, band: int, seq: int) -> None:
        self.owner[request_id] = ws
        tag = max(self.vtime, self.last_tag.get(ws, 0)) + QUANTUM // self.weights[ws]
        self.slot_seq += 1
        self.last_tag[ws] = tag
        self.tags.setdefault(ws, []).append((tag, self.slot_seq))
        self.waiting.setdefault(ws, []).append((band, seq, request_id))
        self.waiting[ws].sort()
        self.grant()

    def _forget_if_idle(self, ws: str) -> None:
        if not self.waiting.get(ws):
            self.waiting.pop(ws, None)
            self.tags.pop(ws, None)
            self.last_tag.pop(ws, None)

    def grant(self) -> None:
        while (taken := len(self.granted) + len(self.running)) < self.cap:
            eligible = [ws for ws in self.waiting
                        if not (self.limits[ws] and self.in_flight(ws) >= self.limits[ws])]
            urgent_only = taken >= self.cap - self.reserve
            if urgent_only:
                eligible = [ws for ws in eligible if self.waiting[ws][0][0] < BANDS["low"]]
            fits = {ws: r for ws in eligible if (r := self._fitting(ws, taken, urgent_only)) is not None}
            if not fits:
                return
            ws = min(fits, key=lambda w: self.tags[w][0])
            tag, _ = self.tags[ws].pop(0)
            self.vtime = max(self.vtime, tag)
            request_id = fits[ws]
            self.waiting[ws] = [w for w in self.waiting[ws] if w[2] != request_id]
            self._forget_if_idle(ws)
            self.granted.append(request_id)

    def start(self, request_id: str) -> None:
        self.granted.remove(request_id)
        self.running.append(request_id)

    def end(self, request_id: str) -> None:
        """It ran (or was given up), was cancelled or timed out; whatever it held goes on."""
        if request_id in self.granted:
            self.granted.remove(request_id)
        elif request_id in self.running:
            self.running.remove(request_id)
        else:
            ws = self.owner[request_id]
            self.waiting[ws] = [w for w in self.waiting[ws] if w[2] != request_id]
            self.tags[ws].pop()
            if self.tags[ws]:
                self.last_tag[ws] = self.tags[ws][-1][0]
            self._forget_if_idle(ws)
        self.grant()

    def predicted_starts(self) -> list[str]:
        """The start order if nothing else arrives: granted ones start in grant
        order, and each generation ends in the order it started."""
        model = copy.deepcopy(self)
        order: list[str] = []
        while model.granted or model.running:
            for request_id in list(model.granted):
                model.start(request_id)
                order.append(request_id)
            if model.running:
                model.end(model.running[0])
        return order


#: Arrivals and starts are drawn most often, so queues build up and drain.
_steps = (
        st.tuples(st.just("admit"), st.integers(0, 3), st.sampled_from(list(BANDS))),
        st.tuples(st.just("admit"), st.integers(0, 3), st.just("normal")),
        st.tuples(st.just("start"), st.integers(0, 50), st.just("")),
        st.tuples(st.just("complete"), st.integers(0, 50), st.just("")),
        st.tuples(st.just("complete"), st.integers(0, 50), st.sampled_from(["", "provider_error"])),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just("")),
        st.tuples(st.just("timeout"), st.integers(0, 50), st.just("")),
        st.tuples(st.just("lost_worker"), st.integers(0, 50), st.just("")),
        st.tuples(st.just("grant_lease_expired"), st.integers(0, 50), st.just("")),
)
ops = st.lists(st.one_of(*_steps), min_size=20, max_size=80)
#: ... and arrivals of either model, or of one naming the other as its fallback.
model_ops = st.lists(st.one_of(*_steps, st.tuples(st.just("admit_as"), st.integers(0, 3), st.sampled_from(list(KINDS))),
                               st.tuples(st.just("admit_as"), st.integers(0, 3), st.sampled_from(list(KINDS)))),
                     min_size=20, max_size=80)


@pytest.fixture(params=["fakeredis", "redis"])
def empty_client(request) -> Callable[[], redis.Redis]:
    """Makes an empty client for each hypothesis example (a function-scoped
    fixture lives through all of a test's examples)."""
    if request.param == "fakeredis":
        return lambda: fakeredis.FakeRedis(server=fakeredis.FakeServer())
    real = request.getfixturevalue("real_redis")

    def emptied() -> redis.Redis:
        real.flushdb()
        return real
    return emptied


def _urgent_heads(client: redis.Redis) -> list[tuple[bytes, float]]:
    return client.zrange(f"{keys.schedule(PROVIDER)}:uheads", 0, -1, withscores=True)


def _heads_not_low_first(client: redis.Redis) -> list[tuple[bytes, float]]:
    """What reserve_pick reads from :uheads (lib/reserve.lua), read the long way:
    the heads, in order, whose workspace's first waiting request is not low."""
    sched = keys.schedule(PROVIDER)
    kept = []
    for member, tag in client.zrange(f"{sched}:heads", 0, -1, withscores=True):
        first = client.zrange(f"{sched}:ws:{member.decode()[16:]}", 0, 0, withscores=True)
        if first and first[0][1] < BANDS["low"] * 2**45:
            kept.append((member, tag))
    return kept


def _drive(empty_client, cap: int, weights: list[int], limits: list[int], steps, headroom_pct: int = 0,
           model_caps: dict[str, int] | None = None) -> None:
    settings = Settings(redis_url="redis://unused", default_rate_limit="1000/second", max_takeovers=1,
                        low_priority_headroom_pct=headroom_pct)
    services = Services.build(settings, empty_client())
    store = services.store
    store.max_in_flight = lambda provider: cap
    store.model_caps = lambda provider: ",".join(f"{m}={c}" for m, c in (model_caps or {}).items())
    workspaces = []
    for n, (weight, limit) in enumerate(zip(weights, limits)):
        ws = services.accounts.create_workspace(f"w{n}", queue_enabled=True, credits=10**9)
        services.accounts.set_limits(ws, max_queued=10**6, weight=weight, max_in_flight=limit)
        workspaces.append(ws)
    model = ReferenceSchedule(cap, dict(zip(workspaces, weights)), dict(zip(workspaces, limits)),
                              reserve=min(cap - 1, -(-cap * headroom_pct // 100)), model_caps=dict(model_caps or {}))
    ids: list[str] = []
    seen: dict[str, str] = {}
    seq = 0

    def granted_in_store() -> list[str]:
        return [i.decode() for i in services.redis.zrange(f"{keys.schedule(PROVIDER)}:granted", 0, -1)]

    def pick(n: int, statuses: set[str], granted: bool | None = None) -> str | None:
        live = [i for i in ids if seen[i] in statuses and (granted is None or (i in model.granted) == granted)]
        return live[n % len(live)] if live else None

    for op, n, arg in steps:
        if op in ("admit", "admit_as"):
            ws = workspaces[n % len(workspaces)]
            request_id = services.ids.mint(ws, MODEL)
            named = KINDS[arg] if op == "admit_as" else (MODEL,)
            priority = "normal" if op == "admit_as" else arg
            assert store.admit(Submission(request_id=request_id, workspace=ws, model=named[0], provider=PROVIDER,
                                          body="{}", price=7, priority=priority,
                                          fallback_models=",".join(named[1:]))).outcome == "ADMITTED"
            seq += 1
            ids.append(request_id)
            model.models[request_id] = named
            model.admit(ws, request_id, BANDS[priority], seq)
        elif op == "start":
            request_id = pick(n, {IN_QUEUE}, granted=True)
            if request_id is None:
                continue
            assert store.claim(record_of(services, request_id, PROVIDER), Lease(f"t{n}", 30, 3600, 1)) == "CLAIMED"
            model.start(request_id)
        elif op == "complete":
            request_id = pick(n, {IN_PROGRESS})
            if request_id is None:
                continue
            assert store.complete(record_of(services, request_id, PROVIDER), output=b"{}", error_type=arg,
                                  detail=arg) == COMPLETED
            model.end(request_id)
        elif op == "cancel":
            request_id = pick(n, {IN_QUEUE})
            if request_id is None:
                continue
            record = record_of(services, request_id, PROVIDER)
            assert store.cancel(request_id=request_id, workspace=record.workspace, model=record.model,
                                provider=PROVIDER) == "CANCELLED"
            model.end(request_id)
        elif op == "timeout":
            request_id = pick(n, {IN_QUEUE})
            if request_id is None:
                continue
            record = record_of(services, request_id, PROVIDER)
            if request_id in model.granted:  # its delivery finds it too old to start
                claim = store.claim(record, Lease("late", 30, 0, 1), now=record.created_at + 1)
                assert claim == "QUEUE_TIMEOUT"
            else:  # the sweeper finds it at the head of the queue
                assert store.expire_queued(request_id, PROVIDER, record.workspace, 0, now=record.created_at + 1)
            model.end(request_id)
        elif op == "lost_worker":  # its lease ran out twice: the second takeover gives up
            request_id = pick(n, {IN_PROGRESS})
            if request_id is None:
                continue
            record = record_of(services, request_id, PROVIDER)
            far = record.started_at + 10_000
            assert store.claim(record, Lease("b", 30, 3600, 1), now=far) == "RESUMED"
            assert store.claim(record, Lease("c", 30, 3600, 1), now=far + 10_000) == "EXHAUSTED"
            model.end(request_id)
        elif op == "grant_lease_expired":  # the reaper republishes; the first delivery claims it
            request_id = pick(n, {IN_QUEUE}, granted=True)
            if request_id is None:
                continue
            assert (request_id, False) in store.reap(PROVIDER, float("inf"), again_at=float("inf"))
            record = record_of(services, request_id, PROVIDER)
            assert store.claim(record, Lease("x", 30, 3600, 1)) == "CLAIMED"
            assert store.claim(record, Lease("y", 30, 3600, 1)) == "LEASED"
            model.start(request_id)

        # -- after every step ---------------------------------------------------
        assert granted_in_store() == model.granted
        assert store.in_flight(PROVIDER) == len(model.granted) + len(model.running) <= cap
        for ws, limit in model.limits.items():
            assert not limit or model.in_flight(ws) <= limit
        views = {i: store.status_view(i, PROVIDER) for i in ids}
        for request_id, view in views.items():
            status = view.record.status
            assert ORDER[status] >= ORDER[seen.get(request_id, IN_QUEUE)], "a status went backwards"
            seen[request_id] = status
        waiting = [i for i in ids if seen[i] == IN_QUEUE]
        assert store.queue_depth(PROVIDER) == len(waiting)  # nothing lost, nothing left behind
        assert _urgent_heads(services.redis) == _heads_not_low_first(services.redis)
        assert {i for i in waiting if i not in model.granted} == {
            w[2] for queued in model.waiting.values() for w in queued}
        if not any(model.limits.values()) and not model.reserve and not model.model_caps:
            predicted = model.predicted_starts()
            assert {i: views[i].position for i in waiting} == {i: predicted.index(i) for i in waiting}
        else:  # a workspace at its own cap, low work kept from the reserve, a model's room: a distinct, ordered bound
            assert sorted(views[i].position for i in waiting) == list(range(len(waiting)))

    # every hold settled exactly once: a charge for each success, a release otherwise
    for ws in workspaces:
        settled: dict[str, list[str]] = {}
        for entry in services.accounts.ledger(ws):
            settled.setdefault(entry.request_id, []).append(entry.type)
        for request_id, types in settled.items():
            record = store.status_view(request_id, PROVIDER).record
            if record.status != COMPLETED:
                assert types == ["hold"]
            elif record.error_type:
                assert types == ["hold", "release"]
            else:
                assert types == ["hold", "charge"]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(1, 3), weights=st.lists(st.integers(1, 4), min_size=1, max_size=4), steps=ops)
def test_the_schedule_follows_the_reference_policy(empty_client, cap, weights, steps):
    _drive(empty_client, cap, weights, [0] * len(weights), steps)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(1, 4), weights=st.lists(st.integers(1, 3), min_size=2, max_size=4),
       limits=st.lists(st.integers(0, 2), min_size=4, max_size=4), steps=ops)
def test_workspaces_at_their_own_cap_are_passed_as_the_reference_policy_says(empty_client, cap, weights, limits,
                                                                            steps):
    _drive(empty_client, cap, weights, limits[:len(weights)], steps)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(2, 5), headroom_pct=st.sampled_from([10, 40, 100]),
       weights=st.lists(st.integers(1, 3), min_size=2, max_size=4), steps=ops)
def test_low_priority_work_leaves_the_reserve_as_the_reference_policy_says(empty_client, cap, headroom_pct, weights,
                                                                          steps):
    _drive(empty_client, cap, weights, [0] * len(weights), steps, headroom_pct)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(1, 4), headroom_pct=st.sampled_from([0, 40]),
       weights=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       model_caps=st.sampled_from([{MODEL: 0}, {MODEL: 1}, {MODEL: 0, OTHER: 1}, {OTHER: 2}]), steps=model_ops)
def test_a_models_room_is_granted_as_the_reference_policy_says(empty_client, cap, headroom_pct, weights, model_caps,
                                                              steps):
    _drive(empty_client, cap, weights, [0] * len(weights), steps, headroom_pct, model_caps)


def test_the_reference_model_predicts_a_plain_round_robin():
    """The model itself, on a case small enough to check by hand."""
    model = ReferenceSchedule(1, {"a": 1, "b": 1}, {"a": 0, "b": 0})
    for n in range(3):
        model.admit("a", f"a{n}", 1, n)
    model.admit("b", "b0", 1, 3)
    assert model.predicted_starts() == ["a0", "a1", "b0", "a2"]
    assert dataclasses.replace(model).granted == ["a0"]
