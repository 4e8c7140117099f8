"""Small helpers the unit tests share."""

from __future__ import annotations

from click.testing import CliRunner

from router_queue.web.front import EXTENSION


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
