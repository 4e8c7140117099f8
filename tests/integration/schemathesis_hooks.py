"""Schemathesis hooks for ``test_schemathesis.py`` (``SCHEMATHESIS_HOOKS``):
a batch's body is NDJSON (``POST /v2/batches``), which Schemathesis has no
serializer for; a generated line is sent as one NDJSON line."""

from __future__ import annotations

import json
from typing import Any

import schemathesis


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: Any, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    return (json.dumps(value) + "\n").encode()
