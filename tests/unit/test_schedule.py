"""The schedule behind a provider's cap (lua/lib/schedule.lua), through the store, on
fakeredis and on a real Redis: order, fair share, weights, per-workspace
concurrency, priority, and positions that predict the start order."""

from __future__ import annotations

import pytest

from router_queue.states import IN_QUEUE
from router_queue.store import keys
from router_queue.store.requests_values import Lease
from tests.unit.schedule_support import MODEL, PROVIDER, Fleet
from tests.unit.support import record_of


def test_one_workspace_starts_in_submission_order(services):
    fleet = Fleet(services, cap=1)
    ws = fleet.workspace("a")
    for n in range(12):
        fleet.submit(ws, f"a{n}")
    assert fleet.run_all() == [f"a{n}" for n in range(12)]


def test_a_late_workspace_takes_turns_instead_of_waiting_behind_a_flood(services):
    fleet = Fleet(services, cap=1)
    a, b = fleet.workspace("a"), fleet.workspace("b")
    for n in range(30):
        fleet.submit(a, f"a{n}")
    for n in range(3):
        fleet.submit(b, f"b{n}")
    order = fleet.run_all()
    assert order[:8] == ["a0", "a1", "b0", "a2", "b1", "a3", "b2", "a4"]
    assert max(order.index(f"b{n}") for n in range(3)) < order.index("a9")


def test_weights_share_each_round(services):
    fleet = Fleet(services, cap=1)
    heavy, light = fleet.workspace("h", weight=3), fleet.workspace("l")
    blocker = fleet.submit(light, "blocker")
    fleet.start_granted()
    for n in range(9):
        fleet.submit(heavy, f"h{n}")
    for n in range(3):
        fleet.submit(light, f"l{n}")
    fleet.finish(blocker)
    order = fleet.run_all()[1:]
    for window in range(0, 12, 4):
        names = order[window:window + 4]
        assert sorted(n[0] for n in names) == ["h", "h", "h", "l"], order


def test_a_workspace_alone_gets_every_slot(services):
    fleet = Fleet(services, cap=3)
    ws = fleet.workspace("a", weight=1)
    ids = [fleet.submit(ws, f"a{n}") for n in range(5)]
    assert fleet.granted() == ids[:3]
    assert services.store.in_flight(PROVIDER) == 3


def test_a_workspace_at_its_own_cap_is_passed_and_resumes_when_one_ends(services):
    fleet = Fleet(services, cap=2)
    a, b = fleet.workspace("a", max_in_flight=1), fleet.workspace("b")
    a0, a1 = fleet.submit(a, "a0"), fleet.submit(a, "a1")
    b_ids = [fleet.submit(b, f"b{n}") for n in range(3)]
    fleet.start_granted()
    assert [fleet.names[i] for i in fleet.started] == ["a0", "b0"]
    assert fleet.status(a1) == IN_QUEUE
    # a waits for its own a0; its slot keeps its place in the order, as if a0 ended now
    assert [fleet.position(i) for i in (a1, b_ids[1], b_ids[2])] == [0, 1, 2]
    fleet.finish(b_ids[0])
    fleet.start_granted()
    assert fleet.names[fleet.started[-1]] == "b1"  # a1 is passed: a is at its own cap
    fleet.finish(a0)
    fleet.start_granted()
    assert fleet.names[fleet.started[-1]] == "a1"  # a's turn comes back as soon as a0 ends


def test_a_cap_an_operator_lowers_holds_the_waiting_workspaces_next_grant(services):
    fleet = Fleet(services, cap=2)
    ws = fleet.workspace("a")
    a0, a1, a2, _ = (fleet.submit(ws, f"a{n}") for n in range(4))
    fleet.start_granted()
    services.accounts.set_limits(ws, max_in_flight=1)
    fleet.finish(a0)
    assert fleet.granted() == []  # a1 still runs: a is at its new cap of 1
    fleet.finish(a1)
    assert fleet.granted() == [a2]


def test_the_schedule_keeps_a_waiting_workspaces_limits_and_forgets_them_when_it_drains(services):
    fleet = Fleet(services, cap=1)
    ws = fleet.workspace("a", weight=3, max_in_flight=2)
    fleet.submit(ws, "a0")
    fleet.submit(ws, "a1")
    assert services.redis.hget(keys.schedule(PROVIDER), f"lim|{ws}") == b"3:2"
    fleet.run_all()
    assert services.redis.hget(keys.schedule(PROVIDER), f"lim|{ws}") is None


def test_a_workspace_waiting_since_before_the_schedule_kept_limits_is_held_to_its_own(services):
    fleet = Fleet(services, cap=3)
    ws = fleet.workspace("a", max_in_flight=1)
    a0, a1, _ = (fleet.submit(ws, f"a{n}") for n in range(3))
    fleet.start_granted()
    services.redis.hdel(keys.schedule(PROVIDER), f"lim|{ws}")  # as an earlier version left it
    fleet.finish(a0)
    assert fleet.granted() == [a1]


def test_priority_orders_a_workspaces_own_requests_and_not_others(services):
    fleet = Fleet(services, cap=1)
    a, b = fleet.workspace("a"), fleet.workspace("b")
    for n in range(4):
        fleet.submit(a, f"a{n}")
    for n in range(2):
        fleet.submit(b, f"b{n}")
    fleet.submit(a, "a-high", priority="high")
    fleet.submit(a, "a-low", priority="low")
    order = fleet.run_all()
    assert order[0] == "a0"  # granted at once, before the others came
    assert order.index("a-high") < order.index("a1")
    assert order[-1] == "a-low"
    # b keeps the turns the round gave it: a's priority moves a's own requests only
    assert order.index("b0") == 2 and order.index("b1") == 4


def test_positions_predict_the_start_order(services):
    fleet = Fleet(services, cap=1)
    a, b, c = fleet.workspace("a"), fleet.workspace("b", weight=2), fleet.workspace("c")
    ids = [fleet.submit(a, f"a{n}") for n in range(6)]
    ids += [fleet.submit(b, f"b{n}", priority="low" if n % 2 else "normal") for n in range(5)]
    ids += [fleet.submit(c, "c0"), fleet.submit(c, "c-high", priority="high")]
    predicted = sorted(ids, key=fleet.position)
    assert sorted(fleet.position(i) for i in ids) == list(range(len(ids)))
    fleet.run_all()
    assert fleet.started == predicted


def test_a_cancelled_waiting_request_gives_back_its_slot_and_those_behind_move_up(services):
    fleet = Fleet(services, cap=1)
    a, b = fleet.workspace("a"), fleet.workspace("b")
    ids = [fleet.submit(a, f"a{n}") for n in range(4)] + [fleet.submit(b, f"b{n}") for n in range(2)]
    before = {i: fleet.position(i) for i in ids}
    assert services.store.cancel(request_id=ids[1], workspace=a, model=MODEL, provider=PROVIDER) == "CANCELLED"
    after = {i: fleet.position(i) for i in ids if i != ids[1]}
    assert all(after[i] <= before[i] for i in after)
    assert sorted(after.values()) == list(range(len(after)))
    assert services.store.waiting_workspaces(PROVIDER) == (2, [(a, 2), (b, 2)]) or \
        services.store.waiting_workspaces(PROVIDER) == (2, [(b, 2), (a, 2)])


def test_cancelling_a_granted_request_gives_its_slot_to_the_next(services):
    fleet = Fleet(services, cap=1)
    ws = fleet.workspace("a")
    first, second = fleet.submit(ws, "first"), fleet.submit(ws, "second")
    assert fleet.granted() == [first]
    assert services.store.cancel(request_id=first, workspace=ws, model=MODEL, provider=PROVIDER) == "CANCELLED"
    assert fleet.granted() == [second]
    assert fleet.position(second) == 0
    assert services.store.in_flight(PROVIDER) == 1


def test_a_waiting_request_past_its_queue_timeout_frees_nothing_it_did_not_hold(services):
    fleet = Fleet(services, cap=1)
    ws = fleet.workspace("a")
    first, second, third = (fleet.submit(ws, n) for n in ("first", "second", "third"))
    created = services.store.status_view(second, PROVIDER).record.created_at
    assert services.store.expire_queued(second, PROVIDER, ws, 60, now=created + 61)
    assert fleet.granted() == [first]  # the slot stays with the granted one
    assert fleet.position(third) == 1
    assert fleet.run_all() == ["first", "third"]


def test_a_granted_request_past_its_queue_timeout_hands_its_slot_on_at_claim(services):
    fleet = Fleet(services, cap=1)
    ws = fleet.workspace("a")
    first, second = fleet.submit(ws, "first"), fleet.submit(ws, "second")
    created = services.store.status_view(first, PROVIDER).record.created_at
    claim = services.store.claim(record_of(services, first, PROVIDER), Lease("t", 30, 60, 3), now=created + 61)
    assert claim == "QUEUE_TIMEOUT"
    assert fleet.granted() == [second]


def test_a_raised_cap_is_granted_by_the_sweepers_grant(services):
    fleet = Fleet(services, cap=1)
    ws = fleet.workspace("a")
    ids = [fleet.submit(ws, f"a{n}") for n in range(3)]
    assert fleet.granted() == ids[:1]
    services.store.max_in_flight = lambda provider: 3
    services.store.grant(PROVIDER)
    assert fleet.granted() == ids


@pytest.mark.parametrize("raw", ["high", "normal", "low"])
def test_the_priority_is_recorded_on_the_request(services, raw):
    fleet = Fleet(services, cap=1)
    request_id = fleet.submit(fleet.workspace("a"), "x", priority=raw)
    assert services.redis.hget(keys.request(request_id), "priority").decode() == raw


def test_a_request_admitted_before_the_schedule_existed_joins_it_when_its_message_arrives(services):
    """An upgrade with requests waiting: their records and queue places exist,
    their schedule entries do not; the message each of them has adopts it."""
    fleet = Fleet(services, cap=1)
    ws = fleet.workspace("a")
    running = fleet.submit(ws, "running")
    fleet.start_granted()
    old = services.ids.mint(ws, MODEL)
    services.redis.hset(keys.request(old), mapping={
        "id": old, "workspace": ws, "model": MODEL, "provider": PROVIDER, "status": IN_QUEUE, "body": "{}",
        "seq": 999, "created_at": "1000.0", "hold": 0})
    services.redis.zadd(keys.queue(PROVIDER), {old: 999})
    assert fleet.position(old) is None

    assert services.store.claim(record_of(services, old, PROVIDER), Lease("t", 30, 10**12, 3)) == "WAITING"

    assert fleet.position(old) == 0
    fleet.finish(running)
    assert fleet.granted() == [old]


def test_one_grant_fills_exactly_the_free_slots_past_a_parked_workspace_and_no_more(services):
    """grant() counts the slots it gives as it goes (lib/schedule.lua): it reads rq:running once."""
    fleet = Fleet(services, cap=1)
    capped = fleet.workspace("capped", max_in_flight=1)
    other = fleet.workspace("other")
    c = [fleet.submit(capped, f"c{n}") for n in range(3)]
    o = [fleet.submit(other, f"o{n}") for n in range(3)]
    assert fleet.granted() == c[:1]
    services.store.max_in_flight = lambda provider: 3  # two slots free; capped is at its own cap
    services.store.grant(PROVIDER)
    assert fleet.granted() == [c[0], o[0], o[1]] and services.store.in_flight(PROVIDER) == 3
    services.store.grant(PROVIDER)  # no slot free: nothing more
    assert fleet.granted() == [c[0], o[0], o[1]]
    services.store.max_in_flight = lambda provider: 2  # a lowered cap: below what is in flight
    fleet.start_granted()
    fleet.finish(o[0])
    assert services.store.in_flight(PROVIDER) == 2 and fleet.granted() == []
    services.store.max_in_flight = lambda provider: 4
    services.store.grant(PROVIDER)
    assert fleet.granted() == [o[2]]  # capped still at its own cap: the one free slot left stays free
    assert services.store.in_flight(PROVIDER) == 3
    assert fleet.run_all() == ["c0", "o0", "o1", "o2", "c1", "c2"]
    services.store.grant(PROVIDER)  # nothing waits: nothing granted
    assert fleet.granted() == [] and services.store.in_flight(PROVIDER) == 0
