"""The synchronous route's helpers: a dispatcher that finishes what it publishes, and a sync call."""

from __future__ import annotations

import json
import threading
import time

from router_queue.services import Services
from router_queue.store.requests_base import GrantPublishing
from router_queue.store.requests_values import Lease
from tests.unit.route_support import FLUX
from tests.unit.support import record_of

NATIVE = b'{"id":"t","status":"Ready","result":{"sample":"https://x/y.jpeg"}}'


class FinishingDispatcher:
    """Stands in for a worker: each published request completes after ``delay_s``."""

    def __init__(self, delay_s=0.2, outcome=None):
        self.delay_s = delay_s
        self.outcome = outcome or {"output": NATIVE, "content_type": "application/json"}
        self.published: list[str] = []
        self.grants = GrantPublishing(publish=self.publish_granted)
        self.services: Services | None = None

    @classmethod
    def serving(cls, settings, client, **kwargs) -> tuple[Services, "FinishingDispatcher"]:
        """Services on ``client`` whose grants this dispatcher finishes."""
        dispatcher = cls(**kwargs)
        dispatcher.services = Services.build(settings, client, dispatcher=dispatcher)
        return dispatcher.services, dispatcher

    def publish_granted(self, provider, request_ids):
        for request_id in request_ids:
            self.publish(request_id, provider)

    def publish(self, request_id, provider):
        self.published.append(request_id)

        def finish():
            time.sleep(self.delay_s)
            store = self.services.store
            store.claim(record_of(self.services, request_id, provider),
                        Lease("w", 30, 3600, 3))
            store.complete(record_of(self.services, request_id, provider), **self.outcome)

        if self.delay_s is not None:
            threading.Thread(target=finish, daemon=True).start()


def run(http, auth, body=None, headers=None):
    return http.post(FLUX, data=json.dumps(body or {"prompt": "teapot"}),
                     headers={**auth, "Content-Type": "application/json", **(headers or {})})
