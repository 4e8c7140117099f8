"""What a worker process needs to run tasks, built lazily once per process.

Built on first use rather than at import so that each prefork child opens its
own Redis and HTTP connections after the fork.
"""

from __future__ import annotations

from dataclasses import dataclass

import requests
from celery import Celery

from router_queue.dispatch import Dispatcher
from router_queue.services import Services


@dataclass
class WorkerContext:
    services: Services
    session: requests.Session
    dispatcher: Dispatcher


def context_for(app: Celery) -> WorkerContext:
    context = getattr(app, "_router_context", None)
    if context is None:
        services = Services.build(app.router_settings)
        context = WorkerContext(services, requests.Session(), Dispatcher(app, services.store))
        app._router_context = context
    return context
