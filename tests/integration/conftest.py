"""Integration fixtures: one real stack per session, built by ``harness.py``.

Redis (database 15 of the session's private ``redis-server``, or of the server
``TEST_REDIS_URL`` names), then ``harness.RunningStack``: the stub provider, one
Celery worker (threads, concurrency 8, every provider queue), Celery beat
running the sweeper every second, and gunicorn. Every test in this directory
is marked ``integration``; a failing one gets the tails of the logs of every
stack running (the session's, and a test's own) attached to its report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
import redis

from router_queue.dev.stack import free_port
from router_queue.services import Services
from tests.object_stores import BUCKET, S3Server
from tests.redis_servers import STACK_DB, ClusterGroup, PrivateRedis, with_db

from . import harness
from .chaos_support import StackPool, stack_pool
from .harness import ApiClient, RunningStack, Stub, forget_pace, make_caller, running_stacks, stack_env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for running in running_stacks():
            report.sections.append((f"{running.label} logs (tails)", running.log_tails()))


# -- Redis ---------------------------------------------------------------------


#: ``TEST_STORE=cluster``: the session's stacks keep their store on a Redis Cluster of
#: their own (3 primaries, a replica each) and Celery's broker on a Redis of its own.
ON_CLUSTER = os.environ.get("TEST_STORE", "") == "cluster"


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Database 15 of the session's Redis server (``tests/conftest.py``), flushed
    at start; or, with ``TEST_STORE=cluster``, a cluster started here."""
    if ON_CLUSTER:
        # the session stack's cluster, the chaos pool's (chaos_support.chaos_redis_url), one broker
        clusters = [ClusterGroup(tmp_path_factory.mktemp(f"session-cluster-{n}")) for n in range(2)]
        broker = PrivateRedis(tmp_path_factory.mktemp("session-cluster-broker"), persist=False)
        try:
            for cluster in clusters:
                cluster.start()
            broker.start()
            harness.CLUSTER_BROKER_URL = broker.url
            harness.CHAOS_CLUSTER_URL = clusters[1].url
            yield clusters[0].url
        finally:
            broker.stop()
            for cluster in clusters:
                cluster.stop()
        return
    url = with_db(request.getfixturevalue("redis_server"), STACK_DB)
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    yield url


# -- the stack -----------------------------------------------------------------


@pytest.fixture(scope="session")
def stack(redis_url: str, s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """The session's stack, its big results in a bucket of the session's S3 server
    (the AWS variables set in this process too, for its own Services)."""
    os.environ.update(s3.env())
    env = stack_env(redis_url, stub_port=free_port(), OBJECT_STORE_URL=f"s3://{BUCKET}/session-stack", **s3.env())
    with RunningStack.start(env, tmp_path_factory.mktemp("stack-logs"), label="session stack") as running:
        yield running


@pytest.fixture(scope="module")
def pool(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackPool]:
    """The module's chaos stacks (``chaos_support``), one running at a time, and the stub they share."""
    with stack_pool(redis_url, tmp_path_factory) as made:
        yield made


@pytest.fixture(scope="session")
def services(stack: RunningStack) -> Services:
    return stack.services


@pytest.fixture(autouse=True)
def _fresh_pace(request: pytest.FixtureRequest) -> None:
    """Forget the providers' measured pace before each test.

    Retry-After derives from moving averages of run time; one test's long,
    cancelled generations would otherwise stretch the next test's SDK polls.
    """
    if "stack" not in request.fixturenames and "services" not in request.fixturenames:
        return
    forget_pace(request.getfixturevalue("services"))


# -- callers -------------------------------------------------------------------


@pytest.fixture
def caller(stack: RunningStack) -> Iterator[ApiClient]:
    """A fresh workspace with queued delivery on, and its key."""
    with make_caller(stack, "queue-on") as made:
        yield made


@pytest.fixture
def other_caller(stack: RunningStack) -> Iterator[ApiClient]:
    """A second, unrelated workspace with queued delivery on."""
    with make_caller(stack, "other") as made:
        yield made


@pytest.fixture
def disabled_caller(stack: RunningStack) -> Iterator[ApiClient]:
    """A fresh workspace with queued delivery off, and its key."""
    with make_caller(stack, "queue-off", queue_enabled=False) as made:
        yield made


@pytest.fixture
def comfy_env(monkeypatch: pytest.MonkeyPatch, stack: RunningStack, caller: ApiClient) -> ApiClient:
    """Point comfy-sdk at the stack as ``caller``: COMFY_ROUTER_BASE_URL and COMFY_API_KEY."""
    monkeypatch.setenv("COMFY_ROUTER_BASE_URL", stack.base_url)
    monkeypatch.setenv("COMFY_API_KEY", caller.api_key)
    monkeypatch.delenv("COMFY_BASE_URL", raising=False)
    return caller


@pytest.fixture(scope="session")
def stub(stack: RunningStack) -> Stub:
    return stack.stub
