"""A stack of our own for the chaos tests, which kill and stop its workers.

Not the session stack of ``conftest.py``: the chaos tests SIGKILL and SIGTERM
workers, run two of them, change the catalog and the broker. Each
``ChaosStack`` is ``router_queue.dev.stack.Stack`` started the way conftest
starts it (gunicorn, beat, the stub), with short lease timings, two Celery
workers ("a" and "b") and a test catalog, in a Redis database of its own (not
the session's), flushed when the stack starts. One stack runs at a time; the
stub provider is shared by all of them.
"""

from __future__ import annotations

import contextlib

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from router_queue.store import keys
from router_queue.dev.stack import ROOT, Stack, free_port, wait_for_port
from router_queue.services import Services
from router_queue.settings import DEFAULT_CATALOG, Settings
from router_queue.broker.celery_app import MAINTENANCE_QUEUE, queue_name

from .harness import FLUX, GEMINI, TTS, Caller, Stub, stub_digest, unique_prompt, wait_for

RABBITMQ_URL = os.environ.get("CHAOS_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
BROKERS = ("redis", "rabbitmq")
PROVIDERS = ("bfl", "vertexai", "openai")
#: Every queue a chaos worker consumes; purged on RabbitMQ before a stack uses it.
QUEUES = tuple(queue_name(p) for p in PROVIDERS) + (MAINTENANCE_QUEUE,)

#: Short timings so a dead worker's request is taken over within seconds:
#: lease 3 s (heartbeat every 1 s), sweeper every 1 s.
LEASE_S = 3.0
SWEEP_INTERVAL_S = 1.0
REPUBLISH_AFTER_S = 2.0
#: Threads per worker process.
WORKER_THREADS = 8
#: Seconds a worker may take from spawn to consuming.
WORKER_READY_S = 30.0
#: Lines of each log attached to a failing chaos test's report.
LOG_TAIL_LINES = 60
#: The stack's processes that are not Celery workers.
NOT_WORKERS = ("web", "beat")
#: Credits each chaos workspace starts with.
START_CREDITS = 1_000_000

#: Stack logs of the running chaos stack, for the failure-report hook.
_RUNNING: list["ChaosStack"] = []


# -- where things run ------------------------------------------------------------


def chaos_redis_url(session_url: str) -> str:
    """Another database of the session's Redis: ours alone, flushed by us only.

    ``CHAOS_REDIS_DB`` picks it; by default 14 (13 when the session uses 14).
    """
    parts = urlsplit(session_url)
    session_db = parts.path.strip("/") or "0"
    db = os.environ.get("CHAOS_REDIS_DB") or ("13" if session_db == "14" else "14")
    if db == session_db:
        raise ValueError(f"CHAOS_REDIS_DB={db} is the session stack's database")
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def rabbitmq_answers(url: str = RABBITMQ_URL, timeout_s: float = 1.0) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=timeout_s):
            return True
    except OSError:
        return False


def require_rabbitmq() -> None:
    """Fail in CI (CI=true), skip elsewhere, when RabbitMQ does not answer."""
    if rabbitmq_answers():
        return
    reason = f"RabbitMQ does not answer at {RABBITMQ_URL} (start rabbitmq-server to run the rabbitmq broker cases)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def broker_url(broker: str, redis_url: str) -> str:
    return {"redis": redis_url, "rabbitmq": RABBITMQ_URL}[broker]


# -- catalogs --------------------------------------------------------------------


def write_catalog(directory: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the shipped catalog, changed by ``edit``, written to ``directory/name.json``."""
    raw = json.loads(Path(DEFAULT_CATALOG).read_text())
    edit(raw)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


def policy(raw: dict[str, Any], model: str) -> dict[str, Any]:
    return raw["models"][model]["policy"]


def chaos_catalog(raw: dict[str, Any]) -> None:
    """Quick retries everywhere; the synchronous providers give up reading after 1 s."""
    for model in (FLUX, GEMINI, TTS):
        policy(raw, model).update(backoff_base_s=0.2, backoff_max_s=0.5, max_attempts=3)
    for model in (GEMINI, TTS):
        policy(raw, model).update(read_timeout_s=1)
    policy(raw, TTS)["max_attempts"] = 2


def queue_timeout_catalog(raw: dict[str, Any]) -> None:
    """One BFL generation at a time; a BFL request may wait 2 s for its turn."""
    chaos_catalog(raw)
    raw["providers"]["bfl"]["max_in_flight"] = 1
    policy(raw, FLUX)["queue_timeout_s"] = 2


def cap_catalog(raw: dict[str, Any]) -> None:
    """Two BFL generations at a time."""
    chaos_catalog(raw)
    raw["providers"]["bfl"]["max_in_flight"] = 2


def fair_queue_catalog(raw: dict[str, Any]) -> None:
    """One Vertex AI generation at a time, two OpenAI ones (test_fair_queue): requests
    wait behind the provider's cap in its fair schedule. The shipped call policies
    otherwise (chaos_catalog's 1 s read timeout would cut the stub's long latencies)."""
    raw["providers"]["vertexai"]["max_in_flight"] = 1
    raw["providers"]["openai"]["max_in_flight"] = 2


CATALOGS: dict[str, Callable[[dict[str, Any]], None]] = {
    "chaos": chaos_catalog,
    "queue_timeout": queue_timeout_catalog,
    "cap2": cap_catalog,
    "cap1": fair_queue_catalog,
}


# -- the stack -------------------------------------------------------------------


def stack_env(redis_url: str, broker: str, stub_port: int, catalog: Path) -> dict[str, str]:
    """conftest's ``_stack_env``, with the chaos timings, a broker and a catalog."""
    env = dict(os.environ)
    env.update({
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": broker_url(broker, redis_url),
        "CATALOG_PATH": str(catalog),
        "PROVIDER_ORIGIN_OVERRIDE": f"http://127.0.0.1:{stub_port}",
        "BFL_API_KEY": "stub",
        "VERTEXAI_ACCESS_TOKEN": "stub",
        "OPENAI_API_KEY": "stub",
        "LEASE_SECONDS": str(LEASE_S),
        "SWEEP_INTERVAL_SECONDS": str(SWEEP_INTERVAL_S),
        "REPUBLISH_AFTER_SECONDS": str(REPUBLISH_AFTER_S),
        "DEFAULT_RATE_LIMIT": "2000/second",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    })
    env.pop("PUBLIC_BASE_URL", None)
    return env


def purge_rabbitmq(env: dict[str, str]) -> None:
    """Empty the chaos queues on RabbitMQ, so another run's leftovers do not leak in."""
    subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.main", "purge", "-f", "-Q", ",".join(QUEUES)],
        env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60,
    )


@dataclass
class ChaosStack:
    """gunicorn + beat + workers "a" and "b" against one broker and catalog."""

    key: tuple[str, str]
    env: dict[str, str]
    settings: Settings
    services: Services
    stack: Stack
    base_url: str
    stub: Stub
    stub_log: Path
    #: Byte offset of each worker's log where its current process began.
    log_starts: dict[str, int] = field(default_factory=dict)
    #: Workers sent a signal by a test: restarted by ``ensure_workers`` once they exit.
    signalled: set[str] = field(default_factory=set)

    # -- workers ---------------------------------------------------------------
    def worker_log(self, name: str) -> Path:
        return self.stack.log_dir / f"{name}.log"

    def spawn_worker(self, name: str) -> subprocess.Popen:
        log = self.worker_log(name)
        self.log_starts[name] = log.stat().st_size if log.exists() else 0
        return self.stack.start_worker(list(PROVIDERS), name=name, concurrency=WORKER_THREADS)

    def current_log(self, name: str) -> str:
        """What the worker's current process has logged so far."""
        with open(self.worker_log(name), "rb") as handle:
            handle.seek(self.log_starts.get(name, 0))
            return handle.read().decode(errors="replace")

    def wait_worker_ready(self, name: str) -> None:
        proc = self.stack.procs[name]
        deadline = time.monotonic() + WORKER_READY_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"worker {name} exited with {proc.returncode}\n\n{self.log_tails()}")
            if re.search(r"\bready\.", self.current_log(name)):
                return
            time.sleep(0.1)
        raise AssertionError(f"worker {name} not ready within {WORKER_READY_S} s\n\n{self.log_tails()}")

    def workers(self) -> list[str]:
        """Names of every worker started (alive or not)."""
        return [name for name in self.stack.procs if name not in NOT_WORKERS]

    def stop_extra_workers(self) -> None:
        """Stop (SIGTERM, then wait) and forget every worker but "a" and "b"."""
        extra = [name for name in self.workers() if name not in ("a", "b")]
        for name in extra:
            if self.stack.procs[name].poll() is None:
                self.stack.procs[name].send_signal(signal.SIGTERM)
        for name in extra:
            self.signalled.discard(name)
            proc = self.stack.procs.pop(name)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def ensure_workers(self, names: tuple[str, ...] = ("a", "b")) -> None:
        """These workers alive (a test before may have killed one), started side by side."""
        spawned = []
        for name in names:
            proc = self.stack.procs.get(name)
            if proc is not None and name in self.signalled:
                # Stopping or stopped: wait it out, then start it anew.
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.signalled.discard(name)
            if proc is None or proc.poll() is not None:
                self.spawn_worker(name)
                spawned.append(name)
        for name in spawned:
            self.wait_worker_ready(name)

    def signal_worker(self, name: str, sig: signal.Signals) -> subprocess.Popen:
        """Send ``sig`` to the worker's process (a threads pool: one process runs every task)."""
        proc = self.stack.procs[name]
        assert proc.poll() is None, f"worker {name} is not running"
        os.kill(proc.pid, sig)
        self.signalled.add(name)
        return proc

    def holder(self, request_id: str) -> str | None:
        """The worker whose current process received the delivery holding the request's lease."""
        holder = self.services.redis.hget(keys.request(request_id), "holder")
        if not holder:
            return None
        task_id = holder.decode().rsplit(":", 1)[0]  # "{task id}:{retries}"
        mark = f"Task workers.tasks.deliver[{task_id}] received"
        found = [name for name in self.workers() if mark in self.current_log(name)]
        # Several when the broker redelivered the message: the live one holds it.
        alive = [name for name in found if self.stack.procs[name].poll() is None]
        return (alive or found or [None])[-1]

    def finisher(self, request_id: str) -> str | None:
        """The worker whose current process logged the request's completion."""
        mark = f"request {request_id} completed"
        found = [name for name in self.workers() if mark in self.current_log(name)]
        return found[0] if len(found) == 1 else None

    # -- the rest ----------------------------------------------------------------
    def assert_alive(self) -> None:
        dead = self.stack.exited()
        if dead is not None:
            raise AssertionError(f"stack process {dead!r} exited\n\n{self.log_tails()}")

    def assert_alive_except_workers(self) -> None:
        """Beat and gunicorn still up (the tests stop workers on purpose)."""
        for name, proc in self.stack.procs.items():
            if name in NOT_WORKERS and proc.poll() is not None:
                raise AssertionError(f"stack process {name!r} exited\n\n{self.log_tails()}")

    def caller(self, name: str, credits: int = START_CREDITS) -> Caller:
        accounts = self.services.accounts
        workspace = accounts.create_workspace(f"chaos-{name}", queue_enabled=True, credits=credits)
        return Caller(self.base_url, workspace, accounts.mint_key(workspace))

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        out = []
        for path in [self.stub_log, *sorted(self.stack.log_dir.glob("*.log"))]:
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"==> {path} <==\n" + "\n".join(text))
        return "\n\n".join(out)

    def stop(self) -> None:
        self.stack.stop()
        self.services.redis.close()


def start_chaos_stack(key: tuple[str, str], *, redis_url: str, stub: Stub, stub_port: int, stub_log: Path,
                      catalog: Path, log_dir: Path) -> ChaosStack:
    broker, _ = key
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
    finally:
        client.close()
    env = stack_env(redis_url, broker, stub_port, catalog)
    if broker == "rabbitmq":
        purge_rabbitmq(env)
    settings = Settings.from_env(env)
    services = Services.build(settings)
    web_port = free_port()
    stack = Stack(env, log_dir=log_dir)
    running = ChaosStack(key, env, settings, services, stack, f"http://127.0.0.1:{web_port}", stub, stub_log)
    try:
        stack.start_beat()
        stack.start_web(web_port)
        running.ensure_workers()
        _probe(running)
    except BaseException:
        running.stop()
        raise
    return running


def _probe(running: ChaosStack) -> None:
    """One request end to end, so the stack serves before a test starts."""
    with running.caller("probe") as caller:
        request_id = caller.submit_ok(FLUX, {"prompt": unique_prompt("chaos probe")})
        deadline = time.monotonic() + WORKER_READY_S
        while time.monotonic() < deadline:
            running.assert_alive()
            if caller.status_body(FLUX, request_id)["status"] == "COMPLETED":
                return
            time.sleep(0.1)
    raise AssertionError(f"the chaos stack did not complete a request\n\n{running.log_tails()}")


class StackPool:
    """At most one chaos stack runs at a time (they share one Redis database)."""

    def __init__(self, redis_url: str, tmp: pytest.TempPathFactory):
        self.redis_url = redis_url
        self.tmp = tmp
        self.catalog_dir = tmp.mktemp("chaos-catalogs")
        self.stub_dir = tmp.mktemp("chaos-stub")
        self.stub_port = free_port()
        self.stub_stack = Stack(stack_env(redis_url, "redis", self.stub_port, DEFAULT_CATALOG),
                                log_dir=self.stub_dir)
        self.stub = Stub(f"http://127.0.0.1:{self.stub_port}")
        self.current: ChaosStack | None = None

    def start(self) -> None:
        self.stub_stack.start_stub(self.stub_port)
        wait_for_port(self.stub_port)

    def get(self, broker: str, catalog: str = "chaos") -> ChaosStack:
        key = (broker, catalog)
        if self.current is not None and self.current.key == key:
            self.current.assert_alive_except_workers()
            self.current.stop_extra_workers()
            self.current.ensure_workers()
            return self.current
        if broker == "rabbitmq":
            require_rabbitmq()
        self.stop_current()
        path = write_catalog(self.catalog_dir, catalog, CATALOGS[catalog])
        self.current = start_chaos_stack(
            key, redis_url=self.redis_url, stub=self.stub, stub_port=self.stub_port,
            stub_log=self.stub_dir / "stub.log", catalog=path, log_dir=self.tmp.mktemp(f"chaos-{broker}-{catalog}"),
        )
        _RUNNING[:] = [self.current]
        return self.current

    def stop_current(self) -> None:
        if self.current is not None:
            _RUNNING.clear()
            current, self.current = self.current, None
            current.stop()

    def close(self) -> None:
        try:
            self.stop_current()
        finally:
            self.stub_stack.stop()


class LogTailsOnFailure:
    """A plugin: a failing test of ``module``'s report carries the tails of the stack's logs."""

    def __init__(self, module: str):
        self.module = module

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        if report.failed and _RUNNING and item.module.__name__.endswith(self.module):
            report.sections.append((f"{self.module} stack logs (tails)", _RUNNING[0].log_tails()))


@contextlib.contextmanager
def stack_pool(redis_url: str, tmp: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[StackPool]:
    """The module's stacks, one running at a time, with their log tails on its failures."""
    module = request.module.__name__.rpartition(".")[2]
    plugin = LogTailsOnFailure(module)
    request.config.pluginmanager.register(plugin, f"{module}-log-tails")
    made = StackPool(chaos_redis_url(redis_url), tmp)
    try:
        made.start()
        yield made
    finally:
        try:
            made.close()
        finally:
            request.config.pluginmanager.unregister(plugin)


# -- what a test asserts ---------------------------------------------------------------


def record(services: Services, request_id: str) -> dict[str, str]:
    raw = services.redis.hgetall(keys.request(request_id))
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"body"}


def ledger_by_request(services: Services, workspace: str) -> dict[str, list[str]]:
    """Each request's ledger entry types, oldest first."""
    found: dict[str, list[str]] = {}
    for entry in services.accounts.ledger(workspace, count=100_000):
        found.setdefault(entry.request_id, []).append(entry.type)
    return found


def assert_settled_once(services: Services, workspace: str, charged: set[str], released: set[str],
                        price: int | dict[str, int], start: int = START_CREDITS) -> None:
    """Every request held once and settled once: ``charged`` charged, ``released`` released;
    the balance is the start less the charges and nothing is held any more."""
    assert not charged & released, f"requests both charged and released: {charged & released}"
    prices = price if isinstance(price, dict) else {rid: price for rid in charged | released}
    expected = {rid: ["hold", "charge"] for rid in charged} | {rid: ["hold", "release"] for rid in released}
    ledger = ledger_by_request(services, workspace)
    wrong = {rid: ledger.get(rid) for rid in set(ledger) | set(expected) if ledger.get(rid) != expected.get(rid)}
    assert not wrong, f"ledger entries other than one hold and one settlement per request: {wrong}"
    ws = services.accounts.get(workspace)
    assert ws is not None
    assert ws.held == 0, f"credits still held: {ws.held}"
    assert ws.credits == start - sum(prices[rid] for rid in charged), (ws.credits, start, len(charged))
    assert ws.queued == 0
    for rid in charged:
        assert record(services, rid).get("charged") == str(prices[rid]), rid
    for rid in released:
        assert record(services, rid).get("charged") in (None, "", "0"), rid


def assert_not_running(services: Services, request_ids: list[str]) -> None:
    """None of the requests is left in a running set or a queue."""
    pipe = services.redis.pipeline(transaction=False)
    for provider in PROVIDERS:
        pipe.zrange(keys.running(provider), 0, -1)
        pipe.zrange(keys.queue(provider), 0, -1)
    members = {m.decode() for found in pipe.execute() for m in found}
    assert not members & set(request_ids), f"left running or queued: {members & set(request_ids)}"


def submits(stub: Stub, route: str, bodies: list[Any]) -> list[int]:
    calls = stub.calls()["submits"]
    return [calls.get(f"{route}:{stub_digest(body)}", 0) for body in bodies]


STATUS_ORDER = {"IN_QUEUE": 0, "IN_PROGRESS": 1, "COMPLETED": 2}


def wait_all_completed(running: ChaosStack, caller: Caller, model: str, request_ids: list[str], *,
                       timeout_s: float) -> dict[str, dict[str, Any]]:
    """Every request COMPLETED within ``timeout_s`` (one bound for all), its status never
    going backwards on the way; their final status bodies."""
    done: dict[str, dict[str, Any]] = {}
    last = {request_id: "IN_QUEUE" for request_id in request_ids}

    def check() -> bool:
        for request_id in request_ids:
            if request_id not in done:
                body = caller.status_body(model, request_id)
                assert STATUS_ORDER[body["status"]] >= STATUS_ORDER[last[request_id]], (request_id, last[request_id], body)
                last[request_id] = body["status"]
                if body["status"] == "COMPLETED":
                    done[request_id] = body
        return len(done) == len(request_ids)

    try:
        wait_for(check, timeout_s=timeout_s, interval_s=0.2,
                 what=f"{len(request_ids)} {model} requests COMPLETED")
    except AssertionError as exc:
        left = {rid: record(running.services, rid) for rid in request_ids if rid not in done}
        raise AssertionError(f"{exc}; still open: {left}") from None
    return done
