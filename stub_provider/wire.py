"""Small HTTP helpers shared by the three provider blueprints."""

from __future__ import annotations

import json
from typing import Any

from flask import Response, current_app, request

from .directives import digest
from .outputs import to_json
from .state import StubState


def state() -> StubState:
    """The StubState of the running app."""
    return current_app.extensions["stub_provider"]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Serialise `obj` ourselves so the bytes are fixed (Flask would not re-order, but be explicit)."""
    return Response(to_json(obj), status=status, mimetype="application/json", headers=headers)


def read_body() -> tuple[Any, str | None]:
    """The parsed JSON body and its canonical digest; (None, None) when not JSON.

    Parsed from the raw bytes whatever the Content-Type, as the real
    providers' JSON APIs are lenient about it too.
    """
    raw = request.get_data(cache=True)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, None
    return body, digest(body)


def bearer_token() -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if non-empty."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def retry_after_headers(retry_after: str | None) -> dict[str, str] | None:
    return {"Retry-After": retry_after} if retry_after is not None else None
