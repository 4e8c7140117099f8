"""How a caller drives the queue routes in the unit tests: submit, read, retry,
what an error answer looks like, and which calls reached Flask."""

from __future__ import annotations

import json

import pytest
from flask import request

from router_queue.store.requests_values import Lease
from tests.unit.support import record_of

LEASE = Lease(token="t", lease_s=30, queue_timeout_s=3600, max_takeovers=3)

FLUX = "/v2/models/bfl/flux-2-pro"


def submit(http, auth, body=None, *, path=FLUX, headers=None, raw=None):
    data = raw if raw is not None else json.dumps(body if body is not None else {"prompt": "a red teapot"})
    return http.post(f"{path}/requests", data=data, headers={**auth, "Content-Type": "application/json",
                                                              **(headers or {})})


def assert_error(response, status, bucket):
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.headers["X-Comfy-Error-Type"] == bucket
    assert response.json["error_type"] == bucket
    assert response.json["detail"]
    assert response.headers["X-Comfy-Request-Id"]


FAILED_BODY = {"prompt": "a teapot that failed once", "seed": 7}


def retry(http, auth, request_id, *, headers=None, path=FLUX):
    return http.post(f"{path}/requests/{request_id}/retry", headers={**auth, **(headers or {})})


def status_of(http, auth, request_id, path=FLUX):
    response = http.get(f"{path}/requests/{request_id}/status", headers=auth)
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.json


def failed(http, auth, services, body=FAILED_BODY, error_type="provider_error", **headers):
    """A request that ran and failed with ``error_type``."""
    request_id = submit(http, auth, body, headers=headers).json["request_id"]
    services.store.claim(record_of(services, request_id, "bfl"), LEASE)
    services.store.complete(record_of(services, request_id, "bfl"), error_type=error_type, detail="it broke")
    return request_id


def assert_refusal(response, status, bucket, retry_after=False):
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.headers["X-Comfy-Error-Type"] == bucket == response.json["error_type"]
    assert response.json["detail"]
    assert ("Retry-After" in response.headers) == retry_after
    if retry_after:
        assert int(response.headers["Retry-After"]) >= 1


@pytest.fixture
def served_by_flask(app) -> list[str]:
    """Paths of the calls that reached Flask's request handling."""
    reached: list[str] = []

    @app.before_request
    def _note() -> None:
        reached.append(request.path)

    return reached
