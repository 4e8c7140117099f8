"""The two hottest routes, status polls and submits, answered in front of Flask.

WSGI middleware in front of the Flask app (``app.wsgi_app``) that answers the
plain cases with the functions the Flask views call (``routes.visible_view``
and ``status_answer``, ``routes.submit_answer``): a status poll for a
well-formed id, and a submit with a ``Content-Length`` within
``MAX_BODY_BYTES``, both from a workspace's key on a catalog model, matched by
their declarations (``paths.py``) and taken through the app's one envelope
(``envelope.py``). Everything else goes to Flask untouched, decided before
anything is read or counted. Why, and what goes to Flask:
``docs/ARCHITECTURE.md``, "The front door's parts".
"""

from __future__ import annotations

from typing import Any, Iterable
from wsgiref.types import StartResponse

from flask import Flask, Request
from werkzeug.http import HTTP_STATUS_CODES

from ..catalog import ModelEntry
from ..errors import Unauthorized
from ..store.ids import well_formed
from . import paths
from .auth import Caller
from .bodies import Answer, json_text
from .envelope import Call, Envelope
from .front import FrontDoor
from .routes import base_url, status_answer, submit_answer, visible_view

#: Status lines as werkzeug writes them ("404 NOT FOUND").
_STATUS_LINES = {code: f"{code} {phrase.upper()}" for code, phrase in HTTP_STATUS_CODES.items()}


class Lane:
    """WSGI middleware: status polls and submits answered here, the rest by Flask."""

    def __init__(self, app: Flask, front: FrontDoor, envelope: Envelope):
        self.flask = app.wsgi_app
        self.request_class = app.request_class
        self.max_body = app.config["MAX_CONTENT_LENGTH"]
        self.front = front
        self.envelope = envelope
        #: The lane's routes by method and number of path segments: the route,
        #: its pattern's parts (``paths.Pattern``), whether a call is plain, its answer.
        self.routes: dict[tuple[str, int], tuple] = {}
        lanes = {paths.STATUS: (self._id_fits, self._status), paths.SUBMIT: (self._body_fits, self._submit)}
        for route in paths.ROUTES:
            if route.lane:
                pattern = paths.Pattern(route)
                self.routes[route.method, pattern.size] = (route, pattern.literal_at, pattern.literals,
                                                           pattern.values_at, *lanes[route])

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """A plain call of a lane route (``paths.Pattern``'s match, inlined) from
        a workspace's key on a catalog model is answered here, through the
        envelope as Flask's hooks would; anything else goes to Flask."""
        path = environ.get("PATH_INFO", "")
        parts = path.split("/")
        lane = self.routes.get((environ.get("REQUEST_METHOD", ""), len(parts)))
        if lane is None:
            return self.flask(environ, start_response)
        route, literal_at, literals, values_at, fits, serve = lane
        values = values_at(parts)
        if literal_at(parts) != literals or not all(values) or not path.isascii() or not fits(environ, values):
            return self.flask(environ, start_response)
        entry = self.front.services.catalog.get(values[0], values[1])
        if entry is None:
            return self.flask(environ, start_response)
        request = self.request_class(environ)
        try:
            caller = self.front.keys.caller(request)
        except Unauthorized:
            return self.flask(environ, start_response)
        except Exception as exc:  # noqa: BLE001 - e.g. Redis down: answered as the app's hook would be
            return self._send(self._refusal(exc, request, route.endpoint), None, start_response)
        if caller.legacy:
            return self.flask(environ, start_response)
        envelope = self.envelope
        call = None
        try:
            call = envelope.open(route.endpoint, envelope.rate_limits.for_workspace(caller), request.headers)
            answer = serve(request, caller, entry, values, call)
        except Exception as exc:  # noqa: BLE001 - every fault has its answer
            answer = self._refusal(exc, request, route.endpoint)
        refused = envelope.settle(call)
        if refused is not None:
            answer = self._refusal(refused, request)
        return self._send(answer, call, start_response)

    @staticmethod
    def _id_fits(environ: dict[str, Any], values: tuple[str, ...]) -> bool:
        return well_formed(values[2])

    def _body_fits(self, environ: dict[str, Any], values: tuple[str, ...]) -> bool:
        length = environ.get("CONTENT_LENGTH", "")
        return length.isdigit() and int(length) <= self.max_body

    def _status(self, request: Request, caller: Caller, entry: ModelEntry, values: tuple[str, ...],
                call: Call) -> Answer:
        front = self.front
        view = visible_view(front, caller.workspace, entry, values[2], call.take(), replica=True)
        return status_answer(front, view, base_url(front, request))

    def _submit(self, request: Request, caller: Caller, entry: ModelEntry, values: tuple[str, ...],
                call: Call) -> Answer:
        request.max_content_length = self.max_body
        answer = submit_answer(self.front, request, values[0], values[1], call.take)
        call.id = answer.call_id
        return answer

    def _refusal(self, exc: BaseException, request: Request, endpoint: str | None = None) -> Answer:
        error = self.envelope.refusal(exc, request.path, endpoint, request.headers)
        return Answer(error.status, error.body(), error.headers())

    def _send(self, answer: Answer, call: Call | None, start_response: StartResponse) -> Iterable[bytes]:
        data = json_text(answer.body).encode()
        start_response(_STATUS_LINES[answer.status], [
            *answer.headers.items(), ("Content-Type", "application/json"), ("Content-Length", str(len(data))),
            *self.envelope.headers(call),
        ])
        return [data]
