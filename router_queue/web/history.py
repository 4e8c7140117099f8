"""A workspace's request history: ``GET /v2/requests`` and the same list for
one model, ``GET /v2/models/{provider}/{model}/requests``.

Newest first, within the retention window, a page at a time behind an
opaque cursor. The lists come from the indexes admit.lua writes with every
record (``keys.history``), so nothing admitted is missing, and a page costs
the same at any depth (``RequestStore.history``). Every filter is checked
before anything is read: a bad one is ``400 invalid_input``.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flask import Blueprint, Response, request
from werkzeug.datastructures import MultiDict

from ..catalog import Catalog
from ..errors import InvalidInput
from ..states import ORDER, RESULT_STATUS
from . import paths
from .bodies import json_response, status_body
from .envelope import carried_allowance
from .front import FrontDoor, front_door
from .routes import base_url, model_entry

history = Blueprint("history", __name__)

#: Entries per page when the caller names none, and the most a page holds.
DEFAULT_LIMIT, MAX_LIMIT = 20, 100
#: The filters each list takes (the model's own list has its model in the path).
WORKSPACE_FILTERS = frozenset({"model", "status", "error_type", "since", "until", "limit", "cursor"})
MODEL_FILTERS = WORKSPACE_FILTERS - {"model"}
#: RFC 3339 date-time: a full date, a time with seconds, a zone (Z or ±hh:mm).
_RFC3339 = re.compile(r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")
_LIMIT = re.compile(r"\d{1,3}")
#: The cursor's version, so its layout can change without misreading old ones.
_CURSOR_VERSION = "h2"
#: A stream id, "{ms}-{seq}" (lib/history.lua, history_add).
_STREAM_ID = re.compile(r"\d{1,15}-\d{1,19}")


@dataclass(frozen=True)
class Filters:
    """What a list call asked for, checked."""

    model: str | None
    status: str
    error_type: str
    since: float | None
    until: float | None
    limit: int
    after: str | None


def encode_cursor(after: str) -> str:
    """Opaque to the caller: the last history entry a page examined (its stream id)."""
    return base64.urlsafe_b64encode(f"{_CURSOR_VERSION}|{after}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    bad = InvalidInput("cursor is not one this server handed out; start again without it")
    try:
        version, after = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_",
                                          validate=True).decode().split("|")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise bad from None
    if version != _CURSOR_VERSION or not _STREAM_ID.fullmatch(after):
        raise bad
    return after


def rfc3339(name: str, raw: str) -> float:
    """An RFC 3339 date-time (``2026-12-02T04:00:00Z``, an offset, a fraction) as Unix seconds."""
    match = _RFC3339.fullmatch(raw)
    if match is None:
        raise InvalidInput(f"{name} must be an RFC 3339 date-time such as 2026-12-02T04:00:00Z, "
                           f"got {raw[:60]!r}")
    date, clock, fraction, zone = match.groups()
    zone = "+00:00" if zone in ("Z", "z") else zone
    try:
        return datetime.fromisoformat(f"{date}T{clock}{(fraction or '')[:7]}{zone}").timestamp()
    except (ValueError, OverflowError) as exc:
        raise InvalidInput(f"{name} is not a valid date-time: {exc}") from None


def parse_filters(args: MultiDict, allowed: frozenset[str], catalog: Catalog) -> Filters:
    """The query string as :class:`Filters`; ``400 invalid_input`` naming the first bad one."""
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise InvalidInput(f"unknown query parameter {unknown[0][:40]!r}; this list takes "
                           f"{', '.join(sorted(allowed))}")
    for name in args:
        if len(args.getlist(name)) > 1:
            raise InvalidInput(f"{name} may be given once")
    model = args.get("model")
    if model is not None and catalog.by_id(model) is None:
        raise InvalidInput(f"model must be a catalog model id such as bfl/flux-2-pro, got {model[:60]!r}")
    status = args.get("status", "")
    if "status" in args and status not in ORDER:
        raise InvalidInput(f"status must be one of {', '.join(ORDER)}, got {status[:40]!r}")
    error_type = args.get("error_type", "")
    if "error_type" in args and error_type not in RESULT_STATUS:
        raise InvalidInput(f"error_type must be one of {', '.join(sorted(RESULT_STATUS))}, got {error_type[:40]!r}")
    since = rfc3339("since", args["since"]) if "since" in args else None
    until = rfc3339("until", args["until"]) if "until" in args else None
    if since is not None and until is not None and until <= since:
        raise InvalidInput("until must be later than since")
    raw_limit = args.get("limit")
    limit = DEFAULT_LIMIT
    if raw_limit is not None:
        if not _LIMIT.fullmatch(raw_limit) or not 1 <= int(raw_limit) <= MAX_LIMIT:
            raise InvalidInput(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {raw_limit[:20]!r}")
        limit = int(raw_limit)
    cursor = args.get("cursor")
    return Filters(model, status, error_type, since, until, limit, decode_cursor(cursor) if cursor else None)


def _page(front: FrontDoor, workspace: str, filters: Filters) -> Response:
    """One page: each entry is the request's status body, with its model."""
    settings = front.services.settings
    base = base_url(front, request)
    oldest = time.time() - settings.result_retention_s  # the history's window
    page = front.services.store.history(
        workspace, model=filters.model, since=max(oldest, filters.since if filters.since is not None else oldest),
        until=filters.until, after=filters.after, limit=filters.limit, status=filters.status,
        error_type=filters.error_type, rate=carried_allowance(),
    )
    entries: list[dict[str, Any]] = []
    for record, position in page.entries:
        entry = status_body(record, position, base, settings.result_retention_s)
        entry["model"] = record.model
        entries.append(entry)
    cursor = encode_cursor(page.next_after) if page.next_after is not None else None
    return json_response({"requests": entries, "next_cursor": cursor})


@paths.HISTORY.view(history)
def requests() -> Response:
    front = front_door()
    workspace = front.keys.workspace(request)
    return _page(front, workspace, parse_filters(request.args, WORKSPACE_FILTERS, front.services.catalog))


@paths.MODEL_HISTORY.view(history)
def model_requests(provider: str, model: str) -> Response:
    front = front_door()
    workspace = front.keys.workspace(request)
    entry = model_entry(provider, model, front.services.catalog)
    filters = parse_filters(request.args, MODEL_FILTERS, front.services.catalog)
    return _page(front, workspace, Filters(entry.id, filters.status, filters.error_type, filters.since,
                                           filters.until, filters.limit, filters.after))
