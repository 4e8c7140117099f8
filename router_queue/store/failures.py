"""Recent failures by model and ``error_type``, for operators (the ops page,
``/ops/summary.json``, ``router-queue ops failures``): counts only, no
request, workspace, body or URL.

Each failure adds one to its provider's hash for its 5-minute bucket
("{model}|{error_type}" -> count), which expires a day and a bucket later: a
bounded structure (buckets × models × error types), written by the one place
every completion is counted (``metrics.Recorder.completed``), never read on a
request's path. The Prometheus counters are per process; these are the fleet's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from . import keys

#: Seconds per bucket, and the windows read (the last hour, the last day).
BUCKET_S = 300
HOUR_S, DAY_S = 3600, 86400
#: Seconds a bucket is kept: the day it serves, and itself.
KEEP_S = DAY_S + BUCKET_S


@dataclass(frozen=True)
class FailureRow:
    """One model's failures of one kind, in the last hour and the last day."""

    model: str
    error_type: str
    last_hour: int
    last_day: int


class FailureCounts:
    def __init__(self, client: redis.Redis):
        self.client = client

    def count(self, provider: str, model: str, error_type: str, now: float | None = None) -> None:
        """One failure; a pipeline of two writes (counting needs no read)."""
        bucket = int((time.time() if now is None else now) // BUCKET_S)
        key = keys.failures(provider, bucket)
        pipe = self.client.pipeline(transaction=False)
        pipe.hincrby(key, f"{model}|{error_type}", 1)
        pipe.expire(key, KEEP_S)
        pipe.execute()

    def recent(self, providers: list[str], now: float | None = None) -> list[FailureRow]:
        """Every (model, error_type) that failed in the last day, most in the last hour first.
        The windows are whole buckets: the last hour is the 12 buckets ending with the current one."""
        now = time.time() if now is None else now
        current = int(now // BUCKET_S)
        buckets = range(current - DAY_S // BUCKET_S + 1, current + 1)
        hour_from = current - HOUR_S // BUCKET_S + 1
        pipe = self.client.pipeline(transaction=False)
        for provider in providers:
            for bucket in buckets:
                pipe.hgetall(keys.failures(provider, bucket))
        replies = iter(pipe.execute())
        hour: dict[tuple[str, str], int] = {}
        day: dict[tuple[str, str], int] = {}
        for _provider in providers:
            for bucket in buckets:
                for name, value in next(replies).items():
                    model, _, error_type = name.decode().rpartition("|")
                    day[(model, error_type)] = day.get((model, error_type), 0) + int(value)
                    if bucket >= hour_from:
                        hour[(model, error_type)] = hour.get((model, error_type), 0) + int(value)
        rows = [FailureRow(model, error_type, hour.get((model, error_type), 0), n)
                for (model, error_type), n in day.items()]
        return sorted(rows, key=lambda r: (-r.last_hour, -r.last_day, r.model, r.error_type))
