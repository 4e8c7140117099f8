"""Who is calling: the API key from ``X-API-Key`` or ``Authorization: Bearer``.

Key -> caller lookups are cached in-process for ``CACHE_TTL_S`` seconds,
because every status poll authenticates and the mapping almost never changes:
a revoked key, a rotated-out key past its overlap or a changed rate limit
takes effect within that on every process (a rotated-out key's entry never
outlives the key itself), and on connections held open too (:class:`HeldKey`).
A lookup is one script (``key_resolve.lua``) that also notes, at most once a
minute, that the key was used; a workspace key's rate limit is read with it,
in the same round trip, from the workspace the key resolved to last (the
first lookup in a process, or a key whose workspace changed, reads it apart).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from flask import Request

from ..errors import NotEnabled, Unauthorized
from ..store.accounts import Accounts
from ..store.apikeys import hash_key, key_id
from ..ttl_cache import TtlCache

#: Seconds a key -> caller lookup is reused: a revoked key is refused by
#: every front door within this (the contract promises 5 s).
CACHE_TTL_S = 2.0
#: Longest key we look up; longer is refused unread (keys we mint are 46 chars).
MAX_KEY_LENGTH = 256
#: Entries kept before the cache is cleared wholesale (bounds memory).
CACHE_MAX_ENTRIES = 10_000
#: Where a request's resolved caller (or its refusal) is kept for the rest of it.
_ENVIRON_KEY = "router_queue.caller"
#: Least seconds between two scheduled checks of a held key (a key whose
#: overlap ends as Redis and this process disagree by a hair is not polled hot).
HELD_RECHECK_MIN_S = 0.1


def presented_key(request: Request) -> str | None:
    return key_in(request.headers)


def key_in(headers) -> str | None:
    """The API key ``headers`` present (X-API-Key, else a Bearer token), or None."""
    key = headers.get("X-API-Key")
    if key is None:
        scheme, _, value = headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            key = value
    key = (key or "").strip()
    return key or None


@dataclass(frozen=True)
class Caller:
    #: The workspace id; for a legacy key, its own pseudo-workspace
    #: (``legacy:{key id}``): its Idempotency-Keys, backlog and fair-share turn.
    workspace: str
    #: The workspace's own request rate, if it sets one.
    rate_limit: str | None = None
    #: A key that belongs to no workspace: no queued delivery.
    legacy: bool = False


class KeyResolver:
    def __init__(self, accounts: Accounts, clock: Callable[[], float] = time.monotonic):
        self.accounts = accounts
        self.clock = clock
        #: key digest -> (caller or None, when the key stops or None), until
        #: CACHE_TTL_S after it was read or the key stops; ``self.clock``'s times
        self._cache: TtlCache[str, tuple[Caller | None, float | None]] = TtlCache(CACHE_MAX_ENTRIES)

    def caller(self, request: Request) -> Caller:
        """Who is calling; ``401 unauthorized`` for no key or an unknown one.
        Resolved once per request (the rate limit and the route both ask)."""
        known = request.environ.get(_ENVIRON_KEY)
        if known is None:
            try:
                known = self._resolve(request)
            except Unauthorized as refusal:
                known = refusal
            request.environ[_ENVIRON_KEY] = known
        if isinstance(known, Unauthorized):
            raise known
        return known

    def _resolve(self, request: Request) -> Caller:
        key = presented_key(request)
        if key is None:
            raise Unauthorized("send your API key as X-API-Key or Authorization: Bearer")
        if len(key) > MAX_KEY_LENGTH or not key.isascii():
            raise Unauthorized("the API key is not valid")
        caller, _ = self.lookup(key)
        if caller is None:
            raise Unauthorized("the API key is not valid")
        return caller

    def lookup(self, key: str, *, fresh: bool = False) -> tuple[Caller | None, float | None]:
        """The key's caller (None: refused) and when it stops (``self.clock``'s
        time; None: no end), from the cache unless ``fresh`` or stale."""
        digest = hash_key(key)
        now = self.clock()
        cached = None if fresh else self._cache.fresh(digest, now)
        if cached is not None:
            return cached
        previous = self._cache.last(digest)
        caller, left_s = self._lookup(key, previous[0] if previous is not None else None)
        valid_s = CACHE_TTL_S if left_s is None else min(CACHE_TTL_S, left_s)
        stops_at = None if left_s is None else now + left_s
        self._cache.put(digest, (caller, stops_at), now + valid_s)
        return caller, stops_at

    def _lookup(self, key: str, previous: Caller | None) -> tuple[Caller | None, float | None]:
        """The caller, and seconds until the key stops (None: no end).
        ``previous``: the key's last answer, whose workspace's rate limit is read with it."""
        guess = previous.workspace if previous is not None and not previous.legacy else None
        found = self.accounts.keys.resolve(key, rate_limit_of=guess)
        if found is None:
            self.accounts.epoch.check()  # an emptied store answers 503, not 401 for every key
            return None, None
        self.accounts.epoch.adopt()
        if found.legacy:
            return Caller(found.workspace, legacy=True), found.left_s
        limit = found.rate_limit if found.rate_limit_read else self.accounts.rate_limit(found.workspace)
        return Caller(found.workspace, limit), found.left_s

    def held_key(self, request: Request) -> HeldKey:
        """The key of a call to be held open, which :meth:`caller` accepted."""
        key = presented_key(request)
        assert key is not None  # caller() refused a call without one
        return HeldKey(self, key)

    def workspace(self, request: Request) -> str:
        """The caller's workspace, for the queue routes: a legacy key belongs to
        none, so queued delivery is ``403 not_enabled`` for it."""
        caller = self.caller(request)
        if caller.legacy:
            raise NotEnabled("this API key belongs to no workspace; queued delivery needs a workspace key")
        return caller.workspace


class HeldKey:
    """The key a held connection (an event stream, a synchronous call) was
    opened with, checked again while held, so that a revoked key loses those
    within the contract's 5 s too. Idle, it costs nothing: it is checked on
    its channel's notice (revoked, rotated; ``EventHub``, fresh from Redis),
    when its rotation's overlap ends, and once, through the cache, a cache
    lifetime after it was followed: that answer was read after the follow
    began, so a revocation whose notice came before it is seen."""

    def __init__(self, resolver: KeyResolver, key: str):
        self.resolver = resolver
        self.id = key_id(hash_key(key))
        self._key = key
        #: Set by the hub: a notice on the key's channel, or a gap in its subscription.
        self.noticed = False
        self._check_at: float | None = resolver.clock() + CACHE_TTL_S

    def followed(self) -> None:
        """The hub hears its notices from now on (or marks it ``noticed``)."""
        self._check_at = self.resolver.clock() + CACHE_TTL_S

    def due_in(self) -> float | None:
        """Seconds until it is to be checked (0: now); None: only on a notice."""
        if self.noticed:
            return 0.0
        return None if self._check_at is None else max(0.0, self._check_at - self.resolver.clock())

    def check(self) -> None:
        """``401 unauthorized`` once the key stopped working."""
        fresh, self.noticed = self.noticed, False
        caller, stops_at = self.resolver.lookup(self._key, fresh=fresh)
        if caller is None:
            raise Unauthorized("the API key was revoked (or its rotation's overlap ended) while this "
                               "connection was held open")
        self._check_at = None if stops_at is None else max(stops_at, self.resolver.clock() + HELD_RECHECK_MIN_S)
