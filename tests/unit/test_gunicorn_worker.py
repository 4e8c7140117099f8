"""What the front door's gunicorn worker answers for requests gunicorn itself
refuses, and how long it lets a connection take to send a request head."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import pytest
from gunicorn.http import errors as http_errors

from router_queue.web.gunicorn_worker import (
    DEFAULT_HEADER_TIMEOUT_S,
    HEADER_TIMEOUT_ENV,
    GeventWorker,
    header_timeout_s,
    raise_open_file_limit,
    refusal,
)


def _parse(answer: bytes) -> tuple[str, dict[str, str], dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    assert int(headers["Content-Length"]) == len(body)
    return status_line, headers, json.loads(body)


@pytest.mark.parametrize(("exc", "status_line"), [
    (http_errors.LimitRequestLine(9000, 8190), "HTTP/1.1 414 Request-URI Too Long"),
    (http_errors.LimitRequestHeaders("Request Header Fields Too Large"), "HTTP/1.1 431 Request Header Fields Too Large"),
    (http_errors.InvalidHeader("No-Colon-Here"), "HTTP/1.1 400 Bad Request"),
    (http_errors.InvalidRequestLine("GET"), "HTTP/1.1 400 Bad Request"),
])
def test_bad_input_gunicorn_refuses_is_answered_in_the_contracts_shape(exc: Exception, status_line: str) -> None:
    line, headers, body = _parse(refusal(exc))

    assert line == status_line
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Comfy-Error-Type"] == body["error_type"] == "invalid_input"
    assert headers["X-Comfy-Request-Id"]
    assert headers["Connection"] == "close"
    assert str(exc) in body["detail"]


def test_a_quoted_input_is_cut_short_in_the_detail() -> None:
    _, _, body = _parse(refusal(http_errors.InvalidHeader("x" * 10_000)))
    assert len(body["detail"]) < 400


@pytest.mark.parametrize("exc", [
    http_errors.InvalidResponseHeader("X-Bad\r\n"),  # the app's fault: gunicorn's 500
    http_errors.ForbiddenProxyRequest("10.0.0.1"),
    http_errors.NoMoreData(),  # not a refusal at all
    RuntimeError("a bug"),
])
def test_what_is_not_the_clients_bad_input_stays_gunicorns(exc: Exception) -> None:
    assert refusal(exc) is None


# -- the request-head timeout ------------------------------------------------------
#
# The worker serves a socket pair in this process, under gevent (not patched:
# gevent's own sockets), with a 0.3 s head timeout and gunicorn's keep-alive
# at 2 s. Cuts must never come before their bound; the upper bounds leave room
# for a busy machine.

HEAD_S = 0.3
KEEPALIVE_S = 2
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"
ANSWER_BODY = b"ok"
#: How late (s) a cut may come after its bound.
LATE_S = 0.4


class _Log:
    """gunicorn's logger as far as the worker uses it, recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, level: str):
        def record(message: str = "", *args: object, **kwargs: object) -> None:
            self.calls.append((level, message % args if args else str(message)))
        return record

    def access(self, *args: object) -> None:
        self.calls.append(("access", ""))

    def said(self, level: str, words: str) -> bool:
        return any(lvl == level and words in message for lvl, message in self.calls)


class _Listener:
    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", 8000)


def _app(environ: dict, start_response) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(ANSWER_BODY)))])
    return [ANSWER_BODY]


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[GeventWorker]:
    from gunicorn.config import Config

    monkeypatch.setenv(HEADER_TIMEOUT_ENV, str(HEAD_S))
    cfg = Config()
    cfg.set("keepalive", KEEPALIVE_S)
    made = GeventWorker(1, os.getpid(), [], None, 30, cfg, _Log())
    made.wsgi = _app
    try:
        yield made
    finally:
        made.tmp.close()


@pytest.fixture
def connection(worker: GeventWorker) -> Iterator[tuple[Any, Any]]:
    """(the client's socket, the greenlet serving the other end)."""
    gevent = pytest.importorskip("gevent")
    from gevent import socket as gsocket

    served, client = gsocket.socketpair()
    greenlet = gevent.spawn(worker.handle, _Listener(), served, ("127.0.0.1", 50000))
    try:
        yield client, greenlet
    finally:
        client.close()
        greenlet.join(5)
        served.close()


def _closed_after(client: Any, start: float, *, trickle: bytes = b"", every_s: float = 0.05,
                  limit_s: float = 10.0) -> float:
    """Seconds from ``start`` until the server closes, sending ``trickle`` a byte
    at a time meanwhile (nothing when empty); fails if the server writes."""
    client.settimeout(every_s)
    sent = 0
    while time.monotonic() - start < limit_s:
        if sent < len(trickle):
            try:
                client.send(trickle[sent:sent + 1])
                sent += 1
            except OSError:
                pass
        try:
            data = client.recv(4096)
        except TimeoutError:
            continue
        except OSError:  # reset
            data = b""
        assert data == b"", f"the server answered instead of closing: {data!r}"
        return time.monotonic() - start
    pytest.fail(f"still open after {limit_s} s")


def _answer(client: Any, count: int = 1) -> bytes:
    client.settimeout(5)
    got = b""
    while got.count(ANSWER_BODY) < count:
        chunk = client.recv(4096)
        assert chunk, f"closed after {got!r}"
        got += chunk
    return got


def test_the_header_timeout_setting() -> None:
    assert header_timeout_s({}) == DEFAULT_HEADER_TIMEOUT_S == 10.0
    assert header_timeout_s({HEADER_TIMEOUT_ENV: ""}) == DEFAULT_HEADER_TIMEOUT_S
    assert header_timeout_s({HEADER_TIMEOUT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "ten", "inf", "nan"):
        with pytest.raises(ValueError, match=HEADER_TIMEOUT_ENV):
            header_timeout_s({HEADER_TIMEOUT_ENV: bad})


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
        worker: GeventWorker, connection: tuple[Any, Any]) -> None:
    client, _ = connection
    took = _closed_after(client, time.monotonic())
    assert HEAD_S <= took < HEAD_S + LATE_S
    assert worker.log.said("debug", f"no whole request head within {HEAD_S:g} s")
    assert not [call for call in worker.log.calls if call[0] in ("error", "exception", "warning")]


def test_a_first_head_trickled_a_byte_at_a_time_is_cut_at_the_header_timeout(
        connection: tuple[Any, Any]) -> None:
    client, _ = connection
    took = _closed_after(client, time.monotonic(), trickle=b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 1000)
    assert HEAD_S <= took < HEAD_S + LATE_S


def test_between_requests_a_connection_may_idle_for_the_keep_alive(
        worker: GeventWorker, connection: tuple[Any, Any]) -> None:
    client, _ = connection
    client.sendall(REQUEST)
    _answer(client)
    time.sleep(2 * HEAD_S)  # idle past the header timeout, within the keep-alive
    client.sendall(REQUEST)
    _answer(client)
    took = _closed_after(client, time.monotonic())
    assert KEEPALIVE_S <= took < KEEPALIVE_S + LATE_S
    assert not worker.log.said("debug", "no whole request head")  # the keep-alive ending is routine


def test_a_later_head_has_the_header_timeout_from_its_first_byte(connection: tuple[Any, Any]) -> None:
    client, _ = connection
    client.sendall(REQUEST)
    _answer(client)
    time.sleep(2 * HEAD_S)
    started = time.monotonic()
    took = _closed_after(client, started, trickle=b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 1000)
    assert HEAD_S <= took < HEAD_S + LATE_S  # not the keep-alive (2 s) from the last answer


def test_pipelined_requests_are_all_answered(connection: tuple[Any, Any]) -> None:
    client, _ = connection
    client.sendall(REQUEST * 3)
    assert _answer(client, 3).count(b"HTTP/1.1 200 OK") == 3


def test_the_soft_open_file_limit_is_raised_for_the_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    limits = {"now": (1024, 524288)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))

    assert raise_open_file_limit(10_256) == (10_256, 524288)
    assert raise_open_file_limit(500) == (10_256, 524288)  # never lowered
    limits["now"] = (1024, 4096)
    assert raise_open_file_limit(10_256) == (4096, 4096)  # the hard limit is as far as it goes
