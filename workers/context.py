"""What a worker process needs to run tasks, built lazily once per process.

Built on first use rather than at import so that each process opens its own
Redis and HTTP connections (and its heartbeat thread) after any fork.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import requests
import requests.adapters
from celery import Celery

from router_queue.services import Publisher, Services

from .credentials import Credentials
from .leases import LeaseKeeper


@dataclass
class WorkerContext:
    services: Services
    session: requests.Session
    dispatcher: Publisher
    leases: LeaseKeeper
    #: Each provider's credential, as the catalog and settings name it; built
    #: from ``services`` when not given.
    credentials: Credentials | None = None
    #: Set when the worker begins a warm shutdown: running generations that
    #: can be resumed elsewhere are handed back instead of waited for.
    shutting_down: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def build(cls, app: Celery, services: Services | None = None) -> "WorkerContext":
        services = services or Services.build(app.router_settings, celery=app)
        assert services.dispatcher is not None, "a worker publishes: its Services are built with its Celery app"
        return cls(services, provider_session(), services.dispatcher, LeaseKeeper(services.store,
                                                                                   services.settings.lease_s))

    def __post_init__(self) -> None:
        if self.credentials is None:
            self.credentials = Credentials(self.services.catalog, self.services.settings.provider_credentials)


#: Connections kept per provider host: one per worker thread that may call it.
POOL_SIZE = 256


def provider_session() -> requests.Session:
    """The HTTP session every provider call of this process shares.

    ``trust_env`` off: requests would otherwise re-read proxy, netrc and CA
    settings from the environment on every call (about a third of a poll's
    client CPU). The pool keeps a connection per thread instead of discarding
    all but ten.
    """
    session = requests.Session()
    session.trust_env = False
    adapter = requests.adapters.HTTPAdapter(pool_connections=8, pool_maxsize=POOL_SIZE)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return session


_lock = threading.Lock()
#: Every context this process built (one per Celery app), for the shutdown signal.
_built: list[WorkerContext] = []


def context_for(app: Celery) -> WorkerContext:
    with _lock:
        context = getattr(app, "_router_context", None)
        if context is None:
            context = app._router_context = WorkerContext.build(app)
            _built.append(context)
        return context


def begin_shutdown() -> None:
    """Tell every running delivery of this process that the worker is stopping."""
    with _lock:
        for context in _built:
            context.shutting_down.set()
