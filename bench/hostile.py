"""``hostile_body_ratio``: refusing a hostile 1 MB body against admitting a plain 1 MB prompt of the
same model, interleaved on one keep-alive connection."""

import json
import statistics
from contextlib import closing
from typing import Callable

from .core import CAPPED_MODEL_ID, Context, KeepAlive, MeasurementError, emit, phase

#: Bytes of every body (under the front door's 1 MiB limit); interleaved rounds of plain and hostile submits.
SIZE, ROUNDS = 1_000_000, 15


def _compact(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _fill(make: Callable[[int], object]) -> bytes:
    """``make(n)`` for the largest n (doubling, then bisecting) whose JSON fits ``SIZE`` bytes."""
    low, high = 1, 2
    while len(_compact(make(high))) <= SIZE:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(_compact(make(middle))) <= SIZE else (low, middle)
    return _compact(make(low))


def _turn(*parts: dict) -> dict:
    return {"role": "user", "parts": list(parts)}


def bodies() -> dict[str, bytes]:
    """The plain body first, then each hostile kind, each about ``SIZE`` bytes."""
    plain = _compact({"contents": [_turn({"text": ""})]})
    return {
        "plain": _compact({"contents": [_turn({"text": "a" * (SIZE - len(plain))})]}),
        # the report's body: a valid prompt and 90,000 unknown keys
        "unknown_keys": _fill(lambda n: {"contents": [_turn({"text": "a cat"})], **{f"k{i}": 1 for i in range(n)}}),
        # lists nested as deep as the JSON parser goes, where a part's text belongs
        "deeply_nested": b'{"contents":[{"parts":[{"text":' + b"[" * (SIZE // 2 - 40) + b"]" * (SIZE // 2 - 40)
                         + b"}]}]}",
        # every list at its maximum length (64 turns of 4 parts), every item wrong, the data filling the megabyte
        "max_length_lists": _fill(lambda n: {"contents": [
            {"role": "robot", "parts": [{"inlineData": {"mimeType": 1, "data": "a" * n}}] * 4}] * 64}),
        "many_small_parts": _fill(lambda n: {"contents": [_turn(*[{"text": "a"}] * n)]}),
        "huge_key": _fill(lambda n: {"contents": [_turn({"text": "a cat"})], "k" * n: 1}),
    }


@phase("hostile_body_ratio", "front", 60)
def measure(ctx: Context) -> None:
    path, headers, cases = f"/v2/models/{CAPPED_MODEL_ID}/requests", ctx.front.post_headers, bodies()
    timings: dict[str, list[float]] = {name: [] for name in cases}
    statuses: dict[str, int] = {}
    with closing(KeepAlive(ctx.front.url)) as connection:
        for body in cases.values():  # warm-up: each kind once
            connection.call("POST", path, None, body, headers)
        for _ in range(ROUNDS):
            for name, body in cases.items():
                ms, statuses[name], _ = connection.call("POST", path, None, body, headers)
                timings[name].append(ms)
    if statuses.pop("plain") != 201:
        raise MeasurementError("hostile_body_ratio: the plain 1 MB prompt was not answered 201")
    if refused := {name: status for name, status in statuses.items() if not 400 <= status < 500}:
        raise MeasurementError(f"hostile_body_ratio: hostile bodies not refused: {refused}")
    plain = statistics.median(timings["plain"])
    for name in statuses:
        emit(f"hostile_body_ratio_{name}", statistics.median(timings[name]), "ms", plain)
    emit("hostile_body_ratio", max(statistics.median(timings[name]) for name in statuses), "ms", plain)
