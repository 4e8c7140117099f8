"""A provider's pool in Redis: which member a generation goes to, and what
each member's 429s and refused credentials have taught us.

The fair schedule grants a provider's slots up to its members' caps summed
(``catalog.max_in_flight``); a granted generation then takes a slot on the
member with the most headroom (``member_take.lua``). A 429 pauses the model
it answered on that member (quotas are per model) for the time it names, and
halves the member's learned cap; the cap grows back
by one every ``grow_every_s`` without one (AIMD). All of a provider's pool
sits in its own slot's keys (``keys.member_state``), so each step is one
script on a Redis Cluster too. ``docs/POOLS.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import redis

from ..provider_pools import Member
from . import keys
from .scripts import argv, load_script

log = logging.getLogger(__name__)

TAKE_ARGS = ("now", "request_id", "lease_until", "prefer", "grow_every", "full_wait", "model")
RELEASE_ARGS = ("member", "request_id")
LIMITED_ARGS = ("member", "what", "until", "cap", "now", "model")
#: Seconds a request waits before it asks again when every member is full
#: (rare: the schedule grants no more than the pool has room for, ``PoolCapacity``;
#: mostly a request a paused member's probe sent back). Short, because the slot
#: it waits for stays idle until it asks: 0.25 s left the member carrying a
#: failover idle enough to double its queue wait (bench ``pool_failover``).
FULL_WAIT_S = 0.05
#: Seconds a process trusts the pool's capacity it last read.
CAPACITY_TTL_S = 0.5
#: Seconds a member whose credential was refused (401, 403) is left out.
REVOKED_PAUSE_S = 300.0
#: Seconds a 429 pauses its member when it names no Retry-After.
DEFAULT_PAUSE_S = 5.0


@dataclass(frozen=True)
class Taken:
    """A member's slot, held for one generation; or, with ``member`` None,
    how long to wait before asking again (every member paused or full)."""

    member: str | None
    wait_s: float = 0.0


@dataclass(frozen=True)
class MemberState:
    """What the pool holds of one member, for the operator (``ops members``)."""

    provider: str
    member: str
    cap: int
    learned_cap: int
    in_flight: int
    #: When its last pause ends, for every model or for one (shown: ``ops members``).
    paused_until: float
    revoked_until: float
    taken: int
    rate_limited: int
    revoked: int
    #: The pause for every model (a 429 naming none), and each model's (its 429s).
    paused_all_until: float = 0.0
    paused_models: tuple[tuple[str, float], ...] = ()

    def out_until(self, model: str = "") -> float:
        """Until when it serves no generation of ``model`` ("": of any model)."""
        scoped = max((until for name, until in self.paused_models if name == model), default=0.0)
        return max(self.paused_all_until, self.revoked_until, scoped)


class MemberStore:
    def __init__(self, client: redis.Redis, *, grow_every_s: float = 10.0, clock: Callable[[], float] = time.time):
        self.client = client
        #: Unix seconds now: a pause's end and a lease's are judged by it (tests move it on).
        self.clock = clock
        #: Seconds without a 429 before a member's learned cap grows back by one.
        self.grow_every_s = grow_every_s
        self._take = load_script(client, "member_take", TAKE_ARGS)
        self._release = load_script(client, "member_release", RELEASE_ARGS)
        self._limited = load_script(client, "member_limited", LIMITED_ARGS)

    def take(self, provider: str, members: tuple[Member, ...], request_id: str, *, hold_s: float,
             prefer: str = "", model: str = "") -> Taken:
        """A slot on the member of ``members`` with the most headroom (on
        ``prefer``, the member that holds the request's generation, if it is
        still one), held for at most ``hold_s`` unless released. ``model``:
        a 429's pause counts for that model alone ("": any model's)."""
        now = self.clock()
        pairs = [value for member in members for value in (member.name, member.max_in_flight)]
        reply = self._take(keys=[keys.member_state(provider), keys.member_leases(provider)],
                           args=[*argv(TAKE_ARGS, now=repr(now), request_id=request_id,
                                       lease_until=repr(now + hold_s), prefer=prefer,
                                       grow_every=repr(self.grow_every_s), full_wait=repr(FULL_WAIT_S),
                                       model=model), *pairs])
        if reply[0] == b"TAKEN":
            return Taken(reply[1].decode())
        return Taken(None, float(reply[1]))

    def release(self, provider: str, member: str, request_id: str) -> bool:
        """Give back the slot ``request_id`` held on ``member`` (once)."""
        return bool(self._release(keys=[keys.member_state(provider), keys.member_leases(provider)],
                                  args=argv(RELEASE_ARGS, member=member, request_id=request_id)))

    def rate_limited(self, provider: str, member: Member, retry_after_s: float | None, model: str = "") -> int:
        """``member`` answered 429 (to ``model``): paused for its Retry-After
        (or :data:`DEFAULT_PAUSE_S`), its learned cap halved; returns that cap."""
        return self._mark(provider, member, "rate_limited", retry_after_s or DEFAULT_PAUSE_S, model)

    def revoked(self, provider: str, member: Member) -> None:
        """``member``'s credential was refused upstream: left out for
        :data:`REVOKED_PAUSE_S` (then tried again: a key put right comes back)."""
        self._mark(provider, member, "revoked", REVOKED_PAUSE_S)

    def _mark(self, provider: str, member: Member, what: str, for_s: float, model: str = "") -> int:
        now = self.clock()
        return int(self._limited(keys=[keys.member_state(provider)],
                                 args=argv(LIMITED_ARGS, member=member.name, what=what, until=repr(now + for_s),
                                           cap=member.max_in_flight, now=repr(now), model=model)))

    def states(self, provider: str, members: tuple[Member, ...]) -> list[MemberState]:
        """Each of ``members`` as the pool holds it now (one read)."""
        return read_states(self.client, provider, members)


def read_states(client: redis.Redis, provider: str, members: tuple[Member, ...]) -> list[MemberState]:
    """Each of ``provider``'s ``members`` as its pool's hash holds it (one read;
    no script: the scrape's gauges read it too)."""
    raw = {k.decode(): v.decode() for k, v in client.hgetall(keys.member_state(provider)).items()}

    def number(member: Member, field: str, default: float = 0.0) -> float:
        return float(raw.get(f"{member.name}:{field}", default))

    def models_paused(member: Member) -> tuple[tuple[str, float], ...]:
        prefix = f"{member.name}:paused_until|"
        return tuple((field[len(prefix):], float(value)) for field, value in raw.items() if field.startswith(prefix))

    states = []
    for m in members:
        scoped = models_paused(m)
        paused_all = number(m, "paused_until")
        states.append(MemberState(provider, m.name, m.max_in_flight,
                                  min(m.max_in_flight, int(number(m, "cap", m.max_in_flight))),
                                  int(number(m, "in_flight")), max([paused_all, *(u for _, u in scoped)]),
                                  number(m, "revoked_until"), int(number(m, "taken")), int(number(m, "rate_limited")),
                                  int(number(m, "revoked")), paused_all, scoped))
    return states


def capacities(states: list[MemberState], now: float) -> tuple[int, str]:
    """The pool's capacity, and the models whose own is below it: the learned
    caps of the members serving any model now, summed; then, for each model
    paused on one of them, that sum less those members ("model=cap,..."; ""
    when none). The schedule grants a request against the most any of its
    models has (``lib/model_room.lua``)."""
    serving = [s for s in states if s.out_until() <= now]
    total = sum(s.learned_cap for s in serving)
    paused = sorted({name for s in serving for name, until in s.paused_models if until > now})
    below = [f"{model}={total - sum(s.learned_cap for s in serving if s.out_until(model) > now)}" for model in paused]
    return total, ",".join(below)


def serving_caps(states: list[MemberState], now: float) -> list[int]:
    """Each member's learned cap while it serves any model, 0 while it is paused for every model or out."""
    return [s.learned_cap if s.out_until() <= now else 0 for s in states]


def rooms_by_place(members: tuple[Member, ...], serving: list[int]) -> dict[str, int]:
    """Each region's room for the schedule's region pins (``lib/pins.lua``):
    per region a member runs in, and "*" for the members marked ``any_region``,
    the caps of those serving now (``serving``, a cap per member: 0 while it
    is paused or out); empty when no member names a region or serves any (a
    pin then has no member here, and the worker ends its requests)."""
    rooms: dict[str, int] = {}
    for member, cap in zip(members, serving, strict=True):
        place = "*" if member.any_region else member.region  # (one that serves any pin counts once)
        if place:
            rooms[place] = rooms.get(place, 0) + cap
    return rooms


def region_rooms(members: tuple[Member, ...], serving: list[int]) -> str:
    """:func:`rooms_by_place` as the schedule is handed it: "@region=n,@*=n"."""
    return ",".join(f"@{place}={room}" for place, room in sorted(rooms_by_place(members, serving).items()))


class PoolCapacity:
    """How many generations the provider's schedule may grant now: its
    members' learned caps summed, a paused or taken-out member's left out, so
    a granted request finds a member with room instead of holding a provider
    slot while it asks again; and per model (:meth:`model_caps`), since a 429
    pauses one model on its member. Never a Redis wait on the caller's path (a
    submit's answer is bounded): the last figure read, refreshed in the
    background once ``ttl_s`` old (one read per provider and process at a
    time); the catalog's caps summed before the first read, and kept while
    Redis does not answer. ``wait``: refresh inline (tests)."""

    def __init__(self, client: redis.Redis, members: Callable[[str], tuple[Member, ...]], *,
                 ttl_s: float = CAPACITY_TTL_S, clock: Callable[[], float] = time.time, wait: bool = False):
        self.client = client
        self.members = members
        self.ttl_s = ttl_s
        self.clock = clock
        self.wait = wait
        self._read: dict[str, tuple[int, float]] = {}
        self._models: dict[str, str] = {}
        self._refreshing: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, provider: str) -> int:
        cached = self._read.get(provider)
        if cached is None or cached[1] <= self.clock():
            if self.wait:
                return self.refresh(provider)
            self._refresh_soon(provider)
        return cached[0] if cached is not None else self._configured(provider)

    def model_caps(self, provider: str) -> str:
        """The models whose capacity is below the pool's now ("model=cap,...")
        and each region's room ("@region=cap,...": :func:`region_rooms`), as
        last read; "" when neither (the schedule's grants then read nothing more)."""
        self(provider)
        known = self._models.get(provider)
        if known is None:  # not read yet: the catalog's caps, as the capacity's
            members = self.members(provider)
            return region_rooms(members, [member.max_in_flight for member in members])
        return known

    def refresh(self, provider: str) -> int:
        """Read ``provider``'s pool now; its capacity (kept as it was if Redis does not answer)."""
        try:
            states = read_states(self.client, provider, self.members(provider))
        except Exception as exc:  # noqa: BLE001 - a background read must never raise: the last figure stands
            if not isinstance(exc, redis.RedisError):
                log.warning("%s: the pool's capacity was not read (%r); the last figure stands", provider, exc)
            previous = self._read.get(provider)
            capacity = previous[0] if previous is not None else self._configured(provider)
        else:
            now = self.clock()
            capacity, below = capacities(states, now)
            rooms = region_rooms(self.members(provider), serving_caps(states, now))
            self._models[provider] = ",".join(part for part in (below, rooms) if part)
        self._read[provider] = (capacity, self.clock() + self.ttl_s)
        return capacity

    def _configured(self, provider: str) -> int:
        return sum(member.max_in_flight for member in self.members(provider))

    def _refresh_soon(self, provider: str) -> None:
        with self._lock:
            if provider in self._refreshing:
                return
            self._refreshing.add(provider)

        def run() -> None:
            try:
                self.refresh(provider)
            finally:
                with self._lock:
                    self._refreshing.discard(provider)

        threading.Thread(target=run, name=f"pool-capacity-{provider}", daemon=True).start()
