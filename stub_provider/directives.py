"""Parse `[stub:NAME=VALUE]` directives out of a request's input text.

Tests and demos steer the stub through the prompt itself, because that is
the only thing the project's real adapters pass through unchanged: no
side channel, no extra header, the same request would reach a real
provider verbatim. The directives stay in the text (they are part of the
prompt), so they also show up in echoed fields and in the body digest.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

# `[stub:NAME]` or `[stub:NAME=VALUE]`; NAME is letters, digits, underscore.
_TOKEN = re.compile(r"\[stub:([A-Za-z0-9_]+)(?:=([^\]\s]*))?\]")

DEFAULT_HANG_S = 120.0  # seconds, when `[stub:hang]` carries no value
DEFAULT_RETRY_AFTER_S = 1.0  # seconds, when only `[stub:429_times=N]` is given
MAX_SIZE_BYTES = 64 * 1024 * 1024  # largest output `[stub:size=BYTES]` may ask for, bytes


@dataclass(frozen=True)
class Directives:
    """What the input text asked of the stub; defaults mean "behave normally"."""

    latency: float = 0.0  # seconds of simulated generation time
    status: int | None = None  # every call fails with this HTTP status
    fail_times: int = 0  # first N calls per body digest fail with 500
    hang: float | None = None  # seconds to sleep before a normal 200
    retry_after: float | None = None  # seconds; set when 429 is requested
    rate_limit_times: int = 0  # first N calls per body digest answer 429
    refuse: bool = False  # content-policy refusal, provider style
    reject: bool = False  # 4xx input error, provider style
    size: int | None = None  # bytes of the generated file (Vertex's image decoded, OpenAI's audio)
    rate_limit_key: str | None = None  # every call made with this key answers 429 (a pool member paused)
    refuse_key: str | None = None  # every call made with this key answers 401 (a member's key revoked)
    rate_limit_model: str | None = None  # every Vertex call to this model answers 429, in every location


@dataclass(frozen=True)
class Fault:
    """An injected failure for one call: the HTTP status and, for 429, Retry-After."""

    status: int
    retry_after: str | None = None  # header text, seconds


def _seconds(value: str | None) -> float | None:
    """A finite, non-negative float, or None for anything else."""
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    if number is None or not math.isfinite(number) or number < 0:
        return None
    return number


def _count(value: str | None) -> int | None:
    """A non-negative int, or None for anything else."""
    if value is None or not value.isdigit():
        return None
    return int(value)


def parse(text: Any) -> Directives:
    """Collect directives from `text`; malformed or unknown ones are ignored.

    When a directive appears twice the last occurrence wins.
    """
    if not isinstance(text, str):
        return Directives()
    found: dict[str, Any] = {}
    rate_limit_seen = False
    for name, value in ((m.group(1).lower(), m.group(2)) for m in _TOKEN.finditer(text)):
        if name == "latency" and (seconds := _seconds(value)) is not None:
            found["latency"] = seconds
        elif name == "status" and (code := _count(value)) is not None and 400 <= code <= 599:
            found["status"] = code
        elif name == "fail_times" and (count := _count(value)) is not None:
            found["fail_times"] = count
        elif name == "hang":
            seconds = DEFAULT_HANG_S if value in (None, "") else _seconds(value)
            if seconds is not None:
                found["hang"] = seconds
        elif name == "429" and (seconds := _seconds(value)) is not None:
            found["retry_after"] = seconds
            rate_limit_seen = True
        elif name == "429_times" and (count := _count(value)) is not None:
            found["rate_limit_times"] = count
            rate_limit_seen = True
        elif name == "refuse" and value is None:
            found["refuse"] = True
        elif name == "reject" and value is None:
            found["reject"] = True
        elif name == "size" and (count := _count(value)) is not None and count <= MAX_SIZE_BYTES:
            found["size"] = count
        elif name == "429_key" and value:
            found["rate_limit_key"] = value
        elif name == "401_key" and value:
            found["refuse_key"] = value
        elif name == "429_model" and value:
            found["rate_limit_model"] = value
    if rate_limit_seen:
        found.setdefault("retry_after", DEFAULT_RETRY_AFTER_S)
        found.setdefault("rate_limit_times", 1)
    return Directives(**found)


def key_fault(directives: Directives, key: str | None) -> Fault | None:
    """The failure a call made with ``key`` (the member it came from: BFL's
    ``x-key``, OpenAI's bearer token, Vertex AI's location) gets
    whatever its attempt: ``401_key`` refuses that key, ``429_key`` rate-limits
    it (Retry-After as ``429=`` says, else 1 s). Other keys are served."""
    if key is None:
        return None
    if directives.refuse_key == key:
        return Fault(401)
    if directives.rate_limit_key == key:
        return Fault(429, format_seconds(directives.retry_after or DEFAULT_RETRY_AFTER_S))
    return None


def model_fault(directives: Directives, model: str) -> Fault | None:
    """``429_model``: every call to that model answers 429 (Retry-After as
    ``429=`` says, else 1 s), whatever its member: a model's quota spent
    everywhere, for a fallback to another model (docs/POOLS.md)."""
    if directives.rate_limit_model is not None and directives.rate_limit_model == model:
        return Fault(429, format_seconds(directives.retry_after or DEFAULT_RETRY_AFTER_S))
    return None


def decide_fault(directives: Directives, attempt: int) -> Fault | None:
    """The injected failure for the `attempt`-th call (1-based) of one body, if any.

    Order: the first `429_times` calls answer 429; then `status=` fails every
    call; otherwise the next `fail_times` calls answer 500.
    """
    if directives.retry_after is not None:
        if attempt <= directives.rate_limit_times:
            return Fault(429, format_seconds(directives.retry_after))
        attempt -= directives.rate_limit_times
    if directives.status is not None:
        return Fault(directives.status)
    if attempt <= directives.fail_times:
        return Fault(500)
    return None


def format_seconds(seconds: float) -> str:
    """Header text for a number of seconds: "3" for 3.0, "0.5" for 0.5."""
    return f"{seconds:g}"


def canonical(body: Any) -> str:
    """The body as canonical JSON: sorted keys, no whitespace."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def digest(body: Any) -> str:
    """sha256 hex of the canonical body; the key for counters and outputs."""
    return hashlib.sha256(canonical(body).encode("utf-8")).hexdigest()
