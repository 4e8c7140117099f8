"""The Flask app factory: the front door of the queue."""

from __future__ import annotations

from flask import Flask, Response, g, request

from .. import tracing
from ..broker.celery_app import make_celery
from ..errors import RouterError
from ..services import Services
from ..settings import Settings
from ..store.connect import UNREACHABLE
from ..store.held import HeldSlots
from .auth import KeyResolver
from .batches import batches
from .bodies import json_response
from .bulk import bulk
from .callers import TrustedProxies
from .catalog_routes import discovery
from .envelope import ENVELOPE, Envelope
from .front import EXTENSION, FrontDoor
from .history import history
from .lane import Lane
from .operations import operations
from .ratelimit import RateLimits
from .readiness import READINESS, Readiness
from .routes import queue
from .stream import EventHub
from .usage import usage


def create_app(settings: Settings | None = None, *, services: Services | None = None) -> Flask:
    """Build the front door. Tests pass ``services`` (fakeredis, a stand-in dispatcher)."""
    settings = settings or Settings.from_env()
    wait_s = settings.front_door_redis_wait_s
    services = services or Services.build(settings, celery=make_celery(settings, broker_wait_s=wait_s),
                                          wait_s=wait_s, write_deadline_s=wait_s)
    dispatcher = services.dispatcher
    if dispatcher is None:
        raise ValueError("the front door publishes deliveries: build its Services with a Celery app")
    try:
        services.accounts.epoch.check()  # the data this process serves, as it starts (store/epoch.py)
    except UNREACHABLE:
        pass  # adopted at the first check that reaches Redis
    app = Flask(__name__, static_folder=None, template_folder="templates")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    keys = KeyResolver(services.accounts)
    front = app.extensions[EXTENSION] = FrontDoor(services, dispatcher, keys, EventHub(services.store),
                                                  HeldSlots(services.redis))
    app.register_blueprint(queue)
    app.register_blueprint(history)
    app.register_blueprint(usage)
    app.register_blueprint(bulk)
    app.register_blueprint(discovery)
    app.register_blueprint(batches)
    rate_limits = RateLimits(services.store, settings.default_rate_limit, keys,
                             TrustedProxies(settings.forwarded_allow_ips))
    app.extensions[READINESS] = Readiness(settings.readyz_cache_s)
    envelope = app.extensions[ENVELOPE] = Envelope(
        rate_limits, settings.max_body_bytes, settings.body_inline_max_bytes if services.blobs is not None else None)
    _register_error_handlers(app, envelope)
    app.register_blueprint(operations)
    if tracing.active():
        # Every call through Flask, as a span: the lane steps aside (it would
        # answer submits and polls outside Flask's instrumentation).
        tracing.instrument_flask(app)
    else:
        app.wsgi_app = Lane(app, front, envelope)  # type: ignore[method-assign]

    @app.before_request
    def _open_call() -> None:
        g.call = envelope.open(request.endpoint, rate_limits.allowance(request), request.headers)

    @app.after_request
    def _close_call(response: Response) -> Response:
        call = g.get("call")
        refused = envelope.settle(call)
        if refused is not None:
            response = _render(refused)
        response.headers.update(envelope.headers(call))
        return response
    return app


def _render(error: RouterError) -> Response:
    return json_response(error.body(), error.status, error.headers())


def _register_error_handlers(app: Flask, envelope: Envelope) -> None:
    """Every exception a route lets out, werkzeug's HTTP refusals included
    (Flask finds a handler along the exception's MRO), answered by the envelope's mapping."""
    def _answer(exc: Exception) -> Response:
        return _render(envelope.refusal(exc, request.path, request.endpoint, request.headers))

    app.register_error_handler(Exception, _answer)
