"""The batch routes in the OpenAPI document (``openapi.py`` calls
:func:`batch_paths`): the NDJSON bodies a batch is sent and read back as,
one schema per line, and the ``batch.completed`` webhook event."""

from __future__ import annotations

from typing import Any, Callable

from apispec import APISpec

from . import paths
from .batch_lines import MAX_METADATA_KEY, MAX_METADATA_KEYS, MAX_METADATA_VALUE
from .fallback_models import MAX_FALLBACK_MODELS

NDJSON = "application/x-ndjson"
_STATUS = {"type": "string", "enum": ["IN_QUEUE", "IN_PROGRESS", "COMPLETED"]}
#: One line of a batch call's body.
BATCH_LINE = {
    "type": "object", "required": ["model", "body"], "additionalProperties": False,
    "description": "One line of the NDJSON body: a request, as a submit would send it",
    "properties": {
        "model": {"type": "string", "description": "provider/model"},
        "body": {"type": "object", "description": "the model's native body (its own schema)"},
        "idempotency_key": {"type": "string", "minLength": 1, "maxLength": 255,
                            "description": "default <the batch's Idempotency-Key>:<line>"},
        "priority": {"type": "string", "enum": ["high", "normal", "low"], "default": "low"},
        "webhook_url": {"type": "string", "format": "uri", "description": "as X-Comfy-Webhook-Url on a submit"},
        "fallback_models": {"type": "array", "items": {"type": "string"}, "maxItems": MAX_FALLBACK_MODELS,
                            "description": "as X-Comfy-Fallback-Models on a submit: the models it may run on "
                                           "instead, in order"},
        "metadata": {"type": "object", "maxProperties": MAX_METADATA_KEYS,
                     "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
                     "description": f"shown on the line's status and history; keys 1 to {MAX_METADATA_KEY} "
                                    "characters"},
    },
}
#: One line of the results.
RESULT_LINE = {
    "type": "object", "required": ["line", "request_id", "status", "response_url"],
    "description": "One line of the results' NDJSON, one per input line, in input order",
    "properties": {
        "line": {"type": "integer", "minimum": 1},
        "request_id": {"type": "string", "nullable": True, "description": "null until admitted, and when refused"},
        "status": _STATUS,
        "error_type": {"type": "string"},
        "detail": {"type": "string"},
        "response_url": {"type": "string", "format": "uri", "nullable": True},
    },
}
_URLS = {name: {"type": "string", "format": "uri"} for name in ("status_url", "results_url", "cancel_url")}
_COUNTS = {"type": "object", "properties": {
    **{s: {"type": "integer"} for s in ("IN_QUEUE", "IN_PROGRESS", "COMPLETED")},
    "by_error_type": {"type": "object", "additionalProperties": {"type": "integer"}}}}
HANDLE = {"type": "object", "required": ["batch_id", "status", "counts", *_URLS], "properties": {
    "batch_id": {"type": "string"}, "status": _STATUS, "counts": {"type": "object", "properties": {
        "lines": {"type": "integer"}, "accepted": {"type": "integer"}, "refused": {"type": "integer"}}}, **_URLS}}
BATCH = {"type": "object", "required": ["batch_id", "status", "counts", "credits", *_URLS], "properties": {
    "batch_id": {"type": "string"}, "status": _STATUS, "counts": _COUNTS, "lines": {"type": "integer"},
    "created_at": {"type": "string", "format": "date-time"}, "cancelled": {"type": "boolean"},
    "credits": {"type": "object", "properties": {"held": {"type": "integer"}, "charged": {"type": "integer"}}},
    **_URLS}}
CANCELLED = {"type": "object", "required": ["batch_id", "status", "cancelled", "cancellation_requested", *_URLS],
             "properties": {"batch_id": {"type": "string"},
                            "status": {"type": "string", "enum": ["CANCELLATION_REQUESTED", "ALREADY_COMPLETED"]},
                            "cancelled": {"type": "integer", "description": "its requests cancelled while waiting"},
                            "cancellation_requested": {"type": "integer",
                                                       "description": "its running requests asked to stop"},
                            **_URLS}}
#: The batch.completed event (docs/API.md, "Batches").
BATCH_EVENT = {
    "type": "object", "required": ["type", "batch_id", "counts", "results_url"],
    "description": "POSTed once every line of a batch has ended, to the batch's X-Comfy-Webhook-Url or the "
                   "workspace's default, signed per Standard Webhooks with webhook-id batch_<batch_id>",
    "properties": {"type": {"type": "string", "enum": ["batch.completed"]}, "batch_id": {"type": "string"},
                   "counts": _COUNTS, "results_url": {"type": "string", "format": "uri"}},
}
_BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}


def batch_paths(spec: APISpec, errors: Callable[..., dict[str, Any]]) -> None:
    """The five batch routes (``paths.BATCH_ROUTES``); ``errors`` builds their error answers."""
    tag = ["batches"]
    spec.path(path=paths.BATCH_SUBMIT.openapi(), operations={"post": {
        "summary": "Submit a batch: one request per NDJSON line", "tags": tag,
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"}},
                       {"name": "X-Comfy-Webhook-Url", "in": "header", "required": False,
                        "schema": {"type": "string", "format": "uri"}}],
        "requestBody": {"required": True, "content": {NDJSON: {"schema": BATCH_LINE}}},
        "responses": {"201": {"description": "durable; its lines are admitted after",
                              "content": {"application/json": {"schema": HANDLE}}},
                      **errors(400, 401, 409, 413, 415, 429)},
    }, "get": {
        "summary": "This workspace's batches, newest first", "tags": tag,
        "parameters": [{"name": "cursor", "in": "query", "required": False, "schema": {"type": "string"}},
                       {"name": "limit", "in": "query", "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100}}],
        "responses": {"200": {"description": "one page", "content": {"application/json": {"schema": {
            "type": "object", "properties": {"batches": {"type": "array", "items": {"type": "object"}},
                                             "next_cursor": {"type": "string", "nullable": True}}}}}},
            **errors(400, 401, 429)},
    }})
    spec.path(path=paths.BATCH_STATUS.openapi(), operations={"get": {
        "summary": "A batch's status, counts and credits", "tags": tag, "parameters": [_BATCH_ID],
        "responses": {"200": {"description": "with Retry-After (0 once COMPLETED)",
                              "content": {"application/json": {"schema": BATCH}}}, **errors(401, 404, 429)}}})
    spec.path(path=paths.BATCH_RESULTS.openapi(), operations={"get": {
        "summary": "One NDJSON line per input line, in input order", "tags": tag, "parameters": [_BATCH_ID],
        "responses": {"200": {"description": "streamed", "content": {NDJSON: {"schema": RESULT_LINE}}},
                      **errors(401, 404, 429)}}})
    spec.path(path=paths.BATCH_CANCEL.openapi(), operations={"put": {
        "summary": "Cancel every line not yet finished", "tags": tag, "parameters": [_BATCH_ID],
        "responses": {"202": {"description": "CANCELLATION_REQUESTED",
                              "content": {"application/json": {"schema": CANCELLED}}},
                      "409": {"description": "ALREADY_COMPLETED: every line had ended",
                              "content": {"application/json": {"schema": CANCELLED}}},
                      **errors(401, 404, 429)}}})
