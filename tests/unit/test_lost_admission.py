"""A submit whose admission's reply never arrived: Redis ran the script (or
never got it) and the front door's wait ran out. The answer is never a 503
for a request that was admitted: the front door reads the outcome back, and
when Redis does not tell in time, answers that the outcome is unknown."""

from __future__ import annotations

import json
import time

import pytest
import redis

from router_queue.services import Services
from router_queue.store.admission import ABANDON_AFTER_S, TwoStepAdmission
from router_queue.web.app import create_app
from tests.unit.conftest import RecordingDispatcher

FLUX = "/v2/models/bfl/flux-2-pro"
#: The front door's wait on Redis in these tests (the write deadline ends
#: 0.2 s before it): short, so a simulated wait that runs out is short too.
WAIT_S = 0.3


class LostReply:
    """Stands in for a script whose reply never arrives: Redis runs it (``runs``)
    or never gets it, and the client's wait runs out either way."""

    def __init__(self, script, *, runs: bool, error: Exception | None = None):
        self.script = script
        self.runs = runs
        self.error = error or redis.TimeoutError("Timeout reading from 127.0.0.1:6379")

    def __call__(self, *args, **kwargs):
        if self.runs:
            self.script(*args, **kwargs)
        time.sleep(WAIT_S)  # the client's socket wait, past the script's write deadline
        raise self.error


def unanswered(*args, **kwargs):
    """A read of the outcome on a Redis that is still stalled."""
    raise redis.TimeoutError("Timeout reading from 127.0.0.1:6379")


@pytest.fixture(params=["one step", "split"])
def front(request, client, settings):
    """The front door with its write deadline, on one Redis or split per slot
    (a cluster's steps); ``lose`` makes the step that writes the record lose its reply."""
    split = request.param == "split"
    services = Services.build(settings, client, dispatcher=RecordingDispatcher(), write_deadline_s=WAIT_S,
                              split=split)
    workspace = services.accounts.create_workspace("acme", queue_enabled=True, credits=1000)
    store = services.store

    def lose(*, runs: bool, read_back: bool = True, error: Exception | None = None) -> None:
        name = "_place" if split else "_admit"
        setattr(store.admission, name, LostReply(getattr(store.admission, name), runs=runs, error=error))
        if not read_back:
            store.lost_replies._admitted = unanswered

    def restore() -> None:
        for name in ("_admit", "_place"):
            script = getattr(store.admission, name, None)
            if isinstance(script, LostReply):
                setattr(store.admission, name, script.script)

    http = create_app(settings, services=services).test_client()
    return http, {"X-API-Key": services.accounts.mint_key(workspace)}, services, workspace, lose, restore


def submit(http, auth, headers=None):
    return http.post(f"{FLUX}/requests", data=json.dumps({"prompt": "a red teapot"}),
                     headers={**auth, "Content-Type": "application/json", **(headers or {})})


def price(services) -> int:
    return services.catalog.get("bfl", "flux-2-pro").price_credits


def test_an_admission_whose_reply_was_lost_answers_its_handle_not_503(front):
    http, auth, services, workspace, lose, _ = front
    lose(runs=True)
    response = submit(http, auth)
    assert response.status_code == 201, response.get_data(as_text=True)
    request_id = response.json["request_id"]
    assert http.get(f"{FLUX}/requests/{request_id}/status", headers=auth).json["status"] == "IN_QUEUE"
    assert services.accounts.get(workspace).held == price(services)  # held once


def test_in_doubt_with_a_key_is_409_and_the_resend_returns_the_admitted_request(front):
    http, auth, services, workspace, lose, restore = front
    lose(runs=True, read_back=False)
    doubt = submit(http, auth, {"Idempotency-Key": "k1"})
    assert doubt.status_code == 409, doubt.get_data(as_text=True)
    assert doubt.json["error_type"] == doubt.headers["X-Comfy-Error-Type"] == "concurrency_limit_exceeded"
    assert int(doubt.headers["Retry-After"]) >= 1
    restore()
    again = submit(http, auth, {"Idempotency-Key": "k1"})
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert services.accounts.get(workspace).held == price(services)  # the one admitted, charged once
    assert services.store.queue_depth("bfl") == 1


def test_in_doubt_without_a_key_is_504_naming_the_id_the_status_then_confirms(front):
    http, auth, services, workspace, lose, _ = front
    lose(runs=True, read_back=False)
    doubt = submit(http, auth)
    assert doubt.status_code == 504, doubt.get_data(as_text=True)
    assert doubt.json["error_type"] == doubt.headers["X-Comfy-Error-Type"] == "outcome_unknown"
    request_id = doubt.json["request_id"]
    assert doubt.json["status_url"].endswith(f"/requests/{request_id}/status")
    assert request_id in doubt.json["detail"]
    assert http.get(doubt.json["status_url"], headers=auth).status_code == 200  # it was admitted


def test_in_doubt_without_a_key_when_it_was_not_admitted_the_status_says_so(front):
    http, auth, services, workspace, lose, _ = front
    lose(runs=False, read_back=False)
    doubt = submit(http, auth)
    assert doubt.status_code == 504
    assert http.get(doubt.json["status_url"], headers=auth).status_code in (404, 410)
    # split: its workspace's part waits for the sweeper (one Redis: nothing to give up)
    services.store.admission.abandon("bfl", time.time() + ABANDON_AFTER_S + 1)
    assert services.accounts.get(workspace).held == 0


def test_a_script_that_never_ran_is_503_and_charges_nothing(front):
    http, auth, services, workspace, lose, restore = front
    lose(runs=False)
    refused = submit(http, auth, {"Idempotency-Key": "k2"})
    assert refused.status_code == 503
    assert refused.json["error_type"] == "service_unavailable"
    assert services.accounts.get(workspace).held == 0
    assert services.store.queue_depth("bfl") == 0
    restore()
    again = submit(http, auth, {"Idempotency-Key": "k2"})  # the key was left free
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers


def test_a_connection_that_could_not_be_made_is_503_without_reading_back(front):
    http, auth, services, workspace, lose, _ = front
    lose(runs=False, read_back=False,
         error=redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."))
    assert submit(http, auth, {"Idempotency-Key": "k3"}).status_code == 503


def lose_the_keys_step(services, *, runs: bool, error: Exception | None = None) -> None:
    """Lose the reply of the step that answers a key's replay: the one step on
    one Redis, the workspace's step split (the provider's step is then not sent)."""
    admission = services.store.admission
    name = _keys_step(services)
    setattr(admission, name, LostReply(getattr(admission, name), runs=runs, error=error))


def found_again(services) -> None:
    """The step :func:`lose_the_keys_step` made lose its reply answers again."""
    name = _keys_step(services)
    script = getattr(services.store.admission, name)
    if isinstance(script, LostReply):
        setattr(services.store.admission, name, script.script)


def _keys_step(services) -> str:
    """The admission's step that answers a key's replay (its script's attribute)."""
    return "_reserve" if isinstance(services.store.admission, TwoStepAdmission) else "_admit"


def test_a_keyed_resend_whose_reply_was_lost_is_in_doubt_while_an_earlier_attempt_holds_the_key(front):
    """The first attempt was admitted and answered in doubt; the resend's script
    answered the replay, and that reply was lost too. The resend did not admit
    anything itself, but its key's request was admitted: 409, never a 503."""
    http, auth, services, workspace, lose, restore = front
    lose(runs=True, read_back=False)
    assert submit(http, auth, {"Idempotency-Key": "k4"}).status_code == 409
    restore()
    services.store.lost_replies._admitted = services.store.lost_replies.__class__(
        services.redis, WAIT_S)._admitted  # the store answers reads again
    lose_the_keys_step(services, runs=True)
    resend = submit(http, auth, {"Idempotency-Key": "k4"})
    assert resend.status_code == 409, resend.get_data(as_text=True)
    assert resend.json["error_type"] == "concurrency_limit_exceeded" and int(resend.headers["Retry-After"]) >= 1
    restore()
    found_again(services)
    settled = submit(http, auth, {"Idempotency-Key": "k4"})
    assert settled.status_code == 201 and settled.headers["Idempotent-Replayed"] == "true"
    assert services.accounts.get(workspace).held == price(services)  # the one admitted, held once


def test_a_keyed_resend_that_could_not_connect_is_in_doubt_while_an_earlier_attempt_holds_the_key(front):
    http, auth, services, workspace, lose, restore = front
    lose(runs=True, read_back=False)
    assert submit(http, auth, {"Idempotency-Key": "k5"}).status_code == 409
    restore()
    lose_the_keys_step(services, runs=False,
                       error=redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."))
    resend = submit(http, auth, {"Idempotency-Key": "k5"})
    assert resend.status_code == 409, resend.get_data(as_text=True)
    restore()
    found_again(services)
    settled = submit(http, auth, {"Idempotency-Key": "k5"})
    assert settled.status_code == 201 and settled.headers["Idempotent-Replayed"] == "true"
    assert services.accounts.get(workspace).held == price(services)


def test_a_keyed_attempt_that_could_not_connect_is_in_doubt_when_the_key_cannot_be_read(front):
    """Redis refuses the admission and the read of its key alike: an earlier
    attempt may hold the key, so the answer is the key's in-doubt 409."""
    http, auth, services, workspace, lose, restore = front
    lose(runs=False, read_back=False,
         error=redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."))
    services.store.lost_replies._bounded = type("Refusing", (), {"get": unanswered})()
    assert submit(http, auth, {"Idempotency-Key": "k6"}).status_code == 409
    assert submit(http, auth).status_code == 503  # without a key: nothing was carried out
    assert services.accounts.get(workspace).held == 0
