"""Discovery: the model catalog, each model's OpenAPI document, the whole
API's document, and a docs page rendered from it (no outside network)."""

from __future__ import annotations

import base64
import binascii
import json

from flask import Blueprint, Response, request

from ..catalog import Catalog
from ..errors import InvalidInput
from . import paths
from .bodies import json_response
from .front import front_door
from .headers import page
from .openapi import api_document, model_document, serialized
from .routes import model_entry

discovery = Blueprint("discovery", __name__)

#: Page size when the caller names none, and the most a page holds.
DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def _catalog() -> Catalog:
    return front_door().services.catalog


def _encode_cursor(model_id: str) -> str:
    return base64.urlsafe_b64encode(model_id.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        return base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidInput("cursor is not one this server handed out; start again without it") from None


def _limit() -> int:
    raw = request.args.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidInput(f"limit must be a whole number, got {raw!r}") from None
    if limit < 1:
        raise InvalidInput("limit must be at least 1")
    return min(limit, MAX_LIMIT)


@paths.CATALOG.view(discovery)
def list_models() -> Response:
    limit = _limit()
    ids = _catalog().ids()
    cursor = request.args.get("cursor")
    start = 0
    if cursor:
        after = _decode_cursor(cursor)
        start = next((n for n, model_id in enumerate(ids) if model_id > after), len(ids))
    page = ids[start:start + limit]
    has_more = start + limit < len(ids)
    data = []
    for model_id in page:
        entry = _catalog().by_id(model_id)
        assert entry is not None  # ids() lists this catalog's own entries
        data.append({"id": entry.id, "provider": entry.provider, "model": entry.model, "billing": entry.billing})
    return json_response({"data": data, "has_more": has_more,
                          "next_cursor": _encode_cursor(page[-1]) if has_more and page else None, "limit": limit})


def _document_response(document: dict) -> Response:
    body, etag = serialized(document)
    if etag in request.headers.get("If-None-Match", ""):
        return Response(status=304, headers={"ETag": etag})
    return Response(body, 200, mimetype="application/json", headers={"ETag": etag})


@paths.MODEL_OPENAPI.view(discovery)
def model_schema(provider: str, model: str) -> Response:
    return _document_response(model_document(model_entry(provider, model)))


@paths.API_OPENAPI.view(discovery)
def openapi() -> Response:
    return _document_response(api_document(_catalog()))


@paths.DOCS.view(discovery)
def docs() -> Response:
    document = api_document(_catalog())
    return page("docs.html", doc=document, dumps=lambda value: json.dumps(value, indent=2))
