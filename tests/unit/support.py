"""Small helpers the unit tests share."""

from __future__ import annotations

import json

import requests
from click.testing import CliRunner

from router_queue.catalog import Catalog
from router_queue.store.members import PoolCapacity
from router_queue.web.front import EXTENSION
from tests.pool_catalogs import pool_catalog, vertex_members
from workers.context import WorkerContext
from workers.leases import LeaseKeeper


def record_of(services, request_id: str, provider: str):
    """The request's record as a worker would hold it."""
    record = services.store.status_view(request_id, provider).record
    assert record is not None, f"no record for {request_id}"
    return record


def deliver_webhook(context, request_id: str) -> str:
    """One webhook attempt as the ``deliver_webhook`` task makes it, from a worker's context."""
    from router_queue.webhooks import delivery

    return delivery.deliver(context.services, context.dispatcher, request_id)


class ServicesCliRunner(CliRunner):
    """Click's runner, each command acting on ``services`` (the CLI's context object)."""

    def __init__(self, services, **kwargs):
        super().__init__(**kwargs)
        self.services = services

    def invoke(self, cli, args=None, **kwargs):
        kwargs.setdefault("obj", self.services)
        return super().invoke(cli, args, **kwargs)


def cli_runner(app) -> ServicesCliRunner:
    """The ``router-queue`` command's runner on the app's own services."""
    return ServicesCliRunner(app.extensions[EXTENSION].services)


def context_of(services, session=None) -> WorkerContext:
    return WorkerContext(services, session or requests.Session(), services.dispatcher,
                         LeaseKeeper(services.store, services.settings.lease_s))


class Clock:
    """The resolver's clock, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def frames(response, limit: int = 20, out: list | None = None) -> list[dict]:
    """The stream's events as {id, event, data}, appended to ``out`` as they
    arrive, until it ends (or ``limit``)."""
    out = [] if out is None else out
    current: dict = {}
    for chunk in response.response:
        for line in (chunk.decode() if isinstance(chunk, bytes) else chunk).split("\n"):
            if not line:
                if "event" in current:
                    out.append(current)
                current = {}
            elif line.startswith(("id: ", "event: ", "data: ")):
                field, value = line.split(": ", 1)
                current[field] = json.loads(value) if field == "data" else value
        if len(out) >= limit:
            break
    response.close()
    return out


def pooled(services, directory, max_in_flight: int = 2):
    """``services`` with Vertex AI a pool of its two locations of ``max_in_flight``
    slots each (tests/pool_catalogs.py), the pool's capacity read at every grant
    on a clock moved by hand (``services.clock``)."""
    services.catalog = Catalog.load(pool_catalog(directory, members=vertex_members(max_in_flight=max_in_flight)))
    clock = Clock()
    services.members.clock = clock
    capacity = PoolCapacity(services.redis, services.catalog.members, ttl_s=0, clock=clock, wait=True)
    services.store.max_in_flight, services.store.model_caps = capacity, capacity.model_caps
    services.clock = clock
    return services
