"""The integration harness: every integration test reaches real processes through it.

* :func:`stack_env`: the one environment a stack's processes share (a Redis,
  an optional broker and catalog, the stub as every provider's origin, more
  settings);
* :class:`RunningStack`: ``router_queue.dev.stack.Stack`` started with the
  processes asked for (the stub, Celery workers, beat, gunicorn), ready when
  :meth:`RunningStack.start` returns, with its logs (tails for failure
  reports), and stopped with its Redis client;
* :func:`make_caller`: a workspace (queued delivery, credits, limits) and its
  key, as a :class:`ApiClient` speaking plain HTTP to the front door;
* :meth:`RunningStack.wait_ready`: the one readiness probe;
* waits with a bound, prompts no other test sends, the stub's counters.

Plain code, no fixtures (those are in ``conftest.py``). Every wait has a bound in
seconds and fails with what it last saw, so a hang reads as a clear failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

import requests

from router_queue.broker.celery_app import queue_name
from router_queue.catalog import Catalog
from router_queue.dev.stack import ROOT, Stack, free_port
from router_queue.services import Services
from router_queue.settings import DEFAULT_CATALOG, Settings
from router_queue.store import keys
from tests.redis_servers import PrivateRedis, with_db

#: The BFL model most tests use: submit, then poll; its adapter checks for a cancel between polls.
FLUX = "bfl/flux-2-pro"
GEMINI = "vertexai/gemini-3.1-flash-image"
TTS = "openai/gpt-4o-mini-tts"

#: Threads of each test worker (``Stack.start_worker``'s default).
WORKER_CONCURRENCY = 8
#: Threads of the webhooks worker (the Procfile's ``webhooks``), where a stack runs one.
WEBHOOKS_CONCURRENCY = 16
#: Worker names that start the webhooks worker rather than a provider worker.
WEBHOOKS_WORKER = "webhooks"
#: Seconds any single wait below may take before the test fails.
DEFAULT_WAIT_S = 20.0
#: Seconds a stack may take to be ready (each worker consuming, a request done end to end).
READY_TIMEOUT_S = 30.0
#: Lines of each log in a tail (failure reports, failed waits).
LOG_TAIL_LINES = 60
#: Credits a workspace starts with unless a test says otherwise.
START_CREDITS = 1_000_000

#: Every stack's sweeper runs every second and re-publishes what waited 2 s unpublished.
SWEEP_INTERVAL_S = 1.0
REPUBLISH_AFTER_S = 2.0
#: A worker stopped for three of these is shown dead.
WORKER_HEARTBEAT_S = 1.0
#: The lease of the stacks that kill workers (``SHORT_LEASE``): a dead worker's
#: request is taken over within seconds (heartbeat every second).
LEASE_S = 3.0
SHORT_LEASE = {"LEASE_SECONDS": f"{LEASE_S:g}"}

#: The stack's processes that are not Celery workers.
NOT_WORKERS = ("stub", "web", "beat")

#: Every stack started and not yet stopped, for the failure-report hook.
_RUNNING: list["RunningStack"] = []


# -- prompts and waits -------------------------------------------------------------


def unique_prompt(label: str, *directives: str) -> str:
    """A prompt no other test sends (the stub keys its tasks on the body digest)."""
    return f"{label} {uuid.uuid4().hex} " + " ".join(directives)


def stub_digest(body: Any) -> str:
    """The stub's key for a body: sha256 of its canonical JSON (stub_provider.directives)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def wait_for(predicate: Callable[[], Any], *, timeout_s: float = DEFAULT_WAIT_S, interval_s: float = 0.1,
             what: str = "condition") -> Any:
    """Call ``predicate`` until it returns something truthy; that value, or AssertionError."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what} not reached within {timeout_s} s; last value: {last!r}")


# -- callers -------------------------------------------------------------------------


@dataclass
class ApiClient:
    """One workspace's API key, speaking plain HTTP to the front door."""

    base_url: str
    workspace: str
    api_key: str
    session: requests.Session = field(default_factory=requests.Session)

    def __enter__(self) -> "ApiClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()

    def headers(self, extra: dict[str, str] | None = None, *, bearer: bool = False) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if bearer else {"X-API-Key": self.api_key}
        return {**auth, **(extra or {})}

    def url(self, model: str, request_id: str | None = None, suffix: str = "") -> str:
        root = f"{self.base_url}/v2/models/{model}/requests"
        return root if request_id is None else f"{root}/{request_id}{suffix}"

    def submit(self, model: str, body: Any, *, headers: dict[str, str] | None = None,
               bearer: bool = False) -> requests.Response:
        return self.session.post(self.url(model), json=body, headers=self.headers(headers, bearer=bearer),
                                 timeout=10)

    def submit_ok(self, model: str, body: Any, **kwargs: Any) -> str:
        response = self.submit(model, body, **kwargs)
        assert response.status_code == 201, (response.status_code, response.text)
        return response.json()["request_id"]

    def status(self, model: str, request_id: str, **kwargs: Any) -> requests.Response:
        return self.session.get(self.url(model, request_id, "/status"), headers=self.headers(**kwargs), timeout=10)

    def result(self, model: str, request_id: str, **kwargs: Any) -> requests.Response:
        return self.session.get(self.url(model, request_id), headers=self.headers(**kwargs), timeout=10)

    def cancel(self, model: str, request_id: str, **kwargs: Any) -> requests.Response:
        return self.session.put(self.url(model, request_id, "/cancel"), headers=self.headers(**kwargs), timeout=10)

    def status_body(self, model: str, request_id: str) -> dict[str, Any]:
        response = self.status(model, request_id)
        assert response.status_code == 200, (response.status_code, response.text)
        return response.json()

    def wait_status(self, model: str, request_id: str, wanted: str | tuple[str, ...] = "COMPLETED", *,
                    timeout_s: float = DEFAULT_WAIT_S) -> dict[str, Any]:
        """Poll status (every 0.1 s, ignoring Retry-After: tests, not clients) until ``wanted``."""
        wanted = (wanted,) if isinstance(wanted, str) else wanted
        return wait_for(
            lambda: (body := self.status_body(model, request_id))["status"] in wanted and body,
            timeout_s=timeout_s, what=f"{model} request {request_id} in {wanted}",
        )


def make_caller(stack: "RunningStack", name: str, *, credits: int = START_CREDITS, queue_enabled: bool = True,
                max_queued: int | None = None, rate_limit: str | None = None) -> ApiClient:
    """A fresh workspace on ``stack`` (queued delivery on unless told, ``credits``)
    and its key. Limits are set before the key exists, so no front-door process
    can have cached the workspace's old limit. Close it (``with``) when done."""
    accounts = stack.services.accounts
    workspace = accounts.create_workspace(name, queue_enabled=queue_enabled, credits=credits)
    if max_queued is not None or rate_limit is not None:
        accounts.set_limits(workspace, max_queued=max_queued, rate_limit=rate_limit)
    return ApiClient(stack.base_url, workspace, accounts.mint_key(workspace))


# -- the stub provider -----------------------------------------------------------------


@dataclass
class Stub:
    """The stub provider's test routes."""

    base_url: str

    def calls(self) -> dict[str, dict[str, int]]:
        response = requests.get(f"{self.base_url}/stub/calls", timeout=5)
        response.raise_for_status()
        return response.json()

    def submits(self, route: str, body: Any) -> int:
        """Calls of ``route`` (bfl_submit, openai_speech, ...) carrying this body."""
        return self.calls()["submits"].get(f"{route}:{stub_digest(body)}", 0)


# -- the environment ---------------------------------------------------------------------


#: With ``TEST_STORE=cluster``: the broker of every stack whose store is a cluster (the chaos
#: pool's on database 1), and the chaos pool's own cluster (conftest.py, ``redis_url``).
CLUSTER_BROKER_URL = ""
CHAOS_CLUSTER_URL = ""


#: The webhook secrets' key (``WEBHOOK_SECRETS_KEY``) of the stacks the tests start.
TEST_WEBHOOK_SECRETS_KEY = "dGVzdHMtd2ViaG9vay1zZWNyZXRzLWtleS0zMmJ5dGU="


def stack_env(redis_url: str, *, stub_port: int, broker_url: str | None = None, catalog: str | Path | None = None,
              **settings: str) -> dict[str, str]:
    """This process's environment for a stack's children: the store on
    ``redis_url``, the broker there too unless ``broker_url``, the catalog at
    ``catalog`` (else ``CATALOG_PATH`` or the shipped one), the stub on
    ``stub_port`` as every provider's origin with a key for each, the sweeper
    every second, no rate limit a test would meet, then ``settings``."""
    env = dict(os.environ)
    # The children must not inherit a base URL meant for the client under test, nor a broker.
    for name in ("PUBLIC_BASE_URL", "CELERY_BROKER_URL"):
        env.pop(name, None)
    if broker_url is None and redis_url.startswith("redis+cluster://"):
        broker_url = CLUSTER_BROKER_URL if redis_url != CHAOS_CLUSTER_URL else with_db(CLUSTER_BROKER_URL, 1)
    if broker_url is not None:
        env["CELERY_BROKER_URL"] = broker_url
    if catalog is not None:
        env["CATALOG_PATH"] = str(catalog)
    env.update({
        "REDIS_URL": redis_url,
        "PROVIDER_ORIGIN_OVERRIDE": f"http://127.0.0.1:{stub_port}",
        **{name: "stub" for name in Catalog.credential_variables(env.get("CATALOG_PATH") or DEFAULT_CATALOG)},
        "SWEEP_INTERVAL_SECONDS": f"{SWEEP_INTERVAL_S:g}",
        "REPUBLISH_AFTER_SECONDS": f"{REPUBLISH_AFTER_S:g}",
        "WORKER_HEARTBEAT_SECONDS": f"{WORKER_HEARTBEAT_S:g}",
        # Tests poll faster than a client honouring Retry-After would; the
        # rate-limit tests set a workspace's own, tighter limit.
        "DEFAULT_RATE_LIMIT": "2000/second",
        # Absolute URLs on the origin each test calls (127.0.0.1:its port), never a forged Host.
        "TRUSTED_HOSTS": "127.0.0.1,localhost",
        # One key for every stack: the stores the tests share are sealed with it.
        "WEBHOOK_SECRETS_KEY": TEST_WEBHOOK_SECRETS_KEY,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **settings,
    })
    return env


# -- a stack of real processes -------------------------------------------------------------


@dataclass(eq=False)
class RunningStack:
    """A started ``Stack`` and what tests need to reach it. Build it with :meth:`start`."""

    stack: Stack
    env: dict[str, str]
    #: The front door ("" when the stack runs no gunicorn).
    base_url: str
    #: The stub provider the environment names (started by this stack or another).
    stub: Stub
    #: What failure reports call it.
    label: str
    #: Byte offset of each worker's log where its current process began.
    log_starts: dict[str, int] = field(default_factory=dict)
    #: The front door's operator listener: /metrics, /ops ("" without gunicorn).
    ops_url: str = ""
    _services: Services | None = field(default=None, repr=False)

    @classmethod
    def start(cls, env: dict[str, str], log_dir: Path, *, label: str, stub: bool = True,
              workers: Iterable[str] = ("worker",), beat: bool = True, web: bool = True, web_workers: int = 2,
              webhooks: bool = False, **fields: Any) -> "RunningStack":
        """The stub (if ``stub``; on the port ``env`` names), a Celery worker per
        name in ``workers`` (threads, :data:`WORKER_CONCURRENCY`, every provider
        queue), the webhooks worker (if ``webhooks``: ``router.webhooks`` only,
        :data:`WEBHOOKS_CONCURRENCY` threads), beat, and gunicorn with
        ``web_workers`` workers, as the Procfile runs them; returns once
        :meth:`wait_ready` does, stops them all if it fails."""
        port = free_port() if web else None
        ops_port = free_port() if web else None
        while ops_port is not None and ops_port == port:
            ops_port = free_port()
        if ops_port is not None:
            env = {**env, "OPS_PORT": str(ops_port)}
        running = cls(Stack(env, log_dir=log_dir), env, f"http://127.0.0.1:{port}" if web else "",
                      Stub(env["PROVIDER_ORIGIN_OVERRIDE"]), label,
                      ops_url=f"http://127.0.0.1:{ops_port}" if web else "", **fields)
        _RUNNING.append(running)
        try:
            if stub:
                running.stack.start_stub(urlsplit(env["PROVIDER_ORIGIN_OVERRIDE"]).port)
            for name in (*workers, *((WEBHOOKS_WORKER,) if webhooks else ())):
                running.start_worker(name)
            if beat:
                running.stack.start_beat()
            if port is not None:
                running.stack.start_web(port, workers=web_workers, ops_port=ops_port)
            running.wait_ready()
        except BaseException:
            print(f"{label} logs in {log_dir}")
            running.stop()
            raise
        return running

    def second_door(self, log_dir: Path, *, web_workers: int = 1, **settings: str) -> "RunningStack":
        """Another gunicorn on this stack's environment (same Redis, stub, workers
        and beat) with front-door ``settings`` of its own, on a port of its own.
        Only the front door reads them, so this stack serves its requests unchanged."""
        return RunningStack.start({**self.env, **settings}, log_dir, label=f"second front door {settings}",
                                  stub=False, workers=(), beat=False, web_workers=web_workers)

    def __enter__(self) -> "RunningStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self in _RUNNING:
            _RUNNING.remove(self)
        try:
            self.stack.stop()
        finally:
            if self._services is not None:
                self._services.redis.close()

    @property
    def services(self) -> Services:
        """The composition root on the stack's settings (built on first use, closed by :meth:`stop`)."""
        if self._services is None:
            self._services = Services.build(Settings.from_env(self.env))
        return self._services

    @property
    def settings(self) -> Settings:
        return self.services.settings

    def caller(self, name: str, **kwargs: Any) -> ApiClient:
        """:func:`make_caller` on this stack."""
        return make_caller(self, name, **kwargs)

    # -- workers -------------------------------------------------------------------
    def start_worker(self, name: str) -> None:
        """A Celery worker called ``name`` (its log goes on where it was): the
        webhooks worker if ``name`` is :data:`WEBHOOKS_WORKER`, else a provider worker."""
        path = self.log_path(name)
        self.log_starts[name] = path.stat().st_size if path.exists() else 0
        if name == WEBHOOKS_WORKER:
            self.stack.start_webhooks(name, concurrency=WEBHOOKS_CONCURRENCY)
        else:
            self.stack.start_worker(self.services.catalog.providers(), name=name, concurrency=WORKER_CONCURRENCY)

    def workers(self) -> list[str]:
        """Names of every worker started (alive or not)."""
        return [name for name in self.stack.procs if name not in NOT_WORKERS]

    # -- readiness -------------------------------------------------------------------
    def wait_ready(self, workers: Iterable[str] | None = None, *, serving: bool = True,
                   timeout_s: float = READY_TIMEOUT_S) -> None:
        """The readiness probe: each of ``workers`` (by default every one) has
        logged that it is ready; then, with ``serving`` and a front door, a
        request completes end to end (or, with no worker of its own,
        ``/healthz`` answers 200). Fails with the logs' tails."""
        try:
            for name in self.workers() if workers is None else workers:
                self._until(lambda: re.search(r"\bready\.", self.current_log(name)), watch=(name,),
                            what=f"worker {name} ready", timeout_s=timeout_s)
            if serving and self.base_url and self.workers():
                with self.caller("startup-probe") as caller:
                    request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("startup probe")})
                    self._until(lambda: caller.status_body(FLUX, request_id)["status"] == "COMPLETED",
                                what="a request completed end to end", timeout_s=timeout_s)
            elif serving and self.base_url:  # gunicorn workers import the app after the bind
                self._until(self._healthy, what="/healthz 200", timeout_s=timeout_s)
        except Exception as exc:
            raise AssertionError(f"{self.label} not ready: {exc}\n\n{self.log_tails()}") from exc

    def _healthy(self) -> bool:
        try:
            return requests.get(f"{self.base_url}/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def _until(self, check: Callable[[], Any], *, what: str, timeout_s: float, watch: Iterable[str] | None = None,
               interval_s: float = 0.1) -> None:
        """``check`` until truthy, failing at once when a watched process (by default any) exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name in self.stack.procs if watch is None else watch:
                if self.stack.procs[name].poll() is not None:
                    raise AssertionError(f"{name} exited with {self.stack.procs[name].returncode} "
                                         f"before {what}")
            if check():
                return
            time.sleep(interval_s)
        raise AssertionError(f"{what}: not within {timeout_s} s")

    def assert_alive(self) -> None:
        dead = self.stack.exited()
        if dead is not None:
            raise AssertionError(f"stack process {dead!r} exited\n\n{self.log_tails()}")

    # -- logs --------------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return self.stack.log_dir / f"{name}.log"

    def log_text(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def current_log(self, name: str) -> str:
        """What the current process of ``name`` has logged so far (a restarted worker's log goes on)."""
        path = self.log_path(name)
        if not path.exists():
            return ""
        with open(path, "rb") as handle:
            handle.seek(self.log_starts.get(name, 0))
            return handle.read().decode(errors="replace")

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` of each of the stack's logs."""
        out = []
        for path in sorted(self.stack.log_dir.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"==> {path} <==\n" + "\n".join(text))
        return "\n\n".join(out)

    def access_lines(self, method: str, path: str, status: int) -> int:
        """Lines of gunicorn's access log for ``method path`` answered ``status``
        (each a JSON line whose message is gunicorn's access format)."""
        needle = f'"{method} {path} HTTP/1.1" {status} '
        return sum(1 for line in self.log_text("web").splitlines() if needle in _message(line))


def _message(line: str) -> str:
    """A log line's message: the ``message`` of a JSON line, else the line."""
    try:
        parsed = json.loads(line)
    except ValueError:
        return line
    return parsed.get("message", "") if isinstance(parsed, dict) else line


@contextmanager
def private_stack(tmp_path_factory: Any, name: str, settings: dict[str, str], **start: Any) -> Iterator[RunningStack]:
    """A stack on a redis-server of its own, so no other stack's worker takes its
    work: ``settings`` go into its environment, ``start`` to :meth:`RunningStack.start`."""
    server = PrivateRedis(tmp_path_factory.mktemp(f"{name}-redis"), persist=False)
    server.start()
    try:
        env = stack_env(server.url, stub_port=free_port(), **settings)
        with RunningStack.start(env, tmp_path_factory.mktemp(f"{name}-logs"), label=f"{name} stack",
                                **start) as running:
            yield running
    finally:
        server.stop()


def running_stacks() -> list[RunningStack]:
    """Every stack started and not yet stopped (their log tails go on a failing test's report)."""
    return list(_RUNNING)


def children(pid: int) -> set[int]:
    """The process's direct children (gunicorn's workers, ``router-queue dev``'s processes)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


# -- the store ------------------------------------------------------------------------------


def forget_pace(services: Any) -> None:
    """Drop every provider's measured pace, so Retry-After starts from its defaults."""
    services.redis.delete(*[keys.stats(p) for p in services.catalog.providers()])


def broker_drained(services: Any, provider: str) -> bool:
    """No delivery of ``provider`` waiting in the broker, nor reserved and unacked by a worker."""
    return services.redis.llen(queue_name(provider)) == 0 and services.redis.hlen("unacked") == 0


def ledger_by_request(services: Any, workspace: str) -> dict[str, list[str]]:
    """Each request's ledger entry types (hold, charge, release), oldest first."""
    found: dict[str, list[str]] = {}
    for entry in services.accounts.ledger(workspace, count=100_000):
        found.setdefault(entry.request_id, []).append(entry.type)
    return found


@contextmanager
def saturated_worker(caller: ApiClient, *, threads: int = WORKER_CONCURRENCY) -> Iterator[list[str]]:
    """Occupy every worker thread with a long BFL generation; cancel them all on exit.

    Inside the block a new request (of any provider) stays ``IN_QUEUE``: the
    worker prefetches only what it runs (prefetch multiplier 1, late acks).
    The BFL adapter checks for a cancel between polls (every 0.5-2 s), so the
    threads come back within seconds on exit.
    """
    ids = [caller.submit_ok(FLUX, {"prompt": unique_prompt("saturate", "[stub:latency=120]")})
           for _ in range(threads)]
    try:
        for request_id in ids:
            caller.wait_status(FLUX, request_id, "IN_PROGRESS")
        yield ids
    finally:
        for request_id in ids:
            caller.cancel(FLUX, request_id)
        for request_id in ids:
            caller.wait_status(FLUX, request_id, "COMPLETED")
