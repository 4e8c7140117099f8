"""What a hostile caller can send costs little and breaks nothing, against the
real stack (gunicorn, workers, stub, redis-server): a malformed id is 404 on
every request route, never 500; a hostile 1 MB body is refused with a small
answer, and the next caller is served as usual."""

from __future__ import annotations

import json

import pytest

from .harness import FLUX, GEMINI, ApiClient, unique_prompt, wait_for

NOT_FOUND = {"error_type": "request_not_found", "detail": "no such request for this caller and model"}


@pytest.mark.parametrize("tail", ["%0A", "%0D%0A", "%00", "%20", "0"])
def test_an_id_with_a_trailing_byte_is_404_on_every_request_route(caller: ApiClient, tail: str) -> None:
    """``{id}%0A`` was a 500 with a traceback: ``$`` let the newline through."""
    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("teapot")})
    for method, suffix in (("GET", "/status"), ("GET", ""), ("PUT", "/cancel"), ("GET", "/events")):
        response = caller.session.request(method, caller.url(FLUX, request_id + tail, suffix),
                                          headers=caller.headers(), timeout=10)
        assert response.status_code == 404, (method, suffix, response.status_code, response.text)
        assert response.json() == NOT_FOUND
        assert response.headers["X-Comfy-Error-Type"] == "request_not_found"
    assert caller.session.get(caller.url(FLUX, request_id, "/status"), headers=caller.headers(),
                              timeout=10).status_code == 200


def _compact(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def test_a_hostile_body_is_refused_small_and_the_next_request_is_served(caller: ApiClient) -> None:
    prompt = {"contents": [{"role": "user", "parts": [{"text": unique_prompt("a cat")}]}]}
    hostile = {**prompt, **{f"k{i}": 1 for i in range(90_000)}}  # the report's 1 MB body
    many_bad = {"contents": [{"role": "robot", "parts": [{"text": 1}] * 4}] * 64}
    gs = {"contents": [{"parts": [{"fileData": {"mimeType": "image/png", "fileUri": "gs://our-bucket/x.png"}}]}]}
    headers = caller.headers({"Content-Type": "application/json"})
    for body, first_type in ((hostile, "too_long"), (many_bad, "enum"), (gs, "url_scheme")):
        raw = _compact(body)
        assert len(raw) < 1_048_576
        response = caller.session.post(caller.url(GEMINI), data=raw, headers=headers, timeout=30)
        assert response.status_code == 422, response.text[:500]
        assert len(response.content) < 16 * 1024
        assert response.headers["X-Comfy-Error-Type"] == "invalid_input"
        detail = response.json()["detail"]
        assert detail[0]["type"] == first_type and len(detail) <= 11
    deep = caller.session.post(caller.url(GEMINI), data=b"[" * 1_000_000, headers=headers, timeout=30)
    assert deep.status_code == 400, deep.text[:300]  # the parser's recursion limit, answered as input
    assert deep.json()["error_type"] == "invalid_input"
    request_id = caller.submit_ok(GEMINI, prompt)

    def completed() -> bool:
        status = caller.session.get(caller.url(GEMINI, request_id, "/status"), headers=caller.headers(), timeout=10)
        return status.json().get("status") == "COMPLETED"

    wait_for(completed, what="the next request completed")
    result = caller.session.get(caller.url(GEMINI, request_id), headers=caller.headers(), timeout=10)
    assert result.status_code == 200, result.text[:300]
