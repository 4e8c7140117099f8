"""The stub provider's Flask app: provider blueprints plus test-only routes.

`clock` and `sleep` are injectable so unit tests can move time without
waiting; the server process uses the real monotonic clock and sleep.
"""

from __future__ import annotations

import time
from typing import Callable

from flask import Flask, Response

from . import bfl, openai_tts, vertex
from .state import StubState
from .wire import json_response, state


def create_app(
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Flask:
    """Build a stub app with fresh in-memory state.

    clock: returns seconds (monotonic); BFL latency is measured with it.
    sleep: blocks for seconds; used by `hang` and synchronous `latency`.
    """
    app = Flask(__name__)
    app.extensions["stub_provider"] = StubState(clock=clock, sleep=sleep)
    app.register_blueprint(bfl.bp)
    app.register_blueprint(vertex.bp)
    app.register_blueprint(openai_tts.bp)

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok", mimetype="text/plain")

    @app.get("/stub/calls")
    def calls() -> Response:
        """{"submits": {"<route>:<body digest>": n}, "total": {"<route>": n}, "by_key": {"<route>:<key>": n}}."""
        return json_response(state().snapshot())

    @app.post("/stub/reset")
    def reset() -> Response:
        state().reset()
        return json_response({"status": "reset"})

    return app
