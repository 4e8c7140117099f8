"""GET /v2/usage: a workspace's spend read from its ledger, the credits
charged grouped by model, API key or UTC day. The ledger keeps
LEDGER_RETENTION_SECONDS, so that is how far back it reaches. A call reads at
most :data:`MAX_ENTRIES` entries and spans at most :data:`MAX_RANGE_S`:
past that it answers what it read with ``complete: false`` and
``next_since``, from which the next call goes on (its groups add up)."""

from __future__ import annotations

import datetime
import itertools
import time
from typing import Any

from flask import Blueprint, Response, request
from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

from ..errors import InvalidInput
from . import paths
from .bodies import json_response
from .front import front_door
from .history import rfc3339

usage = Blueprint("usage", __name__)

#: Ledger entries one call reads at most (a page of XRANGE at a time).
MAX_ENTRIES = 20_000
#: The longest span one call may ask for (s): 93 days, a quarter.
MAX_RANGE_S = 93 * 86400
#: The span asked for when since is not given (s).
DEFAULT_RANGE_S = 30 * 86400
GROUPS = ("model", "key", "day")
#: Each grouping's field in a group's object.
GROUP_FIELD = {"model": "model", "key": "key_id", "day": "day"}


class Moment(fields.Field):
    """An RFC 3339 date-time, as Unix seconds."""

    def _deserialize(self, value, attr, data, **kwargs) -> float:
        if not isinstance(value, str):
            raise ValidationError("must be an RFC 3339 date-time")
        try:
            return rfc3339(attr or "time", value)
        except InvalidInput as exc:
            raise ValidationError(exc.detail) from None


class UsageQuery(Schema):
    class Meta:
        unknown = RAISE

    since = Moment(metadata={"description": "RFC 3339; charges at or after (default: 30 days before until)"})
    until = Moment(metadata={"description": "RFC 3339; charges before (default: now)"})
    group_by = fields.String(load_default="day", validate=validate.OneOf(GROUPS))

    @validates_schema
    def _span(self, data: dict[str, Any], **kwargs) -> None:
        since, until = data.get("since"), data.get("until")
        if since is not None and until is not None:
            if until <= since:
                raise ValidationError("until must be later than since", "until")
            if until - since > MAX_RANGE_S:
                raise ValidationError(f"since and until may be at most {MAX_RANGE_S // 86400} days apart", "until")


def parse_query(args) -> dict[str, Any]:
    """The query string, checked; ``400 invalid_input`` naming the first fault."""
    for name in args:
        if len(args.getlist(name)) > 1:
            raise InvalidInput(f"{name[:40]} may be given once")
    try:
        query = UsageQuery().load(dict(args.items()))
    except ValidationError as exc:
        name, messages = next(iter(sorted(exc.normalized_messages().items())))
        message = messages[0] if isinstance(messages, list) else str(messages)
        raise InvalidInput(f"{name[:40]}: {message}") from None
    until = query.get("until", time.time())
    query["until"] = until
    query["since"] = query.get("since", until - DEFAULT_RANGE_S)
    return query


def _iso(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def _ms(entry) -> int:
    return int(entry.id.split("-")[0])


def usage_body(accounts, workspace: str, since: float, until: float, group_by: str) -> dict[str, Any]:
    """The charges from ``since`` to before ``until``, grouped; at most MAX_ENTRIES entries read."""
    groups: dict[str, dict[str, Any]] = {}
    # the ledger's bound is inclusive to the ms: an entry at until's own ms is the next call's
    read = list(itertools.islice(accounts.ledger_entries(workspace, since, until - 0.001), MAX_ENTRIES + 1))
    next_ms = None
    if len(read) > MAX_ENTRIES:
        # cut at a whole ms (an entry's id is its ms): the next call reads that ms from its start
        next_ms = _ms(read[MAX_ENTRIES])
        whole = [entry for entry in read[:MAX_ENTRIES] if _ms(entry) < next_ms]
        read = whole or read[:MAX_ENTRIES]
        next_ms = next_ms if whole else _ms(read[-1]) + 1
    for entry in read:
        if entry.type != "charge":
            continue
        if group_by == "day":
            name = datetime.datetime.fromtimestamp(entry.at, datetime.timezone.utc).date().isoformat()
        else:
            name = (entry.model if group_by == "model" else entry.key) or "unknown"
        group = groups.setdefault(name, {GROUP_FIELD[group_by]: name, "credits": 0, "requests": 0})
        group["credits"] += entry.amount
        group["requests"] += 1
    complete = next_ms is None
    listed = [groups[name] for name in sorted(groups)]
    return {
        "since": _iso(since), "until": _iso(until), "group_by": group_by, "groups": listed,
        "total": {"credits": sum(g["credits"] for g in listed), "requests": sum(g["requests"] for g in listed)},
        "complete": complete,
        "next_since": None if next_ms is None else _iso(next_ms / 1000),
    }


@paths.USAGE.view(usage)
def workspace_usage() -> Response:
    front = front_door()
    workspace = front.keys.workspace(request)
    query = parse_query(request.args)
    return json_response(usage_body(front.services.accounts, workspace, query["since"], query["until"],
                                    query["group_by"]))
