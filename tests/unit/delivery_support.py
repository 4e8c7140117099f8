"""The worker's delivery in the unit tests: the stub provider in a thread (fixtures),
services pointed at it, and deliveries run as Celery would run them."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import requests
from werkzeug.serving import make_server

from router_queue.requests.record import Submission
from router_queue.settings import Secret
from router_queue.web.admission import fingerprint
from stub_provider import create_app as create_stub
from workers.delivery import Execution, Later, deliver


@pytest.fixture(scope="module")
def stub_origin():
    server = make_server("127.0.0.1", 0, create_stub(), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(autouse=True)
def fresh_stub(stub_origin):
    """The stub keys its fault counters by body; each test starts them afresh."""
    requests.post(f"{stub_origin}/stub/reset")


@pytest.fixture
def worker_services(services, stub_origin):
    services.settings = dataclasses.replace(
        services.settings, provider_origin_override=stub_origin,
        provider_credentials={name: Secret("k") for name in ("BFL_API_KEY", "VERTEXAI_ACCESS_TOKEN", "OPENAI_API_KEY")},
    )
    return services


def admitted(services, workspace, model, body):
    provider = model.split("/")[0]
    request_id = services.ids.mint(workspace, model)
    outcome = services.store.admit(Submission(request_id=request_id, workspace=workspace, model=model, provider=provider,
                                   body=json.dumps(body), fingerprint=fingerprint(model, body)))
    assert outcome.outcome == "ADMITTED"
    return request_id, provider


def execution(task_id="task-1", retries=0) -> Execution:
    """What tasks.deliver builds for retry ``retries`` of task ``task_id``."""
    return Execution(token=f"{task_id}-run-{retries}", resume_key=f"{task_id}:{retries}",
                     next_resume_key=f"{task_id}:{retries + 1}")


def deliver_until_done(context, request_id, task_id="task-1", waits=None):
    """Deliver as Celery would: a ``Later`` is a retry of the same task, after
    its countdown (which the pools' clock is moved on by: a paused member's
    pause has ended when the retry runs, as it would have)."""
    retries = 0
    members = context.services.members
    real_clock, passed = members.clock, [0.0]
    members.clock = lambda: real_clock() + passed[0]
    try:
        while True:
            try:
                return deliver(context, request_id, execution(task_id, retries))
            except Later as later:
                retries += 1
                passed[0] += later.countdown
                if waits is not None:
                    waits.append(later.countdown)
    finally:
        members.clock = real_clock
