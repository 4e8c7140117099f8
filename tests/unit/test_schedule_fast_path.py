"""admit.lua's fast path (lua/lib/schedule.lua, grant_directly), on fakeredis and on a
real Redis: a request nobody waits ahead of, with a slot free and its
workspace under its own max_in_flight, is granted without taking a slot in
the schedule, and leaves exactly what the slow path (enqueue, then grant)
would have left; any other admission still takes the slow path."""

from __future__ import annotations

import pytest

from router_queue.store import keys
from router_queue.store.scripts import lib_for
from tests.unit.schedule_support import PROVIDER, Fleet

SCHED = keys.schedule(PROVIDER)
#: A stand-in broker list and message template (the real one: broker/dispatch.py).
BROKER_LIST = "broker:test"
TEMPLATE = '{"id": "RQTPLREQ", "task": "RQTPLTASK", "tag": "RQTPLTAG"}'

#: Runs one path of the two on a request whose record is written IN_QUEUE, as
#: admit.lua's last step does: "fast" answers {"SLOW"} when it does not apply.
#: KEYS: schedule, running, broker list; ARGV: cap, now, grant_until,
#: template, workspace, id, seq, path.
_PATHS = """
local S = sched_ctx(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
local granted
if ARGV[8] == "fast" then
  granted = grant_directly(S, ARGV[5], ARGV[6])
  if not granted then
    return {"SLOW"}
  end
else
  enqueue(S, ARGV[5], ARGV[6], tonumber(ARGV[7]), "normal")
  granted = grant(S)
end
local reply = with_granted("ADMITTED", granted)
table.insert(reply, 2, position(S.base, ARGV[5], ARGV[6]))
return reply
"""


def _paths_script(client):
    return client.register_script(lib_for(_PATHS) + _PATHS)


def _state(client) -> dict:
    """Every key's value, by type (the slot counter aside: see grant_directly)."""
    state = {}
    for key in sorted(client.keys("*")):
        kind = client.type(key).decode()
        if kind == "string":
            value = client.get(key)
        elif kind == "hash":
            value = client.hgetall(key)
            if key == SCHED.encode():
                value.pop(b"slotseq", None)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "set":
            value = sorted(client.smembers(key))
        else:
            value = client.xrange(key)
        state[key] = (kind, value, client.ttl(key) > 0)
    return state


def _run_path(client, path: str, ws: str, request_id: str, cap: int, template: str):
    """One path's reply, the state it leaves and what it announced."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(keys.EVENTS_PATTERN)
    pubsub.get_message(timeout=1)
    reply = _paths_script(client)(keys=[SCHED, keys.running(PROVIDER), BROKER_LIST],
                                  args=[cap, "1700000000.5", "1700000030.5", template, ws, request_id, 99, path])
    announced = []
    while (message := pubsub.get_message(timeout=0.2)) is not None:
        announced.append((message["channel"], message["data"]))
    pubsub.close()
    return reply, _state(client), announced


def _both_paths(client, ws: str, request_id: str, cap: int, template: str):
    """Run the fast path, then, from the same state, the slow one."""
    client.hset(keys.request(request_id), mapping={"status": "IN_QUEUE", "workspace": ws})
    before = {key: (client.dump(key), max(client.pttl(key), 0)) for key in client.keys("*")}
    fast = _run_path(client, "fast", ws, request_id, cap, template)
    client.flushdb()
    for key, (value, ttl_ms) in before.items():
        client.restore(key, ttl_ms, value)
    slow = _run_path(client, "slow", ws, request_id, cap, template)
    return fast, slow


@pytest.mark.parametrize("template", [TEMPLATE, ""])
def test_a_direct_grant_leaves_what_the_slow_path_leaves_on_a_fresh_provider(services, template):
    fleet = Fleet(services, cap=2)
    ws = fleet.workspace("a")
    fast, slow = _both_paths(services.redis, ws, "req-new", 2, template)
    assert fast[0][0] == b"ADMITTED" and fast[:2] == slow[:2]
    assert fast[0][1] == 0  # its position: first of the granted
    # Nobody else waits or is granted: no follower can see a change, so the
    # direct grant announces nothing (the slow path's grant() does).
    moved = (f"{keys.PROVIDER_EVENTS}{PROVIDER}".encode(), b"MOVED")
    assert fast[2] == [] and slow[2] == [moved]


@pytest.mark.parametrize("template", [TEMPLATE, ""])
def test_a_direct_grant_leaves_what_the_slow_path_leaves_after_traffic(services, template):
    fleet = Fleet(services, cap=4)
    heavy = fleet.workspace("heavy", weight=3, max_in_flight=2)
    other = fleet.workspace("other")
    first = fleet.submit(heavy, "h0")
    fleet.submit(other, "o0")
    fleet.submit(other, "o1")
    fleet.start_granted()
    fleet.finish(first)
    fleet.submit(other, "o2")  # granted, not started: the new request is granted behind it
    assert not services.redis.exists(f"{SCHED}:depths")
    fast, slow = _both_paths(services.redis, heavy, "req-new", 4, template)
    assert fast[0][0] == b"ADMITTED" and fast == slow
    assert fast[0][1] == 1
    # another is granted, not started: both paths announce that the queue moved
    assert fast[2] == [(f"{keys.PROVIDER_EVENTS}{PROVIDER}".encode(), b"MOVED")]


def test_no_direct_grant_when_someone_waits_or_no_slot_is_free(services):
    fleet = Fleet(services, cap=3)
    capped = fleet.workspace("capped", max_in_flight=1)
    other = fleet.workspace("other")
    fleet.submit(capped, "c0")
    fleet.submit(capped, "c1")  # parked behind its own cap: it waits, though slots are free
    script = _paths_script(services.redis)

    def fast(ws: str, cap: int):
        return script(keys=[SCHED, keys.running(PROVIDER), BROKER_LIST],
                      args=[cap, "1700000000.5", "1700000030.5", "", ws, "req-x", 99, "fast"])

    assert services.redis.zcard(f"{SCHED}:heads") == 0 and services.redis.zcard(f"{SCHED}:depths") == 1
    assert fast(other, 3) == [b"SLOW"]  # someone waits (parked)
    services.redis.delete(f"{SCHED}:depths")
    assert fast(other, 1) == [b"SLOW"]  # no slot free
    assert fast(capped, 3) == [b"SLOW"]  # its workspace at its own max_in_flight


def test_admissions_take_the_slow_path_while_others_wait_and_keep_their_turns(services):
    fleet = Fleet(services, cap=2)
    capped = fleet.workspace("capped", max_in_flight=1)
    other = fleet.workspace("other")

    def slots_made() -> int:
        return int(services.redis.hget(SCHED, "slotseq") or 0)

    c0 = fleet.submit(capped, "c0")
    assert slots_made() == 0 and fleet.granted() == [c0]  # granted directly
    c1 = fleet.submit(capped, "c1")
    assert slots_made() == 1 and fleet.position(c1) == 1  # waits, parked behind its own cap
    o0 = fleet.submit(other, "o0")
    assert slots_made() == 2 and fleet.granted() == [c0, o0]  # someone waits: the slow path grants it
    o1 = fleet.submit(other, "o1")
    assert slots_made() == 3 and fleet.position(o1) is not None
    assert fleet.run_all() == ["c0", "o0", "c1", "o1"]
    o2 = fleet.submit(other, "o2")
    assert slots_made() == 3 and fleet.granted() == [o2]  # nobody waits again: direct


def test_a_direct_grant_behind_nobody_announces_nothing_and_every_position_stays_right(services):
    fleet = Fleet(services, cap=3)
    a, b = fleet.workspace("a"), fleet.workspace("b")
    pubsub = services.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(keys.PROVIDER_EVENTS + "*")
    pubsub.get_message(timeout=1)

    def announced() -> int:
        count = 0
        while pubsub.get_message(timeout=0.2) is not None:
            count += 1
        return count

    a0 = fleet.submit(a, "a0")  # granted directly, nobody else granted: silent
    assert fleet.granted() == [a0] and fleet.position(a0) == 0 and announced() == 0
    b0 = fleet.submit(b, "b0")  # granted directly behind a0, which is not started: announced
    assert fleet.granted() == [a0, b0] and [fleet.position(a0), fleet.position(b0)] == [0, 1]
    assert announced() == 1
    fleet.start_granted()
    assert announced() >= 1  # claims announce as they always did
    b1 = fleet.submit(b, "b1")  # the others run: granted directly, silent
    assert fleet.position(b1) == 0 and announced() == 0
    pubsub.close()
