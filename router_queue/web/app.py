"""The Flask app factory: the front door of the queue."""

from __future__ import annotations

import uuid

from flask import Flask, Response, g, request

from .. import tracing
from ..broker.celery_app import make_celery
from ..broker.dispatch import Dispatcher
from ..errors import RateLimited, RouterError
from ..services import Services
from ..settings import Settings
from ..store.held import HeldSlots
from .auth import KeyResolver
from .catalog_routes import discovery
from .stream import EventHub
from .front import EXTENSION, FrontDoor
from .headers import EVERY_ANSWER
from .history import history
from .lane import Lane
from .operations import operations
from .ratelimit import CARRIED_ENDPOINTS, RateLimits
from .refusals import as_router_error
from .routes import queue
from .bodies import json_response


def create_app(settings: Settings | None = None, *, services: Services | None = None,
               dispatcher: Dispatcher | None = None) -> Flask:
    """Build the front door. Tests pass ``services`` (fakeredis) and a ``dispatcher``."""
    settings = settings or Settings.from_env()
    services = services or Services.build(settings, wait_s=settings.front_door_redis_wait_s,
                                          write_deadline_s=settings.front_door_redis_wait_s)
    if dispatcher is None:
        dispatcher = Dispatcher(make_celery(settings), services.store, providers=tuple(services.catalog.providers()),
                                broker_is_store=settings.effective_broker_url == settings.redis_url)
    app = Flask(__name__, static_folder=None, template_folder="templates")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    keys = KeyResolver(services.accounts)
    front = app.extensions[EXTENSION] = FrontDoor(services, dispatcher, keys, EventHub(services.store),
                                                  HeldSlots(services.redis))
    app.register_blueprint(queue)
    app.register_blueprint(history)
    app.register_blueprint(discovery)
    _register_error_handlers(app)
    app.register_blueprint(operations)
    rate_limits = RateLimits(services.store, settings.default_rate_limit, keys)
    if tracing.active():
        # Every call through Flask, as a span: the lane steps aside (it would
        # answer submits and polls outside Flask's instrumentation).
        tracing.instrument_flask(app)
    else:
        app.wsgi_app = Lane(app, front, rate_limits)  # type: ignore[method-assign]

    @app.before_request
    def _open_call() -> None:
        """Count the call against the caller's rate."""
        allowance = rate_limits.allowance(request)
        if allowance is None:
            return
        if request.endpoint in CARRIED_ENDPOINTS:
            g.rate_allowance = allowance  # the route's own script counts it
        else:
            rate_limits.spend(allowance)

    @app.after_request
    def _close_call(response: Response) -> Response:
        """A carried allowance the route ended without spending (it refused
        the call before its script ran) is counted now, and a spent window
        answers 429 in place of the route's answer, as if checked first.
        Every answer carries the call's id (``X-Comfy-Request-Id``): the
        request id a route admitted, else a fresh one."""
        allowance = g.pop("rate_allowance", None)
        if allowance is not None:
            try:
                rate_limits.spend(allowance)
            except RateLimited as exc:
                response = _render(exc)
        response.headers["X-Comfy-Request-Id"] = g.get("call_id") or str(uuid.uuid4())
        response.headers.update(EVERY_ANSWER)
        return response
    return app


def _render(error: RouterError) -> Response:
    return json_response(error.body(), error.status, error.headers())


def _register_error_handlers(app: Flask) -> None:
    """Every exception a route lets out, werkzeug's HTTP refusals included
    (Flask finds a handler along the exception's MRO), answered by one mapping."""
    def _answer(exc: Exception) -> Response:
        return _render(as_router_error(exc, path=request.path, max_body=app.config["MAX_CONTENT_LENGTH"]))

    app.register_error_handler(Exception, _answer)
