"""Who is calling: the API key from ``X-API-Key`` or ``Authorization: Bearer``.

Key -> caller lookups are cached in-process for ``CACHE_TTL_S`` seconds,
because every status poll authenticates and the mapping almost never changes:
a revoked key, a rotated-out key past its overlap or a changed rate limit
takes effect within that on every process (a rotated-out key's entry never
outlives the key itself). A lookup is one script (``key_resolve.lua``) that
also notes, at most once a minute, that the key was used; a workspace key's
rate limit is read with it, in the same round trip, from the workspace the
key resolved to last (the first lookup in a process, or a key whose workspace
is not the one it had, takes a second read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from flask import Request

from ..errors import NotEnabled, Unauthorized
from ..store.accounts import Accounts
from ..store.apikeys import hash_key

#: Seconds a key -> caller lookup is reused: a revoked key is refused by
#: every front door within this (the contract promises 5 s).
CACHE_TTL_S = 2.0
#: Longest key we look up; longer is refused unread (keys we mint are 46 chars).
MAX_KEY_LENGTH = 256
#: Entries kept before the cache is cleared wholesale (bounds memory).
CACHE_MAX_ENTRIES = 10_000
#: Where a request's resolved caller (or its refusal) is kept for the rest of it.
_ENVIRON_KEY = "router_queue.caller"


def presented_key(request: Request) -> str | None:
    key = request.headers.get("X-API-Key")
    if key is None:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
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
        self._cache: dict[str, tuple[float, Caller | None]] = {}

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
        digest = hash_key(key)
        now = self.clock()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            caller = cached[1]
        else:
            if len(self._cache) >= CACHE_MAX_ENTRIES:
                self._cache.clear()
            caller, valid_s = self._lookup(key, cached[1] if cached is not None else None)
            self._cache[digest] = (now + valid_s, caller)
        if caller is None:
            raise Unauthorized("the API key is not valid")
        return caller

    def _lookup(self, key: str, previous: Caller | None) -> tuple[Caller | None, float]:
        """The caller, and for how long the answer may be reused. ``previous``:
        the key's last answer, whose workspace's rate limit is read with it."""
        guess = previous.workspace if previous is not None and not previous.legacy else None
        found = self.accounts.keys.resolve(key, rate_limit_of=guess)
        if found is None:
            self.accounts.epoch.check()  # an emptied store answers 503, not 401 for every key
            return None, CACHE_TTL_S
        self.accounts.epoch.adopt()
        valid_s = CACHE_TTL_S if found.left_s is None else min(CACHE_TTL_S, found.left_s)
        if found.legacy:
            return Caller(found.workspace, legacy=True), valid_s
        limit = found.rate_limit if found.rate_limit_read else self.accounts.rate_limit(found.workspace)
        return Caller(found.workspace, limit), valid_s

    def workspace(self, request: Request) -> str:
        """The caller's workspace, for the queue routes: a legacy key belongs to
        none, so queued delivery is ``403 not_enabled`` for it."""
        caller = self.caller(request)
        if caller.legacy:
            raise NotEnabled("this API key belongs to no workspace; queued delivery needs a workspace key")
        return caller.workspace
