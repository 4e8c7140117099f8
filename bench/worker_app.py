"""The bench fleet's Celery app: production's (``workers.main``) plus ``bench.ping``, the bare Celery
round trip the dispatch and grant-to-start figures are measured against."""

import time

from workers.context import context_for
from workers.main import app


@app.task(bind=True, name="bench.ping", ignore_result=True, acks_late=False, max_retries=0)
def ping(self, reply_key: str) -> None:
    """Answers on ``reply_key`` (a Redis list): publish, consume, run, one Redis write, a delivery's least."""
    client = context_for(self.app).services.redis
    client.rpush(reply_key, repr(time.time()))
    client.expire(reply_key, 60)
