"""What the front door's gunicorn worker answers for requests gunicorn itself refuses."""

from __future__ import annotations

import json

import pytest
from gunicorn.http import errors as http_errors

from router_queue.gunicorn_worker import refusal


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
