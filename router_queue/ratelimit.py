"""Each caller's request rate over every route, polls included.

Built on ``limits`` (the library under Flask-Limiter), called from one
``before_request`` hook: Flask-Limiter's per-request machinery cost as much CPU
as the status read itself, and a status read is the call clients make most.
Counters live in Redis (``RATE_LIMIT_STORAGE_URI``, default ``REDIS_URL``), so
one limit holds across every front-door process. The bucket is the caller's
workspace; its limit is the workspace's own ``rate_limit`` or
``DEFAULT_RATE_LIMIT``. Calls with a key we do not know share one bucket per
client address, which also slows down key guessing.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from functools import lru_cache

from flask import Request
from limits import RateLimitItem, parse_many
from limits.storage import storage_from_string
from limits.strategies import FixedWindowRateLimiter

from .auth import KeyResolver, presented_key
from .errors import RateLimited, Unauthorized

log = logging.getLogger(__name__)

#: Routes no limit applies to (probes must always answer).
EXEMPT_ENDPOINTS = frozenset({"operations.healthz", "operations.readyz", "operations.metrics"})


@lru_cache(maxsize=256)
def _items(spec: str) -> tuple[RateLimitItem, ...]:
    return tuple(parse_many(spec))


class RateLimits:
    def __init__(self, storage_uri: str, default_limit: str, keys: KeyResolver):
        _items(default_limit)  # a malformed default fails at start, not on the first call
        # Bounded socket waits: a Redis that hangs must not hang the caller
        # (the check then lets the call through, and the route answers 503).
        storage = storage_from_string(storage_uri, key_prefix="rq:rate", socket_timeout=0.5,
                                      socket_connect_timeout=0.5)
        self.limiter = FixedWindowRateLimiter(storage)
        self.default_limit = default_limit
        self.keys = keys

    def _bucket_and_limit(self, request: Request) -> tuple[str, str]:
        try:
            caller = self.keys.caller(request)
        except Unauthorized:
            return f"unknown:{request.remote_addr}", self.default_limit
        if caller.legacy:
            key = presented_key(request) or ""
            return "legacy:" + hashlib.sha256(key.encode()).hexdigest()[:32], self.default_limit
        return f"ws:{caller.workspace}", caller.rate_limit or self.default_limit

    def check(self, request: Request) -> None:
        """Count this call; ``429 rate_limited`` with Retry-After once the allowance is spent."""
        if request.endpoint in EXEMPT_ENDPOINTS:
            return
        bucket, spec = self._bucket_and_limit(request)
        try:
            items = _items(spec)
        except ValueError:
            log.error("workspace rate limit %r does not parse; using the default", spec)
            items = _items(self.default_limit)
        for item in items:
            try:
                allowed = self.limiter.hit(item, bucket)
            except Exception:  # the counter store's trouble must not refuse calls
                log.warning("rate-limit storage unreachable; call let through", exc_info=True)
                return
            if not allowed:
                # The window's end is read from a TTL in whole seconds: round up
                # and add one so a client that waits exactly this is let in.
                reset = self.limiter.get_window_stats(item, bucket).reset_time
                wait = min(item.get_expiry(), max(1, math.ceil(reset - time.time()) + 1))
                raise RateLimited(f"request rate {item} is spent; honour Retry-After", retry_after=wait)
