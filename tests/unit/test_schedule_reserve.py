"""The slots low-priority work leaves free (LOW_PRIORITY_HEADROOM_PERCENT,
lib/schedule.lua's low_reserve_of): a batch saturating a provider never makes
another workspace's interactive request wait for a slot to free, on fakeredis
and on a real Redis, a pool's cap included."""

from __future__ import annotations

import pytest

from router_queue.cli import main
from router_queue.provider_pools import Member
from router_queue.services import Services
from router_queue.store import keys
from router_queue.store.members import MemberStore, PoolCapacity
from tests.unit.schedule_support import PROVIDER, Fleet
from tests.unit.support import ServicesCliRunner


def _batch(fleet: Fleet, ws: str, n: int) -> list[str]:
    return [fleet.submit(ws, f"line{i}", priority="low") for i in range(n)]


def test_a_saturating_batch_leaves_the_reserve_and_interactive_requests_take_it_at_once(services):
    fleet = Fleet(services, cap=16)  # 10 % of 16, rounded up: 2 slots kept
    batcher, other = fleet.workspace("batcher"), fleet.workspace("other")
    lines = _batch(fleet, batcher, 40)
    assert fleet.granted() == lines[:14]
    fleet.start_granted()
    first, second = fleet.submit(other, "i0"), fleet.submit(other, "i1")
    assert fleet.granted() == [first, second]  # granted in their own admission, nothing had to end
    third = fleet.submit(other, "i2")
    assert third not in fleet.granted()  # the cap itself still holds
    fleet.start_granted()
    fleet.finish(lines[0])
    assert fleet.granted() == [third]  # the freed slot goes to the normal request, not the batch ahead of it


def test_the_batch_takes_its_slots_back_as_interactive_work_ends(services):
    fleet = Fleet(services, cap=4)  # 1 slot kept
    batcher, other = fleet.workspace("batcher"), fleet.workspace("other")
    lines = _batch(fleet, batcher, 10)
    fleet.start_granted()
    interactive = fleet.submit(other, "i0")
    fleet.start_granted()
    assert services.store.in_flight(PROVIDER) == 4
    fleet.finish(interactive)
    assert fleet.granted() == []  # the reserve is free again, and low work leaves it
    fleet.finish(lines[0])
    assert fleet.granted() == [lines[3]]
    assert fleet.run_all()[-1] == "line9"  # every line still runs, three at a time


def test_within_a_workspace_its_normal_request_takes_the_reserve_ahead_of_its_own_batch(services):
    fleet = Fleet(services, cap=2)  # 1 slot kept
    ws = fleet.workspace("a")
    lines = _batch(fleet, ws, 5)
    normal = fleet.submit(ws, "n0")
    assert fleet.granted() == [lines[0], normal]


@pytest.mark.parametrize("cap, headroom_pct, low_slots", [(1, 10, 1), (16, 0, 16), (16, 50, 8), (3, 100, 1)])
def test_low_work_alone_runs_on_the_cap_less_the_reserve_and_never_on_nothing(services, cap, headroom_pct,
                                                                               low_slots):
    fleet = Fleet(services, cap=cap)
    services.store.low_headroom_pct = headroom_pct
    _batch(fleet, fleet.workspace("a"), 20)
    assert len(fleet.granted()) == low_slots


def test_a_pools_reserve_follows_the_capacity_its_members_have_now(services):
    fleet = Fleet(services, cap=0)
    pool = (Member("a", 6, None), Member("b", 4, None))
    services.store.max_in_flight = PoolCapacity(services.redis, lambda provider: pool, ttl_s=0, wait=True)
    batcher, other = fleet.workspace("batcher"), fleet.workspace("other")
    lines = _batch(fleet, batcher, 30)
    assert len(fleet.granted()) == 9  # 10 summed, 1 kept
    fleet.start_granted()
    MemberStore(services.redis).rate_limited(PROVIDER, pool[1], retry_after_s=60)  # b paused: a's 6 left
    for line in lines[:5]:
        fleet.finish(line)
    assert fleet.granted() == [lines[9]]  # 4 in flight: low work may use 5 of a's 6, not 9 of 10
    fleet.start_granted()
    interactive = fleet.submit(other, "i0")
    assert fleet.granted() == [interactive]


def _commands(client) -> int:
    return sum(int(v["calls"]) for name, v in client.info("commandstats").items() if name != "cmdstat_info")



def _admission_behind(client, settings, low_only: int) -> int:
    """The commands Redis runs for an interactive admission that takes the reserve
    behind ``low_only`` workspaces waiting with low work only (scripts' own included)."""
    client.flushdb()
    fleet = Fleet(Services.build(settings, client), cap=16)
    _batch(fleet, fleet.workspace("batcher"), 14)
    fleet.start_granted()
    for n in range(low_only):
        fleet.submit(fleet.workspace(f"low{n}"), "line", priority="low")
    before = _commands(client)
    interactive = fleet.submit(fleet.workspace("other"), "i0")
    spent = _commands(client) - before
    assert fleet.granted() == [interactive]
    return spent


def test_an_interactive_request_behind_many_low_only_workspaces_costs_its_admission_the_same(real_redis, settings):
    """The reserve's pick is one read of the heads whose first request is not low
    (lib/reserve.lua), not a walk over every waiting workspace: the admission that
    takes the reserve costs Redis as many commands behind 300 low-only workspaces
    as behind 5 (60 each; the walk cost 64 and 359)."""
    assert _admission_behind(real_redis, settings, 300) == _admission_behind(real_redis, settings, 5) < 70


def test_entries_a_step_of_an_earlier_version_left_never_give_low_work_the_reserve(services):
    """During a rolling deploy a step of the version before lib/reserve.lua moves heads
    without keeping :uheads: an entry naming a workspace whose first request is low now,
    or a slot no longer a head, is passed over (and dropped) when the reserve is picked."""
    fleet = Fleet(services, cap=4)  # 1 slot kept
    batcher, other = fleet.workspace("batcher"), fleet.workspace("other")
    _batch(fleet, batcher, 10)
    fleet.start_granted()
    sched = keys.schedule(PROVIDER)
    (batch_head, _), = services.redis.zrange(f"{sched}:heads", 0, 0, withscores=True)
    services.redis.zadd(f"{sched}:uheads", {batch_head: 0, f"{'9' * 15}|{batcher}": 0})
    interactive = fleet.submit(other, "i0")
    assert fleet.granted() == [interactive]
    assert services.redis.zrange(f"{sched}:uheads", 0, -1) == []


def test_migrate_keys_gives_the_reserve_to_a_workspace_waiting_from_before_uheads(services):
    """A workspace whose normal request waited from before lib/reserve.lua kept :uheads
    took no slot kept from low work until its next change: ``ops migrate-keys`` rebuilds
    :uheads from :heads, as the steps keep it, and the next reserved slot to free is its."""
    fleet = Fleet(services, cap=4)  # 1 slot kept
    batcher, other, waiting = fleet.workspace("batcher"), fleet.workspace("other"), fleet.workspace("waiting")
    _batch(fleet, batcher, 10)
    fleet.start_granted()
    first = fleet.submit(other, "i0")  # takes the reserve
    fleet.start_granted()
    urgent = fleet.submit(waiting, "w0")  # the cap is full: it waits
    uheads = f"{keys.schedule(PROVIDER)}:uheads"
    kept = services.redis.zrange(uheads, 0, -1, withscores=True)
    assert [member.decode()[16:] for member, _ in kept] == [waiting]
    services.redis.delete(uheads)  # as the version before :uheads left it
    batch_head = services.redis.zrange(f"{keys.schedule(PROVIDER)}:heads", 0, -1)[0]
    services.redis.zadd(uheads, {batch_head: 0})  # and one entry it left behind
    migrated = ServicesCliRunner(services).invoke(main, ["ops", "migrate-keys"])
    assert migrated.exit_code == 0, migrated.output
    assert (f"rebuilt the urgent heads of {len(services.catalog.providers())} providers' schedules: "
            "1 workspaces may take a slot kept from low work") in migrated.output.splitlines()
    assert services.redis.zrange(uheads, 0, -1, withscores=True) == kept
    fleet.finish(first)
    assert fleet.granted() == [urgent]
