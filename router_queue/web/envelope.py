"""What every call goes through, on both paths: the lane's and Flask's.

One :class:`Envelope` per app, in these steps (:data:`STEPS`): ``open`` (the
rate allowance, carried into the route's script or spent now: before any name
lookup, for a submit that names a webhook), the route and ``refusal`` (any
exception mapped to the error tree), ``settle`` (a carried allowance the route
did not spend is spent now; a spent window answers 429 in the route's place)
and ``headers`` (the call's id, ``headers.EVERY_ANSWER`` and, once counted, its
RateLimit fields). The app's hooks and the lane call these and nothing else of
their own, so a step added here holds on both paths. In full:
``docs/ARCHITECTURE.md``, "The front door's parts".
"""

from __future__ import annotations

import logging
import os

from flask import g

from ..errors import RateLimited, RouterError
from ..store.connect import UNREACHABLE, NotAdmitted
from ..store.ids import uuid_text
from ..webhooks.event import URL_HEADER
from . import paths
from .headers import EVERY_ANSWER
from .ratelimit import Allowance, Meter, RateLimits
from .refusals import IDEMPOTENCY_HEADER, as_router_error, key_in_doubt

log = logging.getLogger(__name__)

#: The app's ``extensions`` entry that holds the :class:`Envelope`.
ENVELOPE = "router_queue.envelope"
#: The envelope's steps, in the order every call takes them.
STEPS = ("open", "refusal", "settle", "headers")
#: Endpoints whose routes hand the allowance to their own script.
CARRIED_ENDPOINTS = paths.endpoints(paths.Rate.CARRIED)
#: Of those, the routes that look up the host of an ``X-Comfy-Webhook-Url``
#: (up to ``WEBHOOK_RESOLVE_TIMEOUT_SECONDS``), or put a large body to the
#: object store, before their script runs: such a call spends its allowance
#: as it opens, so a caller past its rate is refused before either.
LOOKUP_ENDPOINTS = frozenset({paths.SUBMIT.endpoint, paths.RUN.endpoint})

Header = tuple[str, str]
_EVERY_ANSWER: tuple[Header, ...] = tuple(EVERY_ANSWER.items())


class Call:
    """One call's state between the envelope's steps."""

    __slots__ = ("meter", "carried", "id")

    def __init__(self, meter: Meter | None, carried: bool = False):
        #: The call's count in its caller's windows; None on the exempt routes.
        self.meter = meter
        #: Whether the meter is carried and not yet handed to the route's script.
        self.carried = carried and meter is not None
        #: The request id the route admitted, for ``X-Comfy-Request-Id``.
        self.id: str | None = None

    def take(self) -> Meter | None:
        """The carried meter, for the route's script: taken once, so ``settle``
        does not count it again."""
        if not self.carried:
            return None
        self.carried = False
        return self.meter


class Envelope:
    def __init__(self, rate_limits: RateLimits, max_body: int | None, stashed_over: int | None = None):
        self.rate_limits = rate_limits
        self.max_body = max_body
        #: Bodies over this many bytes go to the object store before the
        #: script runs (``web/stashed.py``); None: every body stays in Redis.
        self.stashed_over = stashed_over

    def open(self, endpoint: str | None, allowance: Allowance | None, headers=None) -> Call:
        """The call, its allowance carried for ``endpoint``'s script, else
        spent now (``429 rate_limited`` once a window is spent). ``headers``:
        the call's, which say whether it costs something before its script
        runs (:data:`LOOKUP_ENDPOINTS`): a webhook's name lookup, or a body
        the object store is sent. Past its rate such a call costs nothing."""
        meter = Meter(allowance) if allowance is not None else None
        if endpoint in CARRIED_ENDPOINTS and not (
                endpoint in LOOKUP_ENDPOINTS and headers is not None and self._costs_before_script(headers)):
            return Call(meter, carried=True)
        if meter is not None:
            self.rate_limits.spend(meter)
        return Call(meter)

    def _costs_before_script(self, headers) -> bool:
        if URL_HEADER in headers:
            return True
        length = headers.get("Content-Length", "")
        return self.stashed_over is not None and length.isdigit() and int(length) > self.stashed_over

    def refusal(self, exc: BaseException, path: str, endpoint: str | None = None, headers=None) -> RouterError:
        """``exc`` as its member of the error tree; for a submit with an
        Idempotency-Key (``endpoint``, ``headers``: the call's) that the store
        did not answer, the key's in-doubt 409 in place of a 503: an earlier
        send of the key may have been admitted, and the resend settles it."""
        if (isinstance(exc, UNREACHABLE) and not isinstance(exc, NotAdmitted) and endpoint in LOOKUP_ENDPOINTS
                and headers is not None and IDEMPOTENCY_HEADER in headers):
            log.warning("a keyed submit met a store fault (%s): answered in doubt", exc)
            return key_in_doubt()
        return as_router_error(exc, path=path, max_body=self.max_body)

    def settle(self, call: Call | None) -> RateLimited | None:
        """Spend a carried allowance the route did not take; the 429 to answer
        instead when its window is spent."""
        meter = call.take() if call is not None else None
        if meter is not None:
            try:
                self.rate_limits.spend(meter)
            except RateLimited as exc:
                return exc
        return None

    @staticmethod
    def headers(call: Call | None) -> list[Header]:
        """What every answer carries: the call's id, then ``EVERY_ANSWER``;
        a call counted in its windows, their RateLimit fields (a 429 carries
        the spent window's own: ``ratelimit.Allowance.refusal``)."""
        if call is None:
            return [("X-Comfy-Request-Id", fresh_call_id()), *_EVERY_ANSWER]
        fields = call.meter.fields() if call.meter is not None else []
        return [("X-Comfy-Request-Id", call.id or fresh_call_id()), *_EVERY_ANSWER, *fields]


def fresh_call_id() -> str:
    """A random (version 4) UUID's text, for a call that admitted no request:
    ``str(uuid.uuid4())`` without the ``UUID`` object (a twentieth of a status read)."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # RFC 4122 variant
    return uuid_text(raw)


def current_call() -> Call:
    """The Flask path's call, as the app's ``open`` hook left it on ``g``."""
    return g.call


def carried_allowance() -> Meter | None:
    """For a route in :data:`CARRIED_ENDPOINTS` on the Flask path: the
    call's meter to hand to its script, taken once."""
    call = g.get("call")
    return call.take() if call is not None else None
