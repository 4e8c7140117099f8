"""Publishing with the admit: the message the admission script pushes is the
one Celery would have published, on the list a worker consumes."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

from router_queue import keys
from router_queue.app import create_app
from router_queue.dispatch import Dispatcher
from workers.celery_app import DELIVER_TASK, make_celery

from tests.unit.conftest import UNIT_REDIS_URL, _real_redis

FLUX = "/v2/models/bfl/flux-2-pro"


def inline_dispatcher(settings, services) -> Dispatcher:
    return Dispatcher(make_celery(settings), services.store, providers=("bfl", "openai"), broker_is_store=True)


def task_args(payload: str) -> list:
    message = json.loads(payload)
    return json.loads(base64.b64decode(message["body"]))[0]


def test_an_admitted_request_is_on_its_providers_broker_list_and_not_left_for_the_sweeper(settings, services):
    http = create_app(settings, services=services, dispatcher=inline_dispatcher(settings, services)).test_client()
    key = services.accounts.mint_key(services.accounts.create_workspace("w", queue_enabled=True, credits=10**6))

    answers = [http.post(f"{FLUX}/requests", json={"prompt": f"p{n}"}, headers={"X-API-Key": key})
               for n in range(3)]

    ids = [a.json["request_id"] for a in answers]
    pushed = [json.loads(raw) for raw in reversed(services.redis.lrange("provider.bfl", 0, -1))]
    assert [task_args(json.dumps(m)) for m in pushed] == [[i] for i in ids]
    assert [m["headers"]["task"] for m in pushed] == [DELIVER_TASK] * 3
    assert len({m["headers"]["id"] for m in pushed}) == len({m["properties"]["delivery_tag"] for m in pushed}) == 3
    assert services.redis.zcard(keys.due()) == 0  # published atomically: nothing for the sweeper


def test_a_refused_submit_pushes_nothing(settings, services):
    http = create_app(settings, services=services, dispatcher=inline_dispatcher(settings, services)).test_client()
    poor = services.accounts.mint_key(services.accounts.create_workspace("w", queue_enabled=True, credits=0))

    assert http.post(f"{FLUX}/requests", json={"prompt": "p"}, headers={"X-API-Key": poor}).status_code == 402
    assert http.post(f"{FLUX}/requests", json={"prompt": 5}, headers={"X-API-Key": poor}).status_code == 422
    assert services.redis.llen("provider.bfl") == 0


def test_the_message_is_the_one_celery_publishes_itself(settings):
    """Against kombu's own Redis transport: same envelope, headers and body
    for the same task id, on the same list (only the delivery tag differs)."""
    real = _real_redis()
    if real is None:
        pytest.skip(f"no Redis answers at {UNIT_REDIS_URL}")
    real.flushdb()
    try:
        celery = make_celery(dataclasses.replace(settings, redis_url=UNIT_REDIS_URL))
        ours = Dispatcher(celery, store=None, providers=("bfl",), broker_is_store=True).message_for_admit(
            "0193aaaa-bbbb-8ccc-9ddd-eeeeffff0000", "bfl")
        mine = json.loads(ours.payload)

        celery.send_task(DELIVER_TASK, args=["0193aaaa-bbbb-8ccc-9ddd-eeeeffff0000"], queue="provider.bfl",
                         task_id=mine["headers"]["id"])
        (theirs_raw,) = real.lrange(ours.list_key, 0, -1)
        theirs = json.loads(theirs_raw)

        assert mine["properties"].pop("delivery_tag") != theirs["properties"].pop("delivery_tag")
        assert mine == theirs
    finally:
        real.flushdb()
