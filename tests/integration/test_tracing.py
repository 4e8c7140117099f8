"""OpenTelemetry through real processes: with ``OTEL_EXPORTER_OTLP_ENDPOINT``
naming a collector, the front door (gunicorn), the provider worker and the
webhooks worker (Celery) export over OTLP/HTTP, and one request's spans, from
its submit to its webhook attempt, share one trace id: the caller's, when it
sent a ``traceparent``.

The collector is a loopback HTTP server of this test's, decoding each export
request with ``opentelemetry-proto``.
"""

from __future__ import annotations

import gzip
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from router_queue.webhooks.event import new_secret

from .harness import FLUX, RunningStack, make_caller, private_stack, unique_prompt, wait_for

SUBMIT_SPAN = "POST /v2/models/<provider>/<model>/requests"
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"


class Collector:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every span it is sent, as
    (trace id, span name, the exporting service's name)."""

    def __init__(self):
        self.spans: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                export = ExportTraceServiceRequest.FromString(data)
                with collector.lock:
                    for resource_spans in export.resource_spans:
                        service = next((a.value.string_value for a in resource_spans.resource.attributes
                                        if a.key == "service.name"), "")
                        for scope_spans in resource_spans.scope_spans:
                            collector.spans += [(s.trace_id.hex(), s.name, service) for s in scope_spans.spans]
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def traces(self) -> dict[str, set[tuple[str, str]]]:
        """(span name, service) by trace id."""
        with self.lock:
            by_trace: dict[str, set[tuple[str, str]]] = defaultdict(set)
            for trace, name, service in self.spans:
                by_trace[trace].add((name, service))
            return by_trace

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Receiver:
    """A webhook receiver on 127.0.0.1 answering 204."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    made = Collector()
    yield made
    made.stop()


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> Iterator[RunningStack]:
    """A stack of its own (its Redis too) exporting to the collector, its
    span batches sent every 200 ms."""
    settings = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "200",
                "WEBHOOK_ALLOW_LOOPBACK_HTTP": "1"}
    with private_stack(tmp_path_factory, "traced", settings, webhooks=True) as running:
        yield running


def test_web_worker_and_webhook_spans_of_a_request_share_its_trace(traced_stack: RunningStack,
                                                                   collector: Collector) -> None:
    receiver = Receiver()
    try:
        with make_caller(traced_stack, "traced") as caller:
            traced_stack.services.accounts.webhook_secret(caller.workspace, new_secret())
            traced_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("traced")}, headers={
                "traceparent": f"00-{CALLER_TRACE}-b7ad6b7169203331-01", "X-Comfy-Webhook-Url": receiver.url})
            fresh_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("a trace of its own")})
            for request_id in (traced_id, fresh_id):
                assert "error_type" not in caller.wait_status(FLUX, request_id)
    finally:
        receiver.stop()

    web, worker = "router-queue-web", "router-queue-worker"
    whole = {(SUBMIT_SPAN, web), ("EVALSHA", web), ("deliver", worker), ("provider call", worker),
             ("POST", worker), ("complete", worker)}
    wait_for(lambda: whole | {("webhook attempt", worker)} <= collector.traces()[CALLER_TRACE], timeout_s=30,
             what="the traced request's spans at the collector")

    # The other request: a trace of its own, begun by its submit, with its worker's spans in it.
    wait_for(lambda: any(whole <= spans for trace, spans in collector.traces().items() if trace != CALLER_TRACE),
             timeout_s=30, what="the untraced request's spans in one new trace")
    # No delivery ran in a trace but its request's (each deliver span sits beside its submit).
    for trace, spans in collector.traces().items():
        if ("deliver", worker) in spans:
            assert (SUBMIT_SPAN, web) in spans, (trace, spans)
