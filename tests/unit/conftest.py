"""Unit-test fixtures: the store on fakeredis, and on a real Redis.

The real case uses database 13 of the session's private ``redis-server``
(``tests/conftest.py``), flushed around each test, so the same Lua contracts
run fast and run true.
"""

from __future__ import annotations

import pathlib
from typing import Iterator

import fakeredis
import pytest
import redis

from router_queue.services import Services
from router_queue.settings import Secret, Settings
from router_queue.store.requests_base import GrantPublishing
from router_queue.web.app import create_app
from tests.redis_servers import UNIT_DB, with_db

#: Seconds a unit test may run before pytest-timeout fails it: four times the
#: slowest (the schedule's model test, 45 s on a loaded 2-core machine). The
#: suite-wide 600 s in pyproject.toml is for the integration stacks.
UNIT_TIMEOUT_S = 180
#: The unit tests' WEBHOOK_SECRETS_KEY (a Fernet key): their secrets are sealed as in service.
TEST_WEBHOOK_SECRETS_KEY = "dW5pdC10ZXN0cy13ZWJob29rLXNlY3JldHMta2V5LTE="


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(str(item.fspath)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


@pytest.fixture
def real_redis_url(redis_server: str) -> str:
    """Database 13 of the session's Redis server, the unit tests' own."""
    return with_db(redis_server, UNIT_DB)


@pytest.fixture
def real_redis(real_redis_url: str) -> Iterator[redis.Redis]:
    """A client of that database, flushed before and after the test."""
    client = redis.Redis.from_url(real_redis_url, socket_connect_timeout=0.5)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture(params=["fakeredis", "redis"])
def client(request):
    if request.param == "fakeredis":
        yield fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return
    yield request.getfixturevalue("real_redis")


@pytest.fixture
def settings() -> Settings:
    return Settings(redis_url="redis://unused", public_base_url="http://router.test", republish_after_s=0,
                    default_rate_limit="1000/second", readyz_cache_s=0,  # each /readyz checks: tests flip it
                    webhook_secrets_keys=(Secret(TEST_WEBHOOK_SECRETS_KEY),))


@pytest.fixture
def services(client, settings) -> Services:
    return Services.build(settings, client, dispatcher=RecordingDispatcher())


class RecordingDispatcher:
    """Stands in for Celery in front-door tests: remembers what was published
    (the store's grants included, as ``Dispatcher``'s are)."""

    #: As in a default deployment, the broker is the request store's Redis.
    broker_is_store = True

    def __init__(self):
        self.published: list[tuple[str, str]] = []
        #: Handed to the store as ``Services`` builds it, as ``Dispatcher.grants`` is.
        self.grants = GrantPublishing(publish=self.publish_granted)

    def publish(self, request_id: str, provider: str) -> None:
        self.published.append((request_id, provider))

    def publish_granted(self, provider: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.publish(request_id, provider)

    def publish_webhook(self, request_id: str) -> None:
        self.published.append((request_id, "webhook"))

    def publish_batch(self, workspace: str, batch_id: str) -> None:
        self.published.append((batch_id, "batch"))

    def publish_batch_webhook(self, workspace: str, batch_id: str) -> None:
        self.published.append((batch_id, "batch_webhook"))

    def publish_budget_alert(self, workspace: str, crossing: str) -> None:
        self.published.append((f"{workspace}|{crossing}", "budget_alert"))


@pytest.fixture
def dispatcher(services) -> RecordingDispatcher:
    return services.dispatcher


@pytest.fixture
def app(settings, services, dispatcher):
    return create_app(settings, services=services)


@pytest.fixture
def http(app):
    return app.test_client()


class OperatorClient:
    """The app's test client on the operator listener: calls arrive with
    ``SERVER_PORT`` = ``OPS_PORT``, as gunicorn sets it for that socket."""

    def __init__(self, app, port: int):
        self.client = app.test_client()
        self.base_url = f"http://localhost:{port}"

    def get(self, path: str, **kwargs):
        return self.client.get(path, base_url=self.base_url, **kwargs)


@pytest.fixture
def ops_http(app, settings) -> OperatorClient:
    return OperatorClient(app, settings.ops_port)


@pytest.fixture
def workspace(services) -> str:
    return services.accounts.create_workspace("acme", queue_enabled=True, credits=1000)


@pytest.fixture
def api_key(services, workspace) -> str:
    return services.accounts.mint_key(workspace)


@pytest.fixture
def auth(api_key) -> dict[str, str]:
    return {"X-API-Key": api_key}
