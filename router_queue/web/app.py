"""The Flask app factory: the front door of the queue."""

from __future__ import annotations

import logging
import re
import uuid

import redis
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from ..broker.celery_app import make_celery
from ..broker.dispatch import Dispatcher
from ..errors import (InternalError, InvalidInput, MethodNotAllowed, ModelNotFound, PayloadTooLarge, RateLimited,
                      RequestNotFound, RouterError, ServiceUnavailable)
from ..services import Services
from ..settings import Settings
from .auth import KeyResolver
from .catalog_routes import discovery
from .events import EventHub
from .front import EXTENSION, FrontDoor
from .operations import operations
from .poll_lane import PollLane
from .ratelimit import CARRIED_ENDPOINTS, RateLimits
from .routes import NOT_FOUND, queue
from .views import json_response

log = logging.getLogger(__name__)

#: Paths that address a request; a miss under one is request_not_found.
_REQUEST_PATH = re.compile(r"^/v2/models/[^/]+/[^/]+/requests/.")


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
    front = app.extensions[EXTENSION] = FrontDoor(services, dispatcher, keys, EventHub(services.store))
    app.register_blueprint(queue)
    app.register_blueprint(discovery)
    _register_error_handlers(app)
    app.register_blueprint(operations)
    rate_limits = RateLimits(services.store, settings.default_rate_limit, keys)
    app.wsgi_app = PollLane(app, front, rate_limits)  # type: ignore[method-assign]

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
        return response
    return app


def _render(error: RouterError) -> Response:
    return json_response(error.body(), error.status, error.headers())


def _register_error_handlers(app: Flask) -> None:
    app.register_error_handler(RouterError, _render)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        if exc.code == 413:
            return _render(PayloadTooLarge(f"the body is larger than {app.config['MAX_CONTENT_LENGTH']} bytes"))
        if exc.code == 404:
            if _REQUEST_PATH.match(request.path):  # e.g. an id holding an encoded slash
                return _render(RequestNotFound(NOT_FOUND))
            return _render(ModelNotFound("no such route; models live under /v2/models/{provider}/{model}"))
        if exc.code == 405:
            return _render(MethodNotAllowed(f"{exc.description}"))
        error = InvalidInput(exc.description or exc.name)
        error.status = exc.code or 400
        return _render(error)

    @app.errorhandler(redis.exceptions.ConnectionError)
    @app.errorhandler(redis.exceptions.TimeoutError)
    def _redis_down(exc: Exception) -> Response:
        log.warning("redis unreachable: %s", exc)
        return _render(ServiceUnavailable("the request store is briefly unreachable; retry shortly", retry_after=1))

    @app.errorhandler(Exception)
    def _bug(exc: Exception) -> Response:
        log.exception("unhandled error")
        return _render(InternalError("an internal error occurred; quote X-Comfy-Request-Id to support"))
