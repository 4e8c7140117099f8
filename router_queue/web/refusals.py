"""What the front door answers for an exception: the member of the error tree
(``errors.py``) it becomes. One mapping, used by the Flask app's error
handlers and by the lane, so both answer every fault alike."""

from __future__ import annotations

import logging
import re

from werkzeug.exceptions import HTTPException

from ..errors import (
    ConcurrencyLimitExceeded,
    InternalError,
    InvalidInput,
    MethodNotAllowed,
    ModelNotFound,
    PayloadTooLarge,
    RequestNotFound,
    RouterError,
    ServiceUnavailable,
)
from ..store.connect import FULL, UNREACHABLE
from . import paths

log = logging.getLogger(__name__)

#: Paths that address a request; a miss under one is request_not_found.
_REQUEST_PATH = re.compile(paths.prefix_pattern(paths.REQUESTS) + "/.")
#: Seconds a caller is told to wait when the store is full: room comes back
#: as results expire or an operator adds memory, not within a second.
STORE_FULL_RETRY_S = 5
#: Answered for every id we cannot show this caller, whatever the reason, so
#: another workspace's ids are indistinguishable from ids that never existed.
NOT_FOUND = "no such request for this caller and model"


#: The header that makes submits idempotent.
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: Seconds a caller whose Idempotency-Key is in doubt waits before sending it again.
IN_DOUBT_RETRY_AFTER_S = 1


def key_in_doubt() -> ConcurrencyLimitExceeded:
    """A submit with an Idempotency-Key whose admission is in doubt: the
    contract's own answer for a key in doubt, which a resend settles."""
    return ConcurrencyLimitExceeded(
        "the request store did not answer in time, so whether this Idempotency-Key's request was admitted is "
        "not known yet; send it again with the same Idempotency-Key: that returns its handle if it was "
        "admitted, and admits it if it was not", retry_after=IN_DOUBT_RETRY_AFTER_S)


def as_router_error(exc: BaseException, *, path: str, max_body: int | None) -> RouterError:
    """Ours as raised; werkzeug's refusals and a Redis outage as their
    buckets (unreachable or full: 503); anything else is a bug, logged, and answered ``internal_error``."""
    if isinstance(exc, RouterError):
        return exc
    if isinstance(exc, HTTPException):
        return _http(exc, path, max_body)
    if isinstance(exc, UNREACHABLE):
        log.warning("redis unreachable: %s", exc)
        return ServiceUnavailable("the request store is briefly unreachable; retry shortly", retry_after=1)
    if isinstance(exc, FULL):
        log.error("redis full, writes refused: %s", exc)
        return ServiceUnavailable("the request store is full; retry later", retry_after=STORE_FULL_RETRY_S)
    log.error("unhandled error", exc_info=exc)
    return InternalError("an internal error occurred; quote X-Comfy-Request-Id to support")


def _http(exc: HTTPException, path: str, max_body: int | None) -> RouterError:
    if exc.code == 413:
        return PayloadTooLarge(f"the body is larger than {max_body} bytes")
    if exc.code == 404:
        if _REQUEST_PATH.match(path):  # e.g. an id holding an encoded slash
            return RequestNotFound(NOT_FOUND)
        return ModelNotFound("no such route; models live under /v2/models/{provider}/{model}")
    if exc.code == 405:
        return MethodNotAllowed(f"{exc.description}")
    error = InvalidInput(exc.description or exc.name)
    error.status = exc.code or 400
    return error
