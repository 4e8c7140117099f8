"""Each caller's request rate over every route, polls included.

Fixed windows as in ``limits``, a counter per window in the store's Redis so
one limit holds across every front-door process. The bucket is the caller's
workspace (its ``rate_limit`` or ``DEFAULT_RATE_LIMIT``); unknown keys share
one bucket per client address (``callers.py``: the forwarded one, from a
trusted proxy). The count is one ``INCR`` per window (``lua/lib/util.lua``,
``spend_rate``): spent as the call opens (``rate.lua``), or, on
:data:`CARRIED_ENDPOINTS`, in the route's one script (after it, if the route
ended before it ran). What counts a call tells its :class:`Meter` where the
windows stand: the answer's RateLimit fields. ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache

import redis
from flask import Request
from limits import RateLimitItem, parse_many

from ..errors import RateLimited, Unauthorized
from ..store.requests_front import FrontDoorRequests, rate_window
from . import paths
from .auth import Caller, KeyResolver
from .callers import TrustedProxies

log = logging.getLogger(__name__)

#: Routes no limit applies to (probes, the operator listener's pages).
EXEMPT_ENDPOINTS = paths.endpoints(paths.Rate.EXEMPT)
#: Routes that count the call inside their own script (see the module docstring).
CARRIED_ENDPOINTS = paths.endpoints(paths.Rate.CARRIED)


@dataclass(frozen=True)
class Allowance:
    """One caller's windows, ready to be counted by a script: the counters'
    keys go after the script's own KEYS, ``(limit, seconds)`` pairs after its ARGV."""

    items: tuple[RateLimitItem, ...]
    keys: tuple[str, ...]
    args: tuple[int, ...]
    #: Each window's policy name in the RateLimit fields (:func:`policy_names`).
    names: tuple[str, ...] = ()
    #: The ``RateLimit-Policy`` field: every window's quota and length.
    policy: str = ""

    def refusal(self, reply) -> RateLimited:
        """The 429 for a script's ``{window index, ms left}`` answer, with the
        spent window's ``RateLimit`` (``r=0``, ``t`` what Retry-After says)."""
        index, left_ms = int(reply[0]), int(reply[1])
        item = self.items[index - 1]
        # Add a second so a client that waits exactly this finds the window over.
        wait = min(item.get_expiry(), max(1, math.ceil(left_ms / 1000) + 1))
        return RateLimited(f"request rate {item} is spent; honour Retry-After", retry_after=wait, fields={
            "RateLimit-Policy": self.policy, "RateLimit": f'"{self.names[index - 1]}";r=0;t={wait}'})

    def remaining(self, windows) -> str:
        """The ``RateLimit`` field for a counting script's ``{count, ms left}``
        per window: what each has left (``r``) and the seconds until it starts
        again (``t``; a counter without expiry reads as a whole window)."""
        fields = []
        for name, item, (count, left) in zip(self.names, self.items, windows):
            reset = math.ceil(int(left) / 1000) if int(left) >= 0 else item.get_expiry()
            fields.append(f'"{name}";r={max(0, item.amount - int(count))};t={reset}')
        return ", ".join(fields)


class Meter:
    """One call's count in its caller's windows: handed to whatever counts it
    (``rate``, to the store's scripts), which reports where the windows stand
    (:meth:`counted`) or raises the refusal; the envelope's ``headers`` step
    then sends :meth:`fields`. A call refused or never counted sends none
    (a 429 carries its own: :meth:`Allowance.refusal`)."""

    __slots__ = ("allowance", "keys", "args", "windows")

    def __init__(self, allowance: Allowance):
        self.allowance = allowance
        self.keys = allowance.keys
        self.args = allowance.args
        #: ``{count, ms left}`` per window once counted, else None.
        self.windows: list | None = None

    def refusal(self, reply) -> RateLimited:
        return self.allowance.refusal(reply)

    def counted(self, windows: list) -> None:
        self.windows = windows

    def fields(self) -> list[tuple[str, str]]:
        """The RateLimit header fields, once counted; else none."""
        if not self.windows:
            return []
        return [("RateLimit-Policy", self.allowance.policy), ("RateLimit", self.allowance.remaining(self.windows))]


def policy_names(items: tuple[RateLimitItem, ...]) -> tuple[str, ...]:
    """Each window's policy name: its length as ``limits`` writes it
    ("minute", "5seconds"), numbered after the first when two share one."""
    names: list[str] = []
    for item in items:
        name = item.GRANULARITY.name if item.multiples == 1 else f"{item.multiples}{item.GRANULARITY.name}s"
        names.append(name if name not in names else f"{name}-{len(names) + 1}")
    return tuple(names)


@lru_cache(maxsize=256)
def _items(spec: str) -> tuple[RateLimitItem, ...]:
    return tuple(parse_many(spec))


@lru_cache(maxsize=4096)
def _allowance(bucket: str, spec: str) -> Allowance:
    items = _items(spec)
    names = policy_names(items)
    return Allowance(
        items=items,
        # a workspace's windows beside its other keys: admission counts them in the workspace's step
        keys=tuple(rate_window(item.key_for(bucket), bucket[3:] if bucket.startswith("ws:") else None)
                   for item in items),
        args=tuple(n for item in items for n in (item.amount, item.get_expiry())),
        names=names,
        policy=", ".join(f'"{name}";q={item.amount};w={item.get_expiry()}' for name, item in zip(names, items)),
    )


class RateLimits:
    def __init__(self, store: FrontDoorRequests, default_limit: str, keys: KeyResolver,
                 proxies: TrustedProxies | None = None):
        _items(default_limit)  # a malformed default fails at start, not on the first call
        self.store = store
        self.default_limit = default_limit
        self.keys = keys
        self.proxies = proxies or TrustedProxies(())

    def allowance(self, request: Request) -> Allowance | None:
        """What this call is counted against; None on the exempt routes. No I/O
        beyond the (cached) key lookup."""
        if request.endpoint in EXEMPT_ENDPOINTS:
            return None
        try:
            caller = self.keys.caller(request)
        except Unauthorized:
            return self._checked(f"unknown:{self.proxies.caller(request.environ)}", self.default_limit)
        return self.for_workspace(caller)  # a legacy key's own namespace is its bucket

    def for_workspace(self, caller: Caller) -> Allowance:
        """A workspace caller's allowance: its own limit, else the default."""
        return self._checked(f"ws:{caller.workspace}", caller.rate_limit or self.default_limit)

    def _checked(self, bucket: str, spec: str) -> Allowance:
        try:
            return _allowance(bucket, spec)
        except ValueError:
            log.error("workspace rate limit %r does not parse; using the default", spec)
            return _allowance(bucket, self.default_limit)

    def spend(self, meter: Meter) -> None:
        """Count one call in its own round trip (``rate.lua``), telling
        ``meter`` where its windows stand; ``429 rate_limited`` with
        Retry-After once a window's allowance is spent."""
        try:
            reply = self.store.spend_rate(list(meter.keys), list(meter.args))
        except redis.RedisError:  # the counter store's trouble must not refuse calls
            log.warning("rate-limit counters unreachable; call let through", exc_info=True)
            return
        if reply[0]:
            raise meter.refusal(reply)
        meter.counted(reply[1:])

