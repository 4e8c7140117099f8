"""OpenTelemetry: one trace per request, from its submit to its webhook; off (nothing
imported) unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set. Why the trace travels on the
request's record, and which spans exist: docs/ARCHITECTURE.md, "Tracing"."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from flask import Flask
    from opentelemetry.sdk.trace import TracerProvider

    from .settings import Settings

#: The spans' instrumentation scope.
SCOPE = "router_queue"

_NO_SPAN: ContextManager[None] = nullcontext()
#: This process's tracer, once tracing is on; None while off.
_tracer: Any = None
_provider: "TracerProvider | None" = None


def active() -> bool:
    """Whether this process traces."""
    return _tracer is not None


def configure(settings: "Settings", service: str, *, provider: "TracerProvider | None" = None) -> bool:
    """Turn tracing on for this process when ``settings`` name an OTLP
    endpoint (or a test hands its own ``provider``); returns whether it is on.
    Call it once, at the process's entry point, before the app is built."""
    global _tracer, _provider
    if _tracer is not None:
        return True
    if provider is None:
        if not settings.otel_endpoint:
            return False
        provider = _exporting_provider(settings.otel_endpoint, service)
    from opentelemetry.instrumentation.redis import RedisInstrumentor
    from opentelemetry.instrumentation.requests import RequestsInstrumentor

    RedisInstrumentor().instrument(tracer_provider=provider)
    RequestsInstrumentor().instrument(tracer_provider=provider)
    _provider, _tracer = provider, provider.get_tracer(SCOPE)
    return True


def unconfigure() -> None:
    """Turn tracing off again (tests): the libraries uninstrumented."""
    global _tracer, _provider
    if _tracer is None:
        return
    from opentelemetry.instrumentation.redis import RedisInstrumentor
    from opentelemetry.instrumentation.requests import RequestsInstrumentor

    RedisInstrumentor().uninstrument()
    RequestsInstrumentor().uninstrument()
    _tracer = _provider = None


def _exporting_provider(endpoint: str, service: str) -> "TracerProvider":
    """A provider batching spans to ``endpoint``'s OTLP/HTTP traces path,
    sampling every request (the parent decides) and no stray root command."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}), sampler=sampler())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    trace.set_tracer_provider(provider)
    return provider


def sampler():
    """Every span whose parent is sampled, and every root span but a client
    one (a Redis command or an HTTP call made outside any request or task)."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult
    from opentelemetry.trace import SpanKind

    class _NoStrayClients(Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                          trace_state=None):
            if kind is SpanKind.CLIENT:
                return SamplingResult(Decision.DROP)
            return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return "NoStrayClients"

    return ParentBased(root=_NoStrayClients())


def instrument_flask(app: "Flask") -> None:
    """Flask's instrumentation on ``app``: a server span per call, continuing
    the caller's ``traceparent`` header when it sends one."""
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    FlaskInstrumentor.instrument_app(app, tracer_provider=_provider)


def traceparent() -> str:
    """The current span's W3C ``traceparent``, for the record; "" when off."""
    if _tracer is None:
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


def span(name: str, *, parent: str | None = None, kind: str = "INTERNAL",
         attributes: dict[str, Any] | None = None) -> ContextManager[Any]:
    """A span of this process's tracer (a no-op when off): the child of the
    current span or, given ``parent`` (a ``traceparent``; "" or malformed
    starts a new trace), of that one. ``kind`` names a ``SpanKind``. An
    exception leaving it is not recorded (a delivery's planned retry leaves
    by one): the caller notes the outcome with :func:`note`."""
    if _tracer is None:
        return _NO_SPAN
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = None
    if parent is not None:
        context = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else Context()
    return _tracer.start_as_current_span(name, context=context, kind=SpanKind[kind], attributes=attributes,
                                         record_exception=False, set_status_on_exception=False)


def note(current: Any, **attributes: Any) -> None:
    """Set ``attributes`` (``router_queue.<name>``) on a span :func:`span`
    opened; nothing when tracing is off (its span is None)."""
    if current is not None:
        for name, value in attributes.items():
            current.set_attribute(f"{SCOPE}.{name}", value)
