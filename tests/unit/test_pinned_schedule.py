"""Region pins in the fair schedule (docs/POOLS.md, "Region pins";
lua/lib/pins.lua): a pinned workspace's requests are granted only while its
members have room, wait IN_QUEUE holding no provider slot otherwise, and
their queue positions count only the requests competing for those members;
on fakeredis and a real Redis, admitted in one step and split (a cluster's
admission hands the pin from the workspace's step to the provider's)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from router_queue.cli import main
from router_queue.requests.record import Submission
from router_queue.services import Services
from router_queue.states import IN_QUEUE
from router_queue.store import keys
from tests.unit.conftest import RecordingDispatcher
from tests.unit.fallback_support import NEW
from tests.unit.support import cli_runner, pooled

US, EU = "us-central1", "europe-west4"


@pytest.fixture(params=["one step", "split"])
def services(request, client, settings):
    return Services.build(settings, client, dispatcher=RecordingDispatcher(), split=request.param == "split")


@pytest.fixture
def pool(services, tmp_path):
    """Vertex AI as two locations (US, EU) of 2 slots each (pool cap 4), its capacity read at every grant."""
    return pooled(services, tmp_path)


@pytest.fixture
def workspaces(pool, workspace):
    """Three workspaces: pinned to EU, pinned to US, and not pinned."""
    us = pool.accounts.create_workspace("us", queue_enabled=True, credits=10**6)
    free = pool.accounts.create_workspace("free", queue_enabled=True, credits=10**6)
    pool.regions.set(workspace, (EU,))
    pool.regions.set(us, (US,))
    return workspace, us, free


def submit(services, workspace):
    request_id = services.ids.mint(workspace, NEW)
    assert services.store.admit(Submission(request_id=request_id, workspace=workspace, model=NEW,
                                           provider="vertexai", body="{}")).outcome == "ADMITTED"
    return request_id


def granted(services):
    return [i.decode() for i in services.redis.zrange(f"{keys.schedule('vertexai')}:granted", 0, -1)]


def cancel(services, workspace, request_id):
    services.store.cancel(request_id=request_id, workspace=workspace, model=NEW, provider="vertexai")


def position(services, request_id):
    return services.store.status_view(request_id, "vertexai").position


def test_a_pinned_workspace_takes_no_more_slots_than_its_members_have(pool, workspaces):
    eu, _, free = workspaces
    first = [submit(pool, eu) for _ in range(2)]
    third = submit(pool, eu)
    assert granted(pool) == first  # EU's two slots are full; the pool's other two are not its
    assert pool.store.status_view(third, "vertexai").record.status == IN_QUEUE
    others = [submit(pool, free) for _ in range(2)]
    assert granted(pool) == first + others  # the unpinned take the room the pinned one could not use
    cancel(pool, eu, first[0])
    assert granted(pool) == [first[1], *others, third]  # its member has room: granted in its turn


def test_a_pinned_workspace_passed_over_keeps_its_turn(pool, workspaces):
    eu, _, free = workspaces
    first = [submit(pool, eu) for _ in range(2)]
    waiting = submit(pool, eu)
    more = [submit(pool, free) for _ in range(3)]  # two granted, the third waits behind the pool's cap
    assert granted(pool) == first + more[:2]
    cancel(pool, eu, first[0])
    # one slot, now of EU's: the pinned workspace's tag is older than the unpinned one's next
    assert granted(pool) == [first[1], *more[:2], waiting]
    assert more[2] not in granted(pool)


def test_a_pinned_request_waits_while_its_members_are_paused(pool, workspaces):
    eu, _, free = workspaces
    for member in pool.catalog.members("vertexai"):
        if member.region == EU:
            pool.members.rate_limited("vertexai", member, 60)  # every model: EU's room is 0
    held = submit(pool, eu)
    other = submit(pool, free)
    assert granted(pool) == [other]
    assert position(pool, held) == 1  # only the granted one is ahead of it
    pool.clock.now += 61
    pool.store.grant("vertexai")
    assert granted(pool) == [other, held]


def test_a_pinned_requests_position_counts_only_those_competing_for_its_members(pool, workspaces):
    eu, us, free = workspaces
    running = [submit(pool, free) for _ in range(4)]  # the pool's cap: every later one waits
    assert granted(pool) == running
    us_waiting = [submit(pool, us) for _ in range(3)]
    eu_waiting = submit(pool, eu)
    late = submit(pool, free)
    # the provider's order: us[0], eu, late, us[1], us[2] (tags of 1, 1, 1, 2, 3 quanta; ties by age)
    assert position(pool, eu_waiting) == 4  # the 4 granted; US's waiting one ahead is not its competitor
    assert [position(pool, i) for i in us_waiting] == [4, 6, 7]  # EU's one left out of US's counts
    assert position(pool, late) == 6  # not pinned: every one ahead of it competes
    for request_id in running:
        cancel(pool, free, request_id)
    assert granted(pool) == [us_waiting[0], eu_waiting, late, us_waiting[1]]  # US's room (2) is full


def test_a_pin_changed_while_waiting_reaches_the_schedule_once_it_waits_no_more(pool, workspaces):
    eu, _, free = workspaces
    first = [submit(pool, eu) for _ in range(2)]
    waiting = submit(pool, eu)
    pool.regions.set(eu, ())
    also = submit(pool, eu)  # it joins the group its workspace waits in
    assert granted(pool) == first
    for request_id in first:
        cancel(pool, eu, request_id)
    assert granted(pool) == [waiting, also]
    later = [submit(pool, eu) for _ in range(2)]  # unpinned now: the pool's other two slots
    assert granted(pool) == [waiting, also, *later]
    assert submit(pool, free) not in granted(pool)


def test_a_request_joining_its_workspaces_wait_counts_that_groups_competitors(pool, workspaces):
    eu, us, free = workspaces
    for _ in range(4):
        submit(pool, free)  # the pool's cap: every later one waits
    us_waiting = [submit(pool, us) for _ in range(2)]
    first = submit(pool, eu)
    pool.regions.set(eu, ())  # unpinned while its request waits pinned to Europe
    joined = submit(pool, eu)
    # the provider's order: us[0], first, us[1], joined; the last waits in Europe's group as its workspace does
    assert [position(pool, i) for i in (*us_waiting, first, joined)] == [4, 5, 4, 5]


def test_a_full_group_is_passed_over_whole_however_many_of_its_workspaces_wait(pool, workspaces):
    eu, _, free = workspaces
    running = [submit(pool, eu) for _ in range(2)]  # Europe's two slots
    many = []
    for n in range(40):
        ws = pool.accounts.create_workspace(f"eu{n}", queue_enabled=True, credits=10**6)
        pool.regions.set(ws, (EU,))
        many.append(submit(pool, ws))
    unpinned = submit(pool, free)  # behind all 40 in tag order, for members they cannot use
    assert granted(pool) == [*running, unpinned]
    cancel(pool, eu, running[0])
    assert granted(pool) == [running[1], unpinned, many[0]]  # Europe's first in its turn


PINS = ((), (EU,), (US,), (EU, US))
ROOM = {(EU,): 2, (US,): 2, (EU, US): 4}
#: An operation: ("submit", workspace index) or ("end", which request holding a slot ends, by index).
operations = st.lists(st.one_of(st.tuples(st.just("submit"), st.integers(0, len(PINS) - 1)),
                                st.tuples(st.just("end"), st.integers(0, 7))), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=operations)
def test_every_step_grants_all_it_may_and_no_group_past_its_room(pool, steps):
    """After any sequence of submits and ends: the pool's cap holds, no group
    has more in flight than its members' room, and nothing waits that could
    be granted (a request waits only while the pool is full or its group is)."""
    pool.redis.flushdb()
    spaces = []
    for n, pin in enumerate(PINS):
        ws = pool.accounts.create_workspace(f"p{n}", queue_enabled=True, credits=10**6)
        pool.accounts.set_limits(ws, max_queued=100)
        pool.regions.set(ws, pin)
        spaces.append(ws)
    pin_of = {}
    for op, n in steps:
        if op == "submit":
            pin_of[submit(pool, spaces[n])] = n
        elif holding := [i.decode() for i in pool.redis.zrange(keys.running("vertexai"), 0, -1)]:
            ended = holding[n % len(holding)]
            cancel(pool, spaces[pin_of[ended]], ended)
        holding = [i.decode() for i in pool.redis.zrange(keys.running("vertexai"), 0, -1)]
        assert len(holding) <= 4
        in_group = {pin: sum(PINS[pin_of[i]] == pin for i in holding) for pin in ROOM}
        assert all(in_group[pin] <= room for pin, room in ROOM.items()), in_group
        waiting = [i for i in pin_of if i not in holding
                   and pool.store.status_view(i, "vertexai").record.status == IN_QUEUE]
        for request_id in waiting:
            pin = PINS[pin_of[request_id]]
            assert len(holding) == 4 or (pin and in_group[pin] >= ROOM[pin]), (request_id, pin, in_group)


def test_the_operator_sees_each_group_waiting_its_slots_and_its_room(pool, workspaces, app):
    eu, us, free = workspaces
    for _ in range(3):
        submit(pool, eu)  # Europe's two slots, and one waiting for them
    for _ in range(2):
        submit(pool, free)  # the pool's other two
    submit(pool, us)  # waits for the pool, not for its room
    shown = cli_runner(app).invoke(main, ["ops", "pins"])
    assert shown.exit_code == 0, shown.output
    assert [line.split("\t") for line in shown.output.splitlines()] == [
        ["provider", "group", "waiting", "in_flight", "room"],
        ["vertexai", EU, "1", "2", "2"],
        ["vertexai", US, "1", "0", "2"]]
