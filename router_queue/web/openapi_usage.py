"""GET /v2/usage in the OpenAPI document (``web/usage.py``), and the
``budget.threshold_crossed`` event a workspace's default webhook receives
(``webhooks/budget_alerts.py``)."""

from __future__ import annotations

from typing import Any, Callable

from apispec import APISpec

from . import paths
from .usage import DEFAULT_RANGE_S, GROUP_FIELD, GROUPS, MAX_ENTRIES, MAX_RANGE_S

_GROUP = {"type": "object", "required": ["credits", "requests"], "properties": {
    "model": {"type": "string", "description": "group_by=model (\"unknown\": charged before models were kept)"},
    "key_id": {"type": "string", "description": "group_by=key: the API key's id (\"unknown\" as for model)"},
    "day": {"type": "string", "format": "date", "description": "group_by=day: the UTC day of the charge"},
    "credits": {"type": "integer", "minimum": 0, "description": "credits charged"},
    "requests": {"type": "integer", "minimum": 0, "description": "requests charged"}}}
_USAGE = {"type": "object", "additionalProperties": False,
          "required": ["since", "until", "group_by", "groups", "total", "complete", "next_since"],
          "properties": {
              "since": {"type": "string", "format": "date-time"},
              "until": {"type": "string", "format": "date-time"},
              "group_by": {"type": "string", "enum": list(GROUPS)},
              "groups": {"type": "array", "items": _GROUP, "description": "in the order of their name"},
              "total": {"type": "object", "required": ["credits", "requests"], "properties": {
                  "credits": {"type": "integer"}, "requests": {"type": "integer"}}},
              "complete": {"type": "boolean", "description": f"false: the call read its {MAX_ENTRIES} entries "
                                                             "before until; go on from next_since"},
              "next_since": {"type": "string", "format": "date-time", "nullable": True}}}
assert set(GROUP_FIELD.values()) <= set(_GROUP["properties"])


def usage_paths(spec: APISpec, errors: Callable[..., dict[str, Any]]) -> None:
    spec.path(path=paths.USAGE.openapi(), operations={"get": {
        "summary": "This workspace's spend: credits charged, grouped", "tags": ["usage"],
        "description": "Read from the ledger, which keeps LEDGER_RETENTION_SECONDS: that is how far back it "
                       f"reaches. since and until at most {MAX_RANGE_S // 86400} days apart (since defaults to "
                       f"{DEFAULT_RANGE_S // 86400} days before until, until to now); a call reads at most "
                       f"{MAX_ENTRIES} ledger entries and says so (complete: false, next_since).",
        "parameters": [
            {"name": "since", "in": "query", "required": False, "description": "RFC 3339; charged at or after",
             "schema": {"type": "string", "format": "date-time"}},
            {"name": "until", "in": "query", "required": False, "description": "RFC 3339; charged before",
             "schema": {"type": "string", "format": "date-time"}},
            {"name": "group_by", "in": "query", "required": False,
             "schema": {"type": "string", "enum": list(GROUPS), "default": "day"}},
        ],
        "responses": {"200": {"description": "the spend", "content": {"application/json": {"schema": _USAGE}}},
                      **errors(400, 401, 403, 429, 503)},
    }})


#: The event a workspace's default webhook receives when a budget threshold is crossed.
BUDGET_EVENT = {
    "type": "object",
    "description": "POSTed to the workspace's default webhook once per threshold per period (webhook-id "
                   "budget_<workspace>_<period>_<period_start>_<threshold>, with _<key id> after the workspace "
                   "for a key's budget), signed as a request's events; tried once per sweep, 10 times at most. "
                   "Without a default webhook the crossing is written to the audit log (router-queue key audit).",
    "required": ["type", "workspace", "period", "period_start", "budget", "threshold", "spent"],
    "properties": {
        "type": {"type": "string", "enum": ["budget.threshold_crossed"]},
        "workspace": {"type": "string"},
        "key_id": {"type": "string", "description": "a key's budget only"},
        "period": {"type": "string", "enum": ["day", "week", "month"]},
        "period_start": {"type": "string", "format": "date", "description": "UTC; a week starts on Monday"},
        "budget": {"type": "integer", "description": "credits"},
        "threshold": {"type": "integer", "description": "per cent of the budget"},
        "spent": {"type": "integer", "description": "credits held and charged in the period once crossed"},
    },
}
