"""OpenTelemetry, in process: one trace per request, from the submit through
the delivery, its provider calls and its completion to its webhook attempt,
whoever published its message; and, with tracing off, nothing instrumented
and the lane serving as before.

The spans go to the SDK's in-memory exporter; the front door is the Flask
app on the store's Redis, the delivery and the webhook attempt run here,
against the stub provider and a receiver in threads of this process.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections import defaultdict

import pytest
import redis
import requests
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from werkzeug.serving import make_server

from router_queue import tracing
from router_queue.settings import Secret
from router_queue.store import keys
from router_queue.web.app import create_app
from router_queue.web.lane import Lane
from router_queue.webhooks import event as webhook_event
from stub_provider import create_app as create_stub
from tests.unit.support import deliver_webhook
from tests.unit.webhook_support import Receiver
from workers.context import WorkerContext
from workers.delivery import Execution, deliver
from workers.leases import LeaseKeeper

FLUX = "/v2/models/bfl/flux-2-pro"
SUBMIT_SPAN = "POST /v2/models/<provider>/<model>/requests"
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def stub_origin():
    server = make_server("127.0.0.1", 0, create_stub(), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def spans(settings):
    """Tracing on, into memory, for this test only."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing.sampler())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert tracing.configure(settings, "test", provider=provider)
    yield exporter
    tracing.unconfigure()


@pytest.fixture
def traced(spans, services, settings, stub_origin, workspace):
    """The services as a worker sees them: the stub for every provider,
    loopback webhooks allowed, the workspace able to sign."""
    services.settings = dataclasses.replace(
        settings, provider_origin_override=stub_origin, webhook_allow_loopback_http=True,
        provider_credentials={name: Secret("k") for name in ("BFL_API_KEY", "VERTEXAI_ACCESS_TOKEN", "OPENAI_API_KEY")},
    )
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    return services


@pytest.fixture
def traced_http(traced):
    return create_app(traced.settings, services=traced).test_client()


@pytest.fixture
def receiver():
    made = Receiver()
    yield made
    made.close()


def _worker(services) -> WorkerContext:
    return WorkerContext(services, requests.Session(), services.dispatcher,
                         LeaseKeeper(services.store, services.settings.lease_s))


def _submit(http, auth, prompt: str, **headers: str):
    response = http.post(f"{FLUX}/requests", json={"prompt": prompt}, headers={**auth, **headers})
    assert response.status_code == 201, response.get_data(as_text=True)
    return response.json["request_id"]


def _traces(exporter) -> dict[str, list]:
    by_trace = defaultdict(list)
    for span in exporter.get_finished_spans():
        by_trace[format(span.context.trace_id, "032x")].append(span)
    return by_trace


def _trace_of(by_trace, request_id: str) -> str:
    """The trace of the submit span that admitted ``request_id``."""
    found = {trace for trace, spans in by_trace.items() for s in spans
             if s.name == "deliver" and s.attributes.get("router_queue.request_id") == request_id}
    assert len(found) == 1, found
    return found.pop()


def test_a_request_is_one_trace_from_its_submit_to_its_webhook(traced, traced_http, auth, spans, receiver):
    parent = f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"
    request_id = _submit(traced_http, auth, "a teapot", **{"traceparent": parent,
                                                           "X-Comfy-Webhook-Url": receiver.url})
    context = _worker(traced)
    assert deliver(context, request_id, Execution(token=uuid.uuid4().hex)) == "completed"
    assert deliver_webhook(context, request_id) == "delivered"

    by_trace = _traces(spans)
    assert list(by_trace) == [CALLER_TRACE], {t: [s.name for s in ss] for t, ss in by_trace.items()}
    names = [s.name for s in by_trace[CALLER_TRACE]]
    for wanted in (SUBMIT_SPAN, "deliver", "provider call", "complete", "webhook attempt", "EVALSHA"):
        assert wanted in names, names
    by_name = {s.name: s for s in by_trace[CALLER_TRACE]}
    submit = by_name[SUBMIT_SPAN]
    assert submit.kind is SpanKind.SERVER and format(submit.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert by_name["deliver"].parent.span_id == submit.context.span_id  # continued from the record
    assert by_name["deliver"].attributes["router_queue.outcome"] == "completed"
    call = by_name["provider call"]
    http_calls = [s for s in by_trace[CALLER_TRACE] if s.kind is SpanKind.CLIENT and s.parent is not None
                  and s.parent.span_id == call.context.span_id and "http.method" in s.attributes]
    assert [s.attributes["http.method"] for s in http_calls] == ["POST", "GET"]  # BFL's submit, then its poll
    assert by_name["complete"].parent.span_id == by_name["deliver"].context.span_id
    hook = by_name["webhook attempt"]
    assert hook.parent.span_id == submit.context.span_id
    assert hook.attributes["router_queue.outcome"] == "delivered"
    assert hook.attributes["http.response.status_code"] == 204


def test_a_request_granted_by_anothers_completion_continues_its_own_trace(traced, traced_http, auth, spans):
    """B's message is pushed by A's completion, inside A's delivery span; B's
    delivery still joins the trace B's submit began, from B's record."""
    traced.store.max_in_flight = lambda provider: 1
    first = _submit(traced_http, auth, "first")
    second = _submit(traced_http, auth, "second")  # waits: no slot, no message
    context = _worker(traced)
    assert deliver(context, first, Execution(token=uuid.uuid4().hex)) == "completed"  # grants the second
    assert context.dispatcher.published == [(first, "bfl"), (second, "bfl")]  # at its submit; at first's end
    assert deliver(context, second, Execution(token=uuid.uuid4().hex)) == "completed"

    by_trace = _traces(spans)
    assert len(by_trace) == 2, {t: [s.name for s in ss] for t, ss in by_trace.items()}
    first_trace, second_trace = _trace_of(by_trace, first), _trace_of(by_trace, second)
    assert first_trace != second_trace
    for trace in (first_trace, second_trace):
        assert [s.name for s in by_trace[trace]].count(SUBMIT_SPAN) == 1
        assert [s.name for s in by_trace[trace]].count("deliver") == 1


def test_off_nothing_is_instrumented_and_the_lane_serves(app, http, auth, services):
    assert not tracing.active()
    assert isinstance(app.wsgi_app, Lane)
    assert not hasattr(redis.Redis.execute_command, "__wrapped__")
    assert not hasattr(requests.Session.send, "__wrapped__")
    request_id = _submit(http, auth, "untraced")
    assert services.redis.hget(keys.request(request_id), "traceparent") is None
    assert services.store.traceparent(request_id) == ""


def test_on_every_call_goes_through_flask(traced, traced_http, auth):
    assert not isinstance(traced_http.application.wsgi_app, Lane)
    assert hasattr(redis.Redis.execute_command, "__wrapped__")
    request_id = _submit(traced_http, auth, "traced")
    assert traced.store.traceparent(request_id).startswith("00-")
