"""Helpers for the synchronous-route and discovery tests (test_sync_and_discovery.py):
reading the OpenAPI document. The second front door they run (a short
``SYNC_DEADLINE_SECONDS``) is ``harness.RunningStack.second_door``.
"""

from __future__ import annotations

from typing import Any

#: Seconds the whole body of one synchronous call may take client side (tests, not clients).
SYNC_READ_TIMEOUT_S = 60.0


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a top-level local ``$ref`` followed (``#/components/...``)."""
    while "$ref" in schema:
        node: Any = document
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def request_body_schema(document: dict[str, Any], path: str, method: str = "post") -> dict[str, Any]:
    operation = document["paths"][path][method]
    return resolve(document, operation["requestBody"]["content"]["application/json"]["schema"])


def documented_media_types(document: dict[str, Any], path: str, method: str, status: str) -> set[str]:
    return set(document["paths"][path][method]["responses"][status].get("content", {}))
