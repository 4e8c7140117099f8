"""Crashes around publishing: the beat sweeper and the worker's once-only claim.

The stack runs beat with ``SWEEP_INTERVAL_SECONDS=1`` and
``REPUBLISH_AFTER_SECONDS=2``, so a request admitted but never published is
picked up within a few seconds.
"""

from __future__ import annotations

import json
import time

from router_queue.broker.celery_app import make_celery
from router_queue.broker.dispatch import Dispatcher
from router_queue.requests.record import Submission
from router_queue.services import Services

from .harness import FLUX, ApiClient, Stub, broker_drained, unique_prompt, wait_for

#: Seconds the sweeper + worker get to run a stranded request (brief: ~15 s).
RECOVERY_BOUND_S = 15.0


def _admit_without_publishing(services: Services, caller: ApiClient, body: dict) -> str:
    """What the front door does before its publish, as if it crashed right after."""
    request_id = services.ids.mint(caller.workspace, FLUX)
    admission = services.store.admit(Submission(request_id=request_id, workspace=caller.workspace, model=FLUX,
                                     provider="bfl", body=json.dumps(body)))
    assert admission.outcome == "ADMITTED", admission
    return request_id


def test_sweeper_publishes_a_request_that_was_admitted_but_never_published(
        services: Services, caller: ApiClient, stub: Stub) -> None:
    body = {"prompt": unique_prompt("stranded before publish")}
    admitted_at = time.monotonic()
    request_id = _admit_without_publishing(services, caller, body)

    assert caller.status_body(FLUX, request_id)["status"] == "IN_QUEUE"
    final = caller.wait_status(FLUX, request_id, timeout_s=RECOVERY_BOUND_S)

    # Not before it was due: only the sweeper could have published it.
    assert time.monotonic() - admitted_at >= services.settings.republish_after_s * 0.75
    assert "error_type" not in final
    result = caller.result(FLUX, request_id)
    assert result.status_code == 200
    assert result.json()["result"]["prompt"] == body["prompt"]
    assert stub.submits("bfl_submit", body) == 1


def test_duplicate_delivery_runs_the_provider_once(services: Services, caller: ApiClient, stub: Stub) -> None:
    body = {"prompt": unique_prompt("delivered three times", "[stub:latency=1]")}
    request_id = _admit_without_publishing(services, caller, body)
    celery = make_celery(services.settings)
    try:
        dispatcher = Dispatcher(celery)
        for _ in range(3):
            dispatcher.publish(request_id, "bfl")
    finally:
        celery.close()

    final = caller.wait_status(FLUX, request_id, timeout_s=RECOVERY_BOUND_S)
    wait_for(lambda: broker_drained(services, "bfl"), what="every delivery consumed and acked")

    assert "error_type" not in final
    assert stub.submits("bfl_submit", body) == 1
    assert caller.result(FLUX, request_id).status_code == 200
