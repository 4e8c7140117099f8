"""What a hostile caller can send costs little and breaks nothing, against the
real stack (gunicorn, workers, stub, redis-server): a malformed id is 404 on
every request route, never 500."""

from __future__ import annotations

import pytest
import requests

from .harness import FLUX, Caller, unique_prompt

pytestmark = pytest.mark.integration

NOT_FOUND = {"error_type": "request_not_found", "detail": "no such request for this caller and model"}


@pytest.mark.parametrize("tail", ["%0A", "%0D%0A", "%00", "%20", "0"])
def test_an_id_with_a_trailing_byte_is_404_on_every_request_route(caller: Caller, tail: str) -> None:
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
