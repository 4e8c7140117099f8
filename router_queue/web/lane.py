"""The two hottest routes, status polls and submits, answered in front of Flask.

Every client polls each request it has until it completes, and submits are
the rest of a queue's traffic. For one of those calls Flask's request
context, URL map, hooks and response object cost as much as our own work and
the Redis round trip together (issue 15's profiles), so the lane sits in
front of the Flask app as WSGI middleware (``app.wsgi_app``) and answers the
plain cases itself, with the functions the Flask views call
(``routes.visible_view`` and ``status_answer``, ``routes.submit_answer``):

* ``GET /v2/models/{provider}/{model}/requests/{id}/status`` for a well-formed id;
* ``POST /v2/models/{provider}/{model}/requests`` with a ``Content-Length``
  within ``MAX_BODY_BYTES``;

both from a workspace's key, on a catalog model. What the app's hooks do,
the lane does too: the call is counted in the caller's rate windows (inside
the route's one script, else after it, when a spent window answers 429 in the
route's place); every answer carries ``X-Comfy-Request-Id``; every fault is
answered as the app answers it (``refusals.as_router_error``).

Everything else goes to Flask untouched, decided before anything is read or
counted: other methods and paths, a path werkzeug would route differently (an
empty or non-ASCII segment), a missing, unknown or legacy key, an unknown
model, a malformed id, a chunked or oversized body. Flask answers those as it
always did, counting each once.
"""

from __future__ import annotations

import uuid
from typing import Callable, Iterable

from flask import Flask, Request
from werkzeug.http import HTTP_STATUS_CODES

from ..catalog import ModelEntry
from ..errors import RateLimited, Unauthorized
from ..store.ids import well_formed
from .auth import Caller
from .front import FrontDoor
from .headers import EVERY_ANSWER
from .ratelimit import Allowance, RateLimits
from .refusals import as_router_error
from .routes import base_url, status_answer, submit_answer, visible_view
from .bodies import Answer, json_text

StartResponse = Callable[..., object]
#: "/v2/models/{provider}/{model}/requests" split on "/", and with "/{id}/status".
_SUBMIT_SEGMENTS, _STATUS_SEGMENTS = 6, 8
#: Status lines as werkzeug writes them ("404 NOT FOUND").
_STATUS_LINES = {code: f"{code} {phrase.upper()}" for code, phrase in HTTP_STATUS_CODES.items()}


class Lane:
    """WSGI middleware: status polls and submits answered here, the rest by Flask."""

    def __init__(self, app: Flask, front: FrontDoor, rate_limits: RateLimits):
        self.flask = app.wsgi_app
        self.request_class = app.request_class
        self.max_body = app.config["MAX_CONTENT_LENGTH"]
        self.front = front
        self.rate_limits = rate_limits

    def __call__(self, environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        parts = path.split("/")
        method = environ.get("REQUEST_METHOD")
        if (len(parts) < _SUBMIT_SEGMENTS or parts[0] or parts[1] != "v2" or parts[2] != "models"
                or parts[5] != "requests" or not parts[3] or not parts[4] or not path.isascii()):
            return self.flask(environ, start_response)
        if method == "GET" and len(parts) == _STATUS_SEGMENTS and parts[7] == "status" and parts[6]:
            serve = self._status
        elif method == "POST" and len(parts) == _SUBMIT_SEGMENTS and self._body_fits(environ):
            serve = self._submit
        else:
            return self.flask(environ, start_response)
        entry = self.front.services.catalog.get(parts[3], parts[4])
        if entry is None:
            return self.flask(environ, start_response)
        request = self.request_class(environ)
        try:
            caller = self.front.keys.caller(request)
        except Unauthorized:
            return self.flask(environ, start_response)
        except Exception as exc:  # noqa: BLE001 - e.g. Redis down: answered as the app's hook would be
            return self._send(self._refusal(exc, request), start_response)
        if caller.legacy:
            return self.flask(environ, start_response)
        return serve(request, caller, entry, parts, start_response)

    def _body_fits(self, environ: dict) -> bool:
        length = environ.get("CONTENT_LENGTH", "")
        return length.isdigit() and int(length) <= self.max_body

    def _status(self, request: Request, caller: Caller, entry: ModelEntry, parts: list[str],
                start_response: StartResponse) -> Iterable[bytes]:
        request_id = parts[6]
        if not well_formed(request_id):
            return self.flask(request.environ, start_response)
        front = self.front
        try:
            view = visible_view(front, caller.workspace, entry, request_id, self.rate_limits.for_workspace(caller))
            answer = status_answer(front, view, base_url(front, request))
        except Exception as exc:  # noqa: BLE001 - every fault has its answer
            answer = self._refusal(exc, request)
        return self._send(answer, start_response)

    def _submit(self, request: Request, caller: Caller, entry: ModelEntry, parts: list[str],
                start_response: StartResponse) -> Iterable[bytes]:
        request.max_content_length = self.max_body
        allowance = self.rate_limits.for_workspace(caller)
        carried: list[Allowance] = []

        def rate() -> Allowance:
            carried.append(allowance)
            return allowance

        try:
            answer = submit_answer(self.front, request, parts[3], parts[4], rate)
        except Exception as exc:  # noqa: BLE001 - every fault has its answer
            answer = self._refusal(exc, request)
        if not carried:  # refused before the admit script ran: counted now, as the app's hook does
            try:
                self.rate_limits.spend(allowance)
            except RateLimited as exc:
                answer = self._refusal(exc, request)
        return self._send(answer, start_response)

    def _refusal(self, exc: Exception, request: Request) -> Answer:
        error = as_router_error(exc, path=request.path, max_body=self.max_body)
        return Answer(error.status, error.body(), error.headers())

    @staticmethod
    def _send(answer: Answer, start_response: StartResponse) -> Iterable[bytes]:
        data = json_text(answer.body).encode()
        start_response(_STATUS_LINES[answer.status], [
            *answer.headers.items(), ("Content-Type", "application/json"), ("Content-Length", str(len(data))),
            ("X-Comfy-Request-Id", answer.call_id or str(uuid.uuid4())), *EVERY_ANSWER.items(),
        ])
        return [data]
