"""The bench fleet's Celery app: production's (``workers.main``) plus a no-op task, the bare Celery round
trip that the dispatch and grant-to-start figures are measured against."""

from __future__ import annotations

import time

from workers.context import context_for
from workers.main import app

PING_TASK = "bench.ping"


@app.task(bind=True, name=PING_TASK, ignore_result=True, acks_late=False, max_retries=0)
def ping(self, reply_key: str) -> None:
    """Answers on ``reply_key`` (a Redis list): publish, consume, run, one Redis write, as a delivery does
    at the least."""
    client = context_for(self.app).services.redis
    client.rpush(reply_key, repr(time.time()))
    client.expire(reply_key, 60)
