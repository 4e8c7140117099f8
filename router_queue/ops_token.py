"""The operator listeners' token (``OPS_TOKEN``): what they ask of a call.

A scraper sends ``Authorization: Bearer <token>``; a browser, answered with a
``Basic`` challenge, asks its user and sends the token as the password (any
user name). Compared in constant time. The gunicorn listener's check is in
``web/operations.py``; a worker's metrics endpoint is :func:`serve_metrics`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import socket
import threading
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

#: The challenge a refused call gets: Basic first, so a browser asks for it.
CHALLENGE = 'Basic realm="router-queue operator", charset="UTF-8", Bearer realm="router-queue operator"'


def presented(authorization: str) -> str:
    """The token a call's ``Authorization`` header carries ("" for none)."""
    scheme, _, credentials = authorization.strip().partition(" ")
    scheme, credentials = scheme.lower(), credentials.strip()
    if scheme == "bearer":
        return credentials
    if scheme == "basic":
        try:
            return base64.b64decode(credentials, validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return ""
    return ""


def admits(authorization: str | None, token: str) -> bool:
    """Whether a call with this header may in: always when no token is set."""
    if not token:
        return True
    return hmac.compare_digest(presented(authorization or "").encode(), token.encode())


def guarded(app: Callable, token: str) -> Callable:
    """``app`` (WSGI) behind the token: a call without it gets 401."""
    def guard(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        if admits(environ.get("HTTP_AUTHORIZATION"), token):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", CHALLENGE), ("Content-Type", "text/plain")])
        return [b"the operator listener asks for OPS_TOKEN (Authorization: Bearer <token>)\n"]
    return guard


def serve_metrics(port: int, addr: str, registry: Any, token: str) -> WSGIServer | None:
    """A worker's ``/metrics`` on ``addr:port`` in a daemon thread, as
    prometheus_client's ``start_http_server`` serves it, behind ``token`` when set."""
    if not token:
        start_http_server(port, addr=addr, registry=registry)
        return None

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    server = make_server(addr, port, guarded(make_wsgi_app(registry), token), Server, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
