"""Integration fixtures: one real stack per session.

Redis (database 15 of the session's private ``redis-server``, or of the server
``TEST_REDIS_URL`` names), then ``router_queue.dev.stack.Stack`` started piece by piece:
the stub provider, one Celery worker (threads, concurrency 8, every provider
queue), Celery beat running the sweeper every second, and gunicorn. Every test
in this directory is marked ``integration``; a failing one gets the tails of
the stack's logs attached to its report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import redis

from router_queue.dev.stack import ROOT, Stack, free_port
from router_queue.services import Services
from router_queue.settings import Settings

from tests.redis_servers import STACK_DB, with_db

from .harness import FLUX, Caller, Stub, forget_pace, unique_prompt

#: Seconds the whole stack may take to come up (worker ready, first request done).
STARTUP_TIMEOUT_S = 30.0
#: Lines of each log attached to a failing test's report.
LOG_TAIL_LINES = 40

#: The running stack, for the failure-report hook (set by the ``stack`` fixture).
_RUNNING: "RunningStack | None" = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _RUNNING is not None:
        report.sections.append(("stack logs (tails)", _RUNNING.log_tails()))


# -- Redis ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url(redis_server: str) -> str:
    """Database 15 of the session's Redis server (``tests/conftest.py``), flushed at start."""
    url = with_db(redis_server, STACK_DB)
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


# -- the stack -----------------------------------------------------------------


@dataclass
class RunningStack:
    """The started ``Stack`` and what tests need to reach it."""

    stack: Stack
    env: dict[str, str]
    base_url: str
    stub: Stub
    settings: Settings
    services: Services

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        out = []
        for path in sorted(self.stack.log_dir.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"==> {path} <==\n" + "\n".join(text))
        return "\n\n".join(out)

    def log_text(self, name: str) -> str:
        path = self.stack.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def assert_alive(self) -> None:
        dead = self.stack.exited()
        if dead is not None:
            raise AssertionError(f"stack process {dead!r} exited\n\n{self.log_tails()}")


def _stack_env(redis_url: str, stub_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "REDIS_URL": redis_url,
        "PROVIDER_ORIGIN_OVERRIDE": f"http://127.0.0.1:{stub_port}",
        "BFL_API_KEY": "stub",
        "VERTEXAI_ACCESS_TOKEN": "stub",
        "OPENAI_API_KEY": "stub",
        "SWEEP_INTERVAL_SECONDS": "1",
        "REPUBLISH_AFTER_SECONDS": "2",
        # Tests poll faster than a client honouring Retry-After would; the
        # rate-limit tests set a workspace's own, tighter limit.
        "DEFAULT_RATE_LIMIT": "2000/second",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    })
    # The children must not inherit a base URL meant for the client under test.
    for name in ("PUBLIC_BASE_URL", "CELERY_BROKER_URL"):
        env.pop(name, None)
    return env


def _wait_until_serving(running: RunningStack) -> None:
    """The worker consumes and completes a request end to end, within the startup bound."""
    try:
        _probe(running)
    except Exception as exc:
        raise AssertionError(f"the stack did not come up: {exc}\n\n{running.log_tails()}") from exc


def _probe(running: RunningStack) -> None:
    accounts = running.services.accounts
    workspace = accounts.create_workspace("startup-probe", queue_enabled=True, credits=1_000_000)
    with Caller(running.base_url, workspace, accounts.mint_key(workspace)) as caller:
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("startup probe")})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            running.assert_alive()
            if caller.status_body(FLUX, request_id)["status"] == "COMPLETED":
                return
            time.sleep(0.2)
    raise AssertionError(f"the worker did not complete a request within {STARTUP_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    global _RUNNING
    stub_port, web_port = free_port(), free_port()
    env = _stack_env(redis_url, stub_port)
    settings = Settings.from_env(env)
    services = Services.build(settings)
    stack = Stack(env, log_dir=tmp_path_factory.mktemp("stack-logs"))
    try:
        stack.start_stub(stub_port)
        stack.start_worker(services.catalog.providers())
        stack.start_beat()
        stack.start_web(web_port)
        running = RunningStack(stack, env, f"http://127.0.0.1:{web_port}", Stub(f"http://127.0.0.1:{stub_port}"),
                               settings, services)
        _RUNNING = running
        _wait_until_serving(running)
        yield running
    except BaseException:
        print(f"stack logs in {stack.log_dir}")
        raise
    finally:
        _RUNNING = None
        stack.stop()
        services.redis.close()


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


def _caller(stack: RunningStack, name: str, *, queue_enabled: bool) -> Caller:
    accounts = stack.services.accounts
    workspace = accounts.create_workspace(name, queue_enabled=queue_enabled, credits=1_000_000)
    return Caller(stack.base_url, workspace, accounts.mint_key(workspace))


@pytest.fixture
def caller(stack: RunningStack) -> Iterator[Caller]:
    """A fresh workspace with queued delivery on, and its key."""
    with _caller(stack, "queue-on", queue_enabled=True) as made:
        yield made


@pytest.fixture
def other_caller(stack: RunningStack) -> Iterator[Caller]:
    """A second, unrelated workspace with queued delivery on."""
    with _caller(stack, "other", queue_enabled=True) as made:
        yield made


@pytest.fixture
def disabled_caller(stack: RunningStack) -> Iterator[Caller]:
    """A fresh workspace with queued delivery off, and its key."""
    with _caller(stack, "queue-off", queue_enabled=False) as made:
        yield made


@pytest.fixture
def comfy_env(monkeypatch: pytest.MonkeyPatch, stack: RunningStack, caller: Caller) -> Caller:
    """Point comfy-sdk at the stack as ``caller``: COMFY_ROUTER_BASE_URL and COMFY_API_KEY."""
    monkeypatch.setenv("COMFY_ROUTER_BASE_URL", stack.base_url)
    monkeypatch.setenv("COMFY_API_KEY", caller.api_key)
    monkeypatch.delenv("COMFY_BASE_URL", raising=False)
    return caller


@pytest.fixture(scope="session")
def stub(stack: RunningStack) -> Stub:
    return stack.stub
