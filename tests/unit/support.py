"""Small helpers the unit tests share."""

from __future__ import annotations

import json

import requests
from click.testing import CliRunner

from router_queue.web.front import EXTENSION
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
