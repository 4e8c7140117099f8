"""Each caller's request rate over every route, polls included (Flask-Limiter).

Counters live in Redis (``RATE_LIMIT_STORAGE_URI``, default ``REDIS_URL``), so
one limit holds across every front-door process. The bucket is the caller's
workspace; its limit is the workspace's own ``rate_limit`` or
``DEFAULT_RATE_LIMIT``. Calls with a key we do not know share one bucket per
client address, which also slows down key guessing.
"""

from __future__ import annotations

import hashlib
import math
import time

from flask import Flask, Response, g, request
from flask_limiter import Limiter, RequestLimit

from .auth import Caller, KeyResolver, presented_key
from .errors import RateLimited, Unauthorized
from .settings import Settings
from .views import json_response


def init_limiter(app: Flask, settings: Settings, keys: KeyResolver) -> Limiter:
    def caller() -> Caller | None:
        """The caller, resolved once per request whichever callback asks first."""
        if "caller" not in g:
            try:
                g.caller = keys.caller(request)
            except Unauthorized:
                g.caller = None
        return g.caller

    def bucket() -> str:
        who = caller()
        if who is None:
            return f"unknown:{request.remote_addr}"
        if who.legacy:
            return "legacy:" + hashlib.sha256((presented_key(request) or "").encode()).hexdigest()[:32]
        return f"ws:{who.workspace}"

    def limit() -> str:
        who = caller()
        return (who.rate_limit if who is not None else None) or settings.default_rate_limit

    def breached(limit: RequestLimit) -> Response:
        error = RateLimited(f"request rate {limit.limit} is spent; honour Retry-After",
                            retry_after=min(limit.limit.get_expiry(), max(1, math.ceil(limit.reset_at - time.time()))))
        return json_response(error.body(), error.status, error.headers())

    return Limiter(
        key_func=bucket,
        app=app,
        application_limits=[limit],
        application_limits_exempt_when=lambda: request.endpoint in ("healthz",),
        storage_uri=settings.rate_limit_storage_uri or settings.redis_url,
        strategy="fixed-window",
        key_prefix="rq:rate",
        # Redis trouble must not turn into a rate-limit answer: the request goes
        # on and meets the same trouble as a clear 503 in its own route.
        swallow_errors=True,
        headers_enabled=False,
        on_breach=breached,
    )
