"""Publishing with the grant: the message the scripts push when they grant a
slot is one Celery's worker reads as its own, on the list a worker consumes,
and a request waiting for a slot has no message at all."""

from __future__ import annotations

import dataclasses
import json

from kombu import Connection

from router_queue.broker.celery_app import DELIVER_TASK, make_celery
from router_queue.broker.dispatch import Dispatcher
from router_queue.requests.record import Submission
from router_queue.services import Services
from router_queue.store.accounts import Accounts
from router_queue.store.requests import RequestStore
from router_queue.web.app import create_app
from tests.unit.support import record_of

FLUX = "/v2/models/bfl/flux-2-pro"


def inline(settings, services) -> Services:
    """The same Redis's services with the real Dispatcher (the broker is the store's Redis)."""
    return Services.build(settings, services.redis, celery=make_celery(settings))


def task_args(payload: str) -> list:
    return json.loads(json.loads(payload)["body"])[0]


def pushed(services, queue="provider.bfl") -> list[str]:
    """Messages on the broker list, oldest first (kombu LPUSHes and BRPOPs)."""
    return [raw.decode() for raw in reversed(services.redis.lrange(queue, 0, -1))]


def test_an_admitted_request_with_a_free_slot_is_on_its_providers_broker_list(settings, services):
    http = create_app(settings, services=inline(settings, services)).test_client()
    key = services.accounts.mint_key(services.accounts.create_workspace("w", queue_enabled=True, credits=10**6))

    answers = [http.post(f"{FLUX}/requests", json={"prompt": f"p{n}"}, headers={"X-API-Key": key})
               for n in range(3)]

    ids = [a.json["request_id"] for a in answers]
    messages = [json.loads(m) for m in pushed(services)]
    assert [task_args(json.dumps(m)) for m in messages] == [[i] for i in ids]
    assert [m["headers"]["task"] for m in messages] == [DELIVER_TASK] * 3
    assert len({m["headers"]["id"] for m in messages}) == len({m["properties"]["delivery_tag"] for m in messages}) == 3
    assert services.store.in_flight("bfl") == 3  # each holds its slot from the grant on


def test_a_request_waiting_for_a_slot_has_no_message_until_one_frees(settings, services, workspace):
    services = inline(settings, services)
    services.store.max_in_flight = lambda provider: 1
    first, second = (services.ids.mint(workspace, "bfl/flux-2-pro") for _ in range(2))
    for request_id in (first, second):
        services.store.admit(Submission(request_id=request_id, workspace=workspace, model="bfl/flux-2-pro", provider="bfl",
                             body="{}"))
    assert [task_args(m) for m in pushed(services)] == [[first]]

    services.store.complete(record_of(services, first, "bfl"), output=b"{}", content_type="application/json")

    assert [task_args(m) for m in pushed(services)] == [[first], [second]]


def test_a_refused_submit_pushes_nothing(settings, services):
    http = create_app(settings, services=inline(settings, services)).test_client()
    poor = services.accounts.mint_key(services.accounts.create_workspace("w", queue_enabled=True, credits=0))

    assert http.post(f"{FLUX}/requests", json={"prompt": "p"}, headers={"X-API-Key": poor}).status_code == 402
    assert http.post(f"{FLUX}/requests", json={"prompt": 5}, headers={"X-API-Key": poor}).status_code == 422
    assert services.redis.llen("provider.bfl") == 0


def test_kombu_reads_the_pushed_message_as_the_one_celery_publishes_itself(settings, real_redis, real_redis_url):
    """Through kombu's own Redis transport: the message a grant pushes decodes
    to the same task, arguments and headers as Celery's own for that task id."""
    settings = dataclasses.replace(settings, redis_url=real_redis_url)
    celery = make_celery(settings)
    store = RequestStore(real_redis, retention_s=60, idempotency_ttl_s=60, progress_event_every_s=2.0,
                         grants=Dispatcher(celery, providers=("bfl",), broker_is_store=True).grants)
    workspace = Accounts(real_redis).create_workspace("w", queue_enabled=True)
    request_id = "0193aaaa-bbbb-9ccc-9ddd-eeeeffff0001"
    assert store.admit(Submission(request_id=request_id, workspace=workspace, model="bfl/flux-2-pro", provider="bfl",
                       body="{}")).outcome == "ADMITTED"
    with Connection(real_redis_url) as connection:
        queue = connection.SimpleQueue("provider.bfl")
        ours = queue.get(timeout=2)
        celery.send_task(DELIVER_TASK, args=[request_id], queue="provider.bfl", task_id=ours.headers["id"])
        theirs = queue.get(timeout=2)
        assert ours.decode() == theirs.decode()
        assert ours.headers == theirs.headers
        assert ours.content_type == theirs.content_type == "application/json"
        ours.ack()
        theirs.ack()
        queue.close()


def test_services_hand_the_store_its_dispatchers_grant_publisher(settings, client):
    """Wired by construction: the store built with a Celery app publishes its
    grants through the one Dispatcher, never attached afterwards."""
    services = Services.build(settings, client, celery=make_celery(settings))
    assert isinstance(services.dispatcher, Dispatcher)
    assert services.store.grants is services.dispatcher.grants
    assert services.store.grants.publish == services.dispatcher.publish_granted
    assert set(services.store.grants.templates) == set(services.catalog.providers())

    elsewhere = dataclasses.replace(settings, broker_url="redis://broker.test:6379/0")
    services = Services.build(elsewhere, client, celery=make_celery(elsewhere))
    assert services.store.grants.publish == services.dispatcher.publish_granted
    assert not services.store.grants.templates  # published after the script, by send_task
