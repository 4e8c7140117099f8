"""Status polls answered without Flask's per-request machinery.

Status reads are most of the front door's traffic: every client polls every
request it has until it completes. For one of them, Flask's request context,
URL map, hooks and response object cost as much as our own work and the Redis
round trip together (issue 15's profile), so the poll lane sits in front of
the Flask app as WSGI middleware (``app.wsgi_app``) and answers the plain
case itself: a ``GET`` of a status URL, from a workspace's key, on a catalog
model, for a well-formed id. It does what the Flask route does, with the
same functions (``routes.visible_view``, ``routes.status_answer``): the call
is counted in the caller's rate windows inside the read's one script, errors
from then on are rendered as the app renders them, and every answer carries
``X-Comfy-Request-Id``.

Everything else goes to Flask untouched, and is decided before anything is
read or counted: other methods and paths, a path werkzeug would route
differently (an empty or non-ASCII segment), a missing or unknown key, a
legacy key, an unknown model, a malformed id. Flask answers those as it always
did, counting them once.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable, Iterable

import redis
from flask import Flask
from werkzeug.http import HTTP_STATUS_CODES

from ..errors import InternalError, RouterError, ServiceUnavailable, Unauthorized
from ..store.ids import well_formed
from .front import FrontDoor
from .ratelimit import RateLimits
from .routes import base_url, status_answer, visible_view
from .views import json_text

log = logging.getLogger(__name__)

#: ``/v2/models/{provider}/{model}/requests/{id}/status`` split on "/".
_SEGMENTS = 8
_STATUS_LINES = {code: f"{code} {phrase.upper()}" for code, phrase in HTTP_STATUS_CODES.items()}

StartResponse = Callable[..., object]
WSGIApp = Callable[[dict, StartResponse], Iterable[bytes]]


class PollLane:
    """WSGI middleware: status reads answered here, the rest by ``app``."""

    def __init__(self, app: Flask, front: FrontDoor, rate_limits: RateLimits):
        self.flask = app.wsgi_app
        self.request_class = app.request_class
        self.front = front
        self.rate_limits = rate_limits

    def __call__(self, environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        parts = environ.get("PATH_INFO", "").split("/")
        if (len(parts) != _SEGMENTS or parts[7] != "status" or parts[5] != "requests" or parts[2] != "models"
                or parts[1] != "v2" or parts[0] or environ.get("REQUEST_METHOD") != "GET"
                or not all(parts[3:7]) or not environ["PATH_INFO"].isascii()):
            return self.flask(environ, start_response)
        _, _, _, provider, model, _, request_id, _ = parts
        front = self.front
        entry = front.services.catalog.get(provider, model)
        if entry is None or not well_formed(request_id):
            return self.flask(environ, start_response)
        request = self.request_class(environ)
        try:
            caller = front.keys.caller(request)
        except Unauthorized:
            return self.flask(environ, start_response)
        if caller.legacy:
            return self.flask(environ, start_response)
        try:
            view = visible_view(front, caller.workspace, entry, request_id, self.rate_limits.for_workspace(caller))
            body, headers = status_answer(front, view, base_url(front, request))
            status = 200
        except RouterError as error:
            body, headers, status = error.body(), error.headers(), error.status
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            log.warning("redis unreachable: %s", exc)
            error = ServiceUnavailable("the request store is briefly unreachable; retry shortly", retry_after=1)
            body, headers, status = error.body(), error.headers(), error.status
        except Exception:  # noqa: BLE001 - answered as the app's last-resort handler answers
            log.exception("unhandled error")
            error = InternalError("an internal error occurred; quote X-Comfy-Request-Id to support")
            body, headers, status = error.body(), error.headers(), error.status
        data = json_text(body).encode()
        start_response(_STATUS_LINES[status], [
            *headers.items(), ("Content-Type", "application/json"), ("Content-Length", str(len(data))),
            ("X-Comfy-Request-Id", str(uuid.uuid4())),
        ])
        return [data]
