"""OpenAPI 3 documents, generated with apispec from the very marshmallow schemas
the routes validate with: one per model (``/v2/models/{id}/openapi.json``) and
one for the whole API (``/v2/openapi.json``), with concrete paths per catalog
model so a client (or schemathesis) knows each model's own body.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any, Callable

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from apispec.ext.marshmallow.common import make_schema_key, resolve_schema_instance
from marshmallow import Schema, fields

from ..catalog import Catalog, ModelEntry
from ..requests.record import STATUS_LISTED, Field
from ..requests.values import PRIORITIES
from ..states import ORDER, RESULT_STATUS
from . import paths
from .bulk import openapi_paths as bulk_openapi_paths
from .fallback_models import FALLBACK_HEADER, MAX_FALLBACK_MODELS
from .openapi_batches import BATCH_EVENT, batch_paths
from .openapi_usage import BUDGET_EVENT, usage_paths

OPENAPI_VERSION = "3.0.3"
#: X-Comfy-Start-Deadline and X-Comfy-Deadline: seconds, a plain decimal number (admission.py).
DEADLINE_PATTERN = r"^[0-9]{1,9}(\.[0-9]{1,6})?$"
API_VERSION = "2"

# -- response bodies (documentation; the routes build them in bodies.py) --------


class ErrorSchema(Schema):
    error_type = fields.String(required=True, metadata={"description": "the bucket, also on X-Comfy-Error-Type"})
    detail = fields.Raw(required=True, metadata={
        "description": "a sentence, or for 422 the per-field array of {loc, msg, type}",
        "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
    })


class GoneSchema(Schema):
    detail = fields.String(required=True)


class HandleSchema(Schema):
    request_id = fields.String(required=True)
    status = fields.String(required=True, metadata={"enum": ["IN_QUEUE", "IN_PROGRESS", "COMPLETED"]})
    queue_position = fields.Integer(metadata={
        "minimum": 0,
        "description": "How many requests start before this one if nothing else arrives: the provider's "
                       "schedule shares its slots between workspaces by weight, so it can grow when another "
                       "workspace starts submitting, or when a higher-priority request of the same workspace "
                       "arrives. 0 at the front and while running."})
    status_url = fields.String(required=True)
    response_url = fields.String(required=True)
    cancel_url = fields.String(required=True)


class CostSchema(Schema):
    credits = fields.Integer(required=True, metadata={"minimum": 0, "description": (
        "the price held at admission, which is the price of the model that ran (a fallback model costs the same)")})
    state = fields.String(required=True, metadata={
        "enum": ["held", "charged", "released"],
        "description": "held while pending, charged once succeeded (or a failure the provider bills), released "
                       "when not billed; always as the workspace's ledger has it"})


#: The marshmallow field of each JSON type a record field's codec shows.
_JSON_FIELDS: dict[str, Callable[..., fields.Field]] = {
    "string": fields.String, "number": fields.Float, "integer": fields.Integer, "boolean": fields.Boolean,
    "object": fields.Dict, "array": lambda **kw: fields.List(fields.Dict(), **kw)}


def _listed(field: Field) -> fields.Field:
    """A field the status body lists (``requests/record.py``), as its codec shows it."""
    metadata = {"format": field.codec.json_format} if field.codec.json_format else {}
    return _JSON_FIELDS[field.codec.json_type](metadata={**metadata, "description": field.doc})


class StatusSchema(HandleSchema):
    created_at = fields.String(required=True, metadata={"format": "date-time"})
    started_at = fields.String(metadata={"format": "date-time"})
    completed_at = fields.String(metadata={"format": "date-time"})
    expires_at = fields.String(metadata={"format": "date-time", "description": "when the result is dropped"})
    progress = fields.Float(metadata={
        "minimum": 0, "maximum": 1,
        "description": "How far the generation is, when the provider reports it (BFL does); present from its "
                       "first report, never decreasing, 1 once the request succeeded."})
    error_type = fields.String(metadata={"description": "present only when the request did not succeed"})
    detail = fields.String()

    class Meta:
        #: After those above, in this order: the fields record.py lists on status, then the cost.
        include = {**{f.name: _listed(f) for f in STATUS_LISTED}, "cost": fields.Nested(CostSchema, required=True)}


class HistoryEntrySchema(StatusSchema):
    model = fields.String(required=True, metadata={"description": "the model id, provider/model"})


class HistoryPageSchema(Schema):
    requests = fields.List(fields.Nested(HistoryEntrySchema), required=True, metadata={
        "description": "newest first; may hold fewer than limit (even none) while next_cursor is not null"})
    next_cursor = fields.String(required=True, allow_none=True, metadata={
        "description": "pass as cursor for the next page; null at the end"})


class CostQuoteSchema(Schema):
    model = fields.String(required=True)
    credits = fields.Integer(required=True, metadata={
        "minimum": 0, "description": "what a submit of this model would hold now"})


class CancelSchema(Schema):
    request_id = fields.String(required=True)
    status = fields.String(required=True, metadata={"enum": ["CANCELLATION_REQUESTED", "ALREADY_COMPLETED"]})
    status_url = fields.String()
    response_url = fields.String()
    cancel_url = fields.String()
    detail = fields.String()


class CatalogModelSchema(Schema):
    id = fields.String(required=True)
    provider = fields.String(required=True)
    model = fields.String(required=True)
    billing = fields.Dict(required=True, metadata={"description": "facts such as charges_on_policy_rejection"})


class CatalogPageSchema(Schema):
    data = fields.List(fields.Nested(CatalogModelSchema), required=True)
    has_more = fields.Boolean(required=True)
    next_cursor = fields.String(required=True, allow_none=True)
    limit = fields.Integer(required=True)


def _spec(title: str, description: str) -> APISpec:
    spec = APISpec(title=title, version=API_VERSION, openapi_version=OPENAPI_VERSION,
                   plugins=[MarshmallowPlugin()], info={"description": description})
    spec.components.security_scheme("apiKey", {"type": "apiKey", "in": "header", "name": "X-API-Key"})
    spec.components.security_scheme("bearer", {"type": "http", "scheme": "bearer"})
    spec.components.header("X-Comfy-Request-Id", {"schema": {"type": "string"}, "description": "this call's id"})
    spec.components.header("X-Comfy-Error-Type", {"schema": {"type": "string"}, "description": "the bucket"})
    spec.components.header("Retry-After", {"schema": {"type": "integer", "minimum": 0},
                                           "description": "seconds before a new call is worth it "
                                                          "(0 on a finished request's status read)"})
    spec.components.header("Idempotent-Replayed", {"schema": {"type": "string", "enum": ["true"]}})
    spec.components.header("RateLimit-Policy", {"schema": {"type": "string"}, "description": (
        'the caller\'s rate windows (draft-ietf-httpapi-ratelimit-headers-11), each named for its length with '
        'its quota and its length in seconds: "second";q=50;w=1, "hour";q=100000;w=3600')})
    spec.components.header("RateLimit", {"schema": {"type": "string"}, "description": (
        'what is left of each window once this call was counted, and the seconds until it starts again: '
        '"second";r=49;t=1; on 429 rate_limited, the window that refused alone, r=0 and t its Retry-After')})
    spec.components.header("X-Comfy-Cost-Credits", {"schema": {"type": "string", "pattern": "^[0-9]+$"},
                                                    "required": True, "description": "the request's cost.credits"})
    spec.components.header("X-Comfy-Cost-State", {"schema": {"type": "string",
                                                            "enum": ["held", "charged", "released"]},
                                                  "required": True, "description": "the request's cost.state"})
    spec.components.schema("Error", schema=ErrorSchema)
    return spec


def _error(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    headers = {"X-Comfy-Request-Id": "X-Comfy-Request-Id", "X-Comfy-Error-Type": "X-Comfy-Error-Type"}
    if retry_after:
        headers["Retry-After"] = "Retry-After"
    return {"description": description, "headers": headers,
            "content": {"application/json": {"schema": "Error"}}}


def _errors(*codes: int) -> dict[str, Any]:
    known = {
        400: _error("invalid_input: not JSON, not an object, a bad header, a webhook named while the workspace "
                    "has no signing secret; content_policy_violation on a result"),
        401: _error("unauthorized: no key, or an unknown, revoked or rotated-out key"),
        402: _error("insufficient_credits or budget_exceeded (a workspace's or key's budget this period): "
                    "nothing queued or charged"),
        403: _error("not_enabled: queued delivery is off for this caller or model"),
        404: _error("model_not_found, request_not_found or batch_not_found"),
        405: _error("invalid_input: method not allowed"),
        409: _error("concurrency_limit_exceeded, invalid_input (key held by another request; a retry of a "
                    "request that has not failed), retry_limit_reached (a retry past its chain's cap), cancelled",
                    retry_after=False),
        413: _error("invalid_input: body over the size limit (a batch: over MAX_BATCH_LINES or MAX_BATCH_BYTES)"),
        415: _error("invalid_input: a batch not sent as application/x-ndjson"),
        422: _error("invalid_input: the model's schema rejected the input; detail is per field"),
        429: _error("queue_backlog_full, rate_limited, queued_bytes_full, stored_bytes_full, "
                    "pending_webhooks_full or held_calls_full (the workspace's quotas)", retry_after=True),
        500: _error("internal_error"),
        502: _error("provider_error"),
        503: _error("service_unavailable: a dependency is briefly down", retry_after=True),
        504: _error("provider_timeout, queue_timeout, deadline_exceeded (sync route), or outcome_unknown (a "
                    "submit without an Idempotency-Key whose admission the store did not confirm in time)"),
    }
    return {str(code): known[code] for code in codes}


#: A collect's conditional and partial requests (web/collect.py).
_RANGE_PARAMETERS = [
    {"name": "Range", "in": "header", "required": False, "schema": {"type": "string", "pattern": r"^bytes=.*$"},
     "description": "One range of bytes (bytes=START-END, START-, -SUFFIX): 206 with that part"},
    {"name": "If-Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "An ETag: the Range holds only while the output still has it"},
    {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "ETags already held: 304 when the output's is among them"},
]
#: The headers every collected output carries.
_COLLECT_HEADERS = {
    "ETag": {"schema": {"type": "string", "pattern": '^"sha256:[0-9a-f]{64}"$'},
             "description": "the output's sha256"},
    "Content-Length": {"schema": {"type": "integer", "minimum": 0}},
    "Accept-Ranges": {"schema": {"type": "string", "enum": ["bytes"]}},
}
#: The /link route's answer (web/collect.py, link).
_LINK_SCHEMA = {"type": "object", "additionalProperties": False,
                "required": ["url", "expires_at", "size", "content_type", "sha256"],
                "properties": {
                    "url": {"type": "string", "format": "uri",
                            "description": "a signed object-store URL, or the response_url (needs the key)"},
                    "expires_at": {"type": "string", "format": "date-time",
                                   "description": "when the URL stops answering"},
                    "size": {"type": "integer", "minimum": 0, "description": "bytes"},
                    "content_type": {"type": "string"},
                    "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}}

#: The result's headers naming its cost (bodies.cost_headers).
COST_HEADERS = {"X-Comfy-Cost-Credits": "X-Comfy-Cost-Credits", "X-Comfy-Cost-State": "X-Comfy-Cost-State"}


def _history_parameters(*, with_model: list[str] | None) -> list[dict[str, Any]]:
    """The history's filters (web/history.py); ``model`` only on the workspace's list."""
    params = [
        {"name": "status", "in": "query", "required": False,
         "schema": {"type": "string", "enum": list(ORDER)}},
        {"name": "error_type", "in": "query", "required": False,
         "schema": {"type": "string", "enum": sorted(RESULT_STATUS)}},
        {"name": "since", "in": "query", "required": False, "description": "RFC 3339; admitted at or after",
         "schema": {"type": "string", "format": "date-time"}},
        {"name": "until", "in": "query", "required": False, "description": "RFC 3339; admitted before",
         "schema": {"type": "string", "format": "date-time"}},
        {"name": "limit", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
        {"name": "cursor", "in": "query", "required": False, "description": "a page's next_cursor",
         "schema": {"type": "string", "maxLength": 200}},
    ]
    if with_model is not None:
        params.insert(0, {"name": "model", "in": "query", "required": False, "description": "provider/model",
                          "schema": {"type": "string", "enum": with_model}})
    return params


def _history_operation(summary: str, tag: str, parameters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "summary": summary, "tags": [tag], "parameters": parameters,
        "description": "Newest first, admitted within the retention window. A page examines at most five index "
                       "entries per entry it may list: a status or error_type filter that matches little answers "
                       "fewer entries than limit (even none) with a next_cursor to go on from.",
        "responses": {"200": {"description": "one page", "content": {"application/json": {
            "schema": HistoryPageSchema}}}, **_errors(400, 401, 429, 503)},
    }


def _component(spec: APISpec, name: str, schema: type) -> str:
    """The name ``schema`` is a component of ``spec`` under: ``name``, or the
    name an earlier model registered it by (two models taking the same body
    share one component: apispec refuses a class under two names)."""
    plugin = next(p for p in spec.plugins if isinstance(p, MarshmallowPlugin))
    assert plugin.converter is not None
    registered = plugin.converter.refs.get(make_schema_key(resolve_schema_instance(schema)))
    if registered is not None:
        return registered
    if name not in spec.components.schemas:
        spec.components.schema(name, schema=schema)
    return name


def _output(entry: ModelEntry, spec: APISpec, name: str) -> dict[str, Any]:
    if entry.output_schema is not None:
        schema: Any = _component(spec, name, entry.output_schema)
    else:
        schema = {"type": "string", "format": "binary"}
    return {"description": "the provider's native output, byte for byte",
            "headers": {"X-Comfy-Request-Id": "X-Comfy-Request-Id", **COST_HEADERS},
            "content": {media: {"schema": schema} for media in entry.output_media_types}}


def _names(entry: ModelEntry) -> tuple[str, str]:
    stem = "".join(part.capitalize() for part in entry.id.replace("/", "-").replace(".", "-").split("-"))
    return f"{stem}Input", f"{stem}Output"


#: One name of X-Comfy-Webhook-Events, with the spaces and tabs around it that are tolerated.
_EVENT = r"[ \t]*(started|progress|completed)[ \t]*"


def _model_paths(spec: APISpec, entry: ModelEntry, *, queue_routes: bool) -> None:
    input_name, output_name = _names(entry)
    input_name = _component(spec, input_name, entry.input_schema)
    body = {"required": True, "content": {"application/json": {"schema": input_name}}}
    idem = {"name": "Idempotency-Key", "in": "header", "required": False,
            "schema": {"type": "string", "minLength": 1, "maxLength": 255}}
    priority = {"name": "X-Comfy-Priority", "in": "header", "required": False,
                "description": "Orders this workspace's own requests; never those of other workspaces",
                "schema": {"type": "string", "enum": list(PRIORITIES), "default": "normal"}}
    webhook = {"name": "X-Comfy-Webhook-Url", "in": "header", "required": False,
               "description": "Where the request's signed events are POSTed (Standard Webhooks); https, public "
                              "addresses only (IPv4 inside IPv6 included), sendable as written (percent-encode "
                              "spaces), its host resolving within 2 s. Without it, the workspace's default, if "
                              "any. Either is refused (400) while the workspace has no signing secret.",
               "schema": {"type": "string", "format": "uri", "maxLength": 2048}}
    events = {"name": "X-Comfy-Webhook-Events", "in": "header", "required": False,
              "description": "Which events the webhook gets, comma-separated: started, progress (at most one per "
                             "2 s), completed; any subset, in any order. Without it, the workspace's default, else "
                             "completed. An unknown name, none, or no webhook to send them to: 400 invalid_input.",
              "schema": {"type": "string", "maxLength": 200,
                         "pattern": rf"^{_EVENT}(,{_EVENT})*$",
                         "default": "completed"}}
    policy = entry.policy
    start_deadline = {"name": "X-Comfy-Start-Deadline", "in": "header", "required": False,
                      "description": "Seconds from now: not started by then, the request ends COMPLETED with "
                                     f"queue_timeout, never charged. At most the model's queue timeout "
                                     f"({policy.queue_timeout_s:g} s); more, 0 or not a plain number is 400.",
                      "schema": {"type": "string", "pattern": DEADLINE_PATTERN}}
    deadline = {"name": "X-Comfy-Deadline", "in": "header", "required": False,
                "description": "Seconds from now: not completed by then, the request is cancelled as the cancel "
                               "route would cancel it (error_type cancelled). At most the model's queue timeout "
                               f"plus its longest run ({policy.queue_timeout_s + policy.max_run_s:g} s); more, 0 "
                               "or not a plain number is 400.",
                "schema": {"type": "string", "pattern": DEADLINE_PATTERN}}
    trace = {"name": "traceparent", "in": "header", "required": False,
             "description": "W3C Trace Context. Where the server exports traces, the submit's trace continues "
                            "the caller's, and the request's delivery, provider calls, completion and webhook "
                            "attempts are spans of that trace. Ignored otherwise, and when malformed.",
             "schema": {"type": "string", "maxLength": 256}}
    fallback = {"name": FALLBACK_HEADER, "in": "header", "required": False,
                "description": f"Up to {MAX_FALLBACK_MODELS} models (provider/model, comma-separated, in order) the "
                               "caller accepts in place of this one. The request runs on the next only when every "
                               "member of this model's provider pool kept it waiting (429s, refused credentials, "
                               "failures) for FALLBACK_AFTER_SECONDS, or until its start deadline if sooner; "
                               "model_ran and tried then show it. Each must take the same body (input schema), "
                               "run on the same provider; otherwise 400 invalid_input. The hold is the dearest "
                               "model's price; the charge is the price of the model that ran.",
                "schema": {"type": "string", "maxLength": 1000}}
    submit_headers = [idem, priority, webhook, events, start_deadline, deadline, fallback, trace]
    spec.path(path=paths.RUN.openapi(entry.id), operations={"post": {
        "summary": f"Run {entry.id} synchronously", "tags": [entry.id], "parameters": submit_headers,
        "requestBody": body,
        "responses": {"200": _output(entry, spec, output_name),
                      **_errors(400, 401, 402, 404, 409, 413, 422, 429, 502, 503, 504)},
    }})
    spec.path(path=paths.COST.openapi(entry.id), operations={"get": {
        "summary": f"What a submit of {entry.id} would hold now", "tags": [entry.id],
        "responses": {"200": {"description": "the price in credits", "content": {"application/json": {
            "schema": CostQuoteSchema}}}, **_errors(401, 404, 429)},
    }})
    listing = _history_operation(f"This workspace's {entry.id} requests, newest first", entry.id,
                                 _history_parameters(with_model=None))
    if not queue_routes:
        spec.path(path=paths.MODEL_HISTORY.openapi(entry.id), operations={"get": listing})
        return
    handle = {"description": "admitted", "content": {"application/json": {"schema": HandleSchema}},
              "headers": {"X-Comfy-Request-Id": "X-Comfy-Request-Id", "Idempotent-Replayed": "Idempotent-Replayed"}}
    spec.path(path=paths.SUBMIT.openapi(entry.id), operations={"post": {
        "summary": f"Queue a {entry.id} request", "tags": [entry.id], "parameters": submit_headers,
        "requestBody": body,
        "responses": {"201": handle, **_errors(400, 401, 402, 403, 404, 409, 413, 422, 429, 503, 504)},
    }, "get": listing})
    rid = {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 200}}
    status: dict[str, Any] = {"content": {"application/json": {"schema": StatusSchema}},
                              "headers": {"Retry-After": "Retry-After", "X-Comfy-Request-Id": "X-Comfy-Request-Id"}}
    gone = {"description": "past its retention window, for good",
            "content": {"application/json": {"schema": GoneSchema}}}
    spec.path(path=paths.STATUS.openapi(entry.id), operations={"get": {
        "summary": "Poll a request", "tags": [entry.id], "parameters": [rid],
        "responses": {"200": {"description": "the request's state", **status}, "410": gone,
                      **_errors(401, 403, 404, 429, 503)},
    }})
    last_event = {"name": "Last-Event-ID", "in": "header", "required": False,
                  "description": "The id of the last event received: a reconnecting client is sent only newer ones",
                  "schema": {"type": "string", "maxLength": 200}}
    spec.path(path=paths.EVENTS.openapi(entry.id), operations={"get": {
        "summary": "Follow a request: server-sent events until it completes", "tags": [entry.id],
        "parameters": [rid, last_event],
        "description": "One event per change: `in_queue`, `queue_position`, `in_progress`, `progress`, `completed` "
                       "(with `error_type` when it failed). Each event's `data` is the status body, its `id` names "
                       "the state it shows. A `: heartbeat` comment every 15 s; the stream ends after `completed` "
                       "(or after an hour: reconnect with Last-Event-ID). Counts as one call.",
        "responses": {"200": {"description": "the stream; each event's data is a status body",
                              "content": {"text/event-stream": {
                          # one event, as OpenAPI 3.2 describes server-sent events
                          "schema": {"type": "object", "required": ["data", "event", "id"], "properties": {
                              "event": {"type": "string", "enum": ["in_queue", "queue_position", "in_progress",
                                                                   "progress", "completed"]},
                              "id": {"type": "string"},
                              "data": {"type": "string",
                                       "description": "the status body, as JSON (see the status route)"}}}}}},
                      "410": gone, **_errors(401, 403, 404, 429, 503)},
    }})
    running = {"description": "not finished yet", "content": status["content"],
               "headers": {**status["headers"], **COST_HEADERS}}
    output = _output(entry, spec, output_name)
    spec.path(path=paths.RESULT.openapi(entry.id), operations={"get": {
        "summary": "Collect a request's result", "tags": [entry.id], "parameters": [rid, *_RANGE_PARAMETERS],
        "description": "The provider's output byte for byte under its Content-Type, with Content-Length and "
                       "`ETag: \"sha256:<hex>\"` (the output's sha256). If-None-Match answers 304; Range (one "
                       "range of bytes, on every result) answers 206, or 416 invalid_input when it selects "
                       "nothing; If-Range with another ETag gets the whole output. A large output is streamed "
                       "from the object store and checked against its sha256 as it goes: on a mismatch the "
                       "connection is cut before the last bytes, so a wrong body never arrives whole.",
        "responses": {"200": {**output, "headers": {**output["headers"], **_COLLECT_HEADERS}},
                      "202": running,
                      "206": {"description": "the part of the output Range asked for",
                              "headers": {**output["headers"], **_COLLECT_HEADERS,
                                          "Content-Range": {"schema": {"type": "string"}}},
                              "content": {media: {"schema": {"type": "string", "format": "binary"}}
                                          for media in entry.output_media_types}},
                      "304": {"description": "not modified: If-None-Match named its ETag",
                              "headers": {"ETag": _COLLECT_HEADERS["ETag"], **COST_HEADERS}},
                      "410": gone,
                      "416": {**_error("invalid_input: the Range selects nothing of the output; Content-Range "
                                       "names its size")},
                      **_errors(400, 401, 403, 404, 409, 422, 429, 500, 502, 503, 504)},
    }})
    spec.path(path=paths.LINK.openapi(entry.id), operations={"get": {
        "summary": "A URL to download a request's result from, without the API key", "tags": [entry.id],
        "parameters": [rid],
        "description": "Answered like a collect: 202 with the status body while the request runs, the error of "
                       "its bucket once it failed, 410 past retention. Once it succeeded: a signed URL of the "
                       "object store, valid for RESULT_LINK_SECONDS (300 s by default), where the output is in "
                       "a store that signs (S3, GCS); else the response_url itself, which needs the key. Not a "
                       "redirect: clients keep X-API-Key across a redirect and would hand it to another host.",
        "responses": {"200": {"description": "where to download it, and what it is",
                              "headers": COST_HEADERS,
                              "content": {"application/json": {"schema": _LINK_SCHEMA}}},
                      "202": running, "410": gone,
                      **_errors(400, 401, 403, 404, 409, 422, 429, 500, 502, 503, 504)},
    }})
    spec.path(path=paths.RETRY.openapi(entry.id), operations={"post": {
        "summary": "Submit a failed request's body again as a new request", "tags": [entry.id],
        "description": "Allowed for a request of this caller and model that is COMPLETED with an error_type, "
                       "within its retention; admitted like a submit (credits, backlog, rate, quotas) with this "
                       "call's headers. The new request's status names `retry_of`. An Idempotency-Key is bound "
                       "to the request retried: sent again under it, the retry is 409 (already retried), naming the "
                       "new request. No body is read.",
        "parameters": [rid, *submit_headers],
        "responses": {"201": handle, "410": gone, **_errors(400, 401, 402, 403, 404, 409, 429, 503, 504)},
    }})
    cancel = {"content": {"application/json": {"schema": CancelSchema}}}
    spec.path(path=paths.CANCEL.openapi(entry.id), operations={"put": {
        "summary": "Ask to cancel a request", "tags": [entry.id], "parameters": [rid],
        "responses": {"202": {"description": "CANCELLATION_REQUESTED", **cancel},
                      "409": {"description": "ALREADY_COMPLETED (or another 409 bucket)", **cancel}, "410": gone,
                      **_errors(401, 403, 404, 429, 503)},
    }})


#: Answers counted against the caller's rate carry these (web/ratelimit.py, Meter).
_RATE_HEADERS = {name: {"$ref": f"#/components/headers/{name}"} for name in ("RateLimit-Policy", "RateLimit")}
#: The paths whose calls are not counted (paths.Rate.EXEMPT), so carry neither.
_UNCOUNTED = frozenset(route.openapi() for route in paths.ROUTES if route.rate is paths.Rate.EXEMPT)


def _rate_headers(document: dict[str, Any]) -> dict[str, Any]:
    """The RateLimit fields on every answer of every route counted against the rate."""
    for path, operations in document.get("paths", {}).items():
        if path in _UNCOUNTED:
            continue
        for operation in operations.values():
            for response in operation.get("responses", {}).values():
                response.setdefault("headers", {}).update(_RATE_HEADERS)
    return document


def _patch_parts(document: dict[str, Any]) -> dict[str, Any]:
    """What marshmallow's cross-field check says and apispec cannot: a Gemini
    part holds exactly one of text, inlineData, fileData."""
    part = document.get("components", {}).get("schemas", {}).get("_Part")
    if part is not None:
        part.update(minProperties=1, maxProperties=1)
    return document


def model_document(entry: ModelEntry) -> dict[str, Any]:
    """One model's input and output schemas as a standalone OpenAPI document."""
    spec = _spec(entry.id, f"Input and output of {entry.id}; price {entry.price_credits} credits per run.")
    _model_paths(spec, entry, queue_routes=entry.queueable)
    return _rate_headers(_patch_parts(spec.to_dict()))


def api_document(catalog: Catalog) -> dict[str, Any]:
    """The whole API: every model's routes, the catalog and schema routes, health."""
    spec = _spec("router-queue", "Queued and synchronous delivery of AI model runs. "
                 "Authenticate with X-API-Key or Authorization: Bearer.")
    for model_id in catalog.ids():
        entry = catalog.by_id(model_id)
        assert entry is not None  # an id the catalog itself listed
        _model_paths(spec, entry, queue_routes=entry.queueable)
    spec.path(path=paths.HISTORY.openapi(), operations={"get": _history_operation(
        "This workspace's requests, newest first", "requests", _history_parameters(with_model=catalog.ids()))})
    bulk_openapi_paths(spec, _errors, _error)
    usage_paths(spec, _errors)
    spec.path(path=paths.CATALOG.openapi(), operations={"get": {
        "summary": "The model catalog, a page at a time", "tags": ["catalog"],
        "parameters": [
            {"name": "cursor", "in": "query", "required": False, "schema": {"type": "string", "maxLength": 200}},
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "description": "above 100 is clamped to 100"}},
        ],
        "responses": {"200": {"description": "one page", "content": {"application/json": {
            "schema": CatalogPageSchema}}}, **_errors(400, 429)},
    }})
    spec.path(path=paths.MODEL_OPENAPI.openapi(), operations={"get": {
        "summary": "One model's input and output schemas", "tags": ["catalog"],
        "parameters": [
            {"name": "provider", "in": "path", "required": True, "schema": {"type": "string"}},
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}},
            {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"}},
        ],
        "responses": {"200": {"description": "an OpenAPI document", "headers": {"ETag": {
            "schema": {"type": "string"}}}, "content": {"application/json": {"schema": {"type": "object"}}}},
            "304": {"description": "unchanged since the ETag sent"}, **_errors(404, 429)},
    }})
    batch_paths(spec, _errors)
    spec.path(path=paths.HEALTHZ.openapi(), operations={"get": {"summary": "Liveness", "tags": ["operations"],
                                                  "responses": {"200": {"description": "alive"}}}})
    document = _rate_headers(_patch_parts(spec.to_dict()))
    document["security"] = [{"apiKey": []}, {"bearer": []}]
    document["components"]["schemas"]["WebhookEvent"] = WEBHOOK_EVENT
    document["components"]["schemas"]["BatchCompletedEvent"] = BATCH_EVENT
    document["components"]["schemas"]["BudgetThresholdCrossedEvent"] = BUDGET_EVENT
    return document


#: The event a request's webhook receives (docs/API.md, "Webhooks"); in
#: components, since the document's OpenAPI version may predate ``webhooks``.
WEBHOOK_EVENT = {
    "type": "object",
    "description": "POSTed to X-Comfy-Webhook-Url for each event the request chose (X-Comfy-Webhook-Events; "
                   "default completed), one at a time, in order, signed per Standard Webhooks (webhook-id: "
                   "msg_<request_id> for completed, msg_<request_id>_started, msg_<request_id>_progress_<n>; "
                   "webhook-timestamp, webhook-signature v1,<base64 HMAC-SHA256>). The request as it was when the "
                   "event was owed. Answer 2xx; 410 stops retries; anything else is retried until 24 h after "
                   "the event was owed.",
    "required": ["type", "request_id", "model", "status", "error_type", "response_url", "created_at",
                 "started_at", "completed_at"],
    "properties": {
        "type": {"type": "string", "enum": ["request.started", "request.progress", "request.completed"]},
        "request_id": {"type": "string"},
        "model": {"type": "string"},
        "status": {"type": "string", "enum": ["IN_PROGRESS", "COMPLETED"]},
        "error_type": {"type": "string", "nullable": True},
        "response_url": {"type": "string", "format": "uri"},
        "created_at": {"type": "string", "format": "date-time"},
        "started_at": {"type": "string", "format": "date-time", "nullable": True},
        "completed_at": {"type": "string", "format": "date-time", "nullable": True,
                         "description": "null until the completed event"},
        "progress": {"type": "number", "minimum": 0, "maximum": 1, "description": "on a progress event only"},
        "cost": {"type": "object", "required": ["credits", "state"],
                 "description": "the request's cost at this step: held until it completed, then as settled",
                 "properties": {"credits": {"type": "integer", "minimum": 0},
                                "state": {"type": "string", "enum": ["held", "charged", "released"]}}},
    },
}


@lru_cache(maxsize=64)
def _serialized(document_json: str) -> tuple[bytes, str]:
    body = document_json.encode()
    return body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def serialized(document: dict[str, Any]) -> tuple[bytes, str]:
    """The document's bytes and a strong ETag over them."""
    return _serialized(json.dumps(document, sort_keys=True, separators=(",", ":")))
