"""A store that lost its data is refused loudly, not served as an empty one
(``router_queue/store/epoch.py``)."""

from __future__ import annotations

import logging

import pytest

from router_queue.errors import StoreLost
from router_queue.store import keys
from tests.unit.test_delivery import context_of
from tests.unit.test_routes import FLUX, assert_error, submit
from workers.sweeper import sweep


def test_a_store_emptied_under_a_serving_front_door_is_503_not_401(http, auth, services, client,
                                                                   caplog: pytest.LogCaptureFixture):
    request_id = submit(http, auth, {"prompt": "before the loss"}).json["request_id"]
    assert http.get("/readyz").status_code == 200  # the marker written with the workspace, adopted
    client.flushdb()  # what a Redis restarted without its append-only file holds
    with caplog.at_level(logging.CRITICAL):
        unknown = http.get(f"{FLUX}/requests/{request_id}/status", headers={"X-API-Key": "rq_not_cached_here"})
        ready = http.get("/readyz")
    assert_error(unknown, 503, "service_unavailable")
    assert int(unknown.headers["Retry-After"]) >= 1
    assert_error(ready, 503, "service_unavailable")
    assert "lost its data" in ready.json["detail"]
    assert "the store lost its data" in caplog.text
    with pytest.raises(StoreLost):
        sweep(context_of(services))


def test_a_new_deployment_is_no_false_alarm(http, services):
    """No workspace yet: an unknown key is 401, and ready; the first workspace marks the store."""
    assert_error(http.get(f"{FLUX}/requests/x/status", headers={"X-API-Key": "rq_unknown"}), 401, "unauthorized")
    assert http.get("/readyz").status_code == 200
    services.accounts.create_workspace("first")
    assert services.redis.get(keys.epoch()) is not None
    assert http.get("/readyz").status_code == 200  # the marker adopted, not taken for a replacement
    assert_error(http.get(f"{FLUX}/requests/x/status", headers={"X-API-Key": "rq_unknown"}), 401, "unauthorized")


def test_data_from_before_the_marker_is_marked_not_refused(http, services, workspace):
    services.redis.delete(keys.epoch())
    services.accounts.epoch.known = None  # a process started on data from before the marker
    assert http.get("/readyz").status_code == 200
    assert services.redis.get(keys.epoch()) is not None
    assert http.get("/readyz").status_code == 200


def test_a_process_that_started_on_an_empty_store_adopts_the_marker_at_its_first_key(http, auth, services, client):
    """Booted before the first workspace, it never checked; its first resolved key adopts the marker."""
    services.accounts.epoch.known = None
    assert submit(http, auth, {"prompt": "the first call"}).status_code == 201
    client.flushdb()
    assert_error(http.get(f"{FLUX}/requests/x/status", headers={"X-API-Key": "rq_other"}), 503,
                 "service_unavailable")
