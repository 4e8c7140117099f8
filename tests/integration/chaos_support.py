"""Stacks of our own for the chaos tests, which kill and stop their workers.

Not the session stack of ``conftest.py``: the chaos tests SIGKILL and SIGTERM
workers, run two of them, change the catalog and the broker. Each
``ChaosStack`` is a ``harness.RunningStack`` (gunicorn, beat, two Celery
workers "a" and "b") with a short lease (``harness.SHORT_LEASE``), a test
catalog and a broker, in a Redis database of its own (not the session's),
flushed when the stack starts. One stack runs at a time; the stub provider,
a stack of its own, is shared by all of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from router_queue.broker.celery_app import MAINTENANCE_QUEUE, queue_name
from router_queue.dev.stack import ROOT, free_port
from router_queue.services import Services
from router_queue.settings import DEFAULT_CATALOG
from router_queue.store import keys
from router_queue.store.connect import connect

from . import harness
from .harness import (
    FLUX,
    GEMINI,
    SHORT_LEASE,
    START_CREDITS,
    TTS,
    ApiClient,
    RunningStack,
    Stub,
    ledger_by_request,
    stack_env,
    stub_digest,
    wait_for,
)

RABBITMQ_URL = os.environ.get("CHAOS_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
BROKERS = ("redis", "rabbitmq")
PROVIDERS = ("bfl", "vertexai", "openai")
#: Every queue a chaos worker consumes; purged on RabbitMQ before a stack uses it.
QUEUES = tuple(queue_name(p) for p in PROVIDERS) + (MAINTENANCE_QUEUE,)


# -- where things run ------------------------------------------------------------


def chaos_redis_url(session_url: str) -> str:
    """Another database of the session's Redis: ours alone, flushed by us only.

    ``CHAOS_REDIS_DB`` picks it; by default 14 (13 when the session uses 14).
    A cluster has database 0 only: the pool then has a cluster of its own.
    """
    if session_url.startswith("redis+cluster://"):
        return harness.CHAOS_CLUSTER_URL
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


def broker_url(broker: str, redis_url: str) -> str | None:
    """The broker's URL: a Redis broker is the store's, unless the store is a
    cluster (None: ``stack_env`` gives it one of its own)."""
    if broker == "redis" and redis_url.startswith("redis+cluster://"):
        return None
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


def purge_rabbitmq(env: dict[str, str]) -> None:
    """Empty the chaos queues on RabbitMQ, so another run's leftovers do not leak in."""
    subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.main", "purge", "-f", "-Q", ",".join(QUEUES)],
        env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60,
    )


@dataclass(eq=False)
class ChaosStack(RunningStack):
    """gunicorn + beat + workers "a" and "b" against one broker and catalog,
    and what the tests do to the workers."""

    key: tuple[str, str] = ("redis", "chaos")
    #: Workers sent a signal by a test: restarted by ``ensure_workers`` once they exit.
    signalled: set[str] = field(default_factory=set)

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
                self.start_worker(name)
                spawned.append(name)
        self.wait_ready(spawned, serving=False)

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

    def assert_alive_except_workers(self) -> None:
        """Beat and gunicorn still up (the tests stop workers on purpose)."""
        for name, proc in self.stack.procs.items():
            if name not in self.workers() and proc.poll() is not None:
                raise AssertionError(f"stack process {name!r} exited\n\n{self.log_tails()}")


class StackPool:
    """At most one chaos stack runs at a time (they share one Redis database)."""

    def __init__(self, redis_url: str, tmp: pytest.TempPathFactory):
        self.redis_url = redis_url
        self.tmp = tmp
        self.catalog_dir = tmp.mktemp("chaos-catalogs")
        self.stub_port = free_port()
        self.stub_stack: RunningStack | None = None
        self.current: ChaosStack | None = None

    def start(self) -> None:
        self.stub_stack = RunningStack.start(stack_env(self.redis_url, stub_port=self.stub_port),
                                             self.tmp.mktemp("chaos-stub"), label="chaos stub", workers=(),
                                             beat=False, web=False)

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
        client = connect(self.redis_url, wait_s=5.0)
        try:
            client.flushdb()
        finally:
            client.close()
        env = stack_env(self.redis_url, stub_port=self.stub_port, broker_url=broker_url(broker, self.redis_url),
                        catalog=write_catalog(self.catalog_dir, catalog, CATALOGS[catalog]), **SHORT_LEASE)
        if broker == "rabbitmq":
            purge_rabbitmq(env)
        self.current = ChaosStack.start(env, self.tmp.mktemp(f"chaos-{broker}-{catalog}"), label=f"chaos {key}",
                                        stub=False, workers=("a", "b"), key=key)
        return self.current

    def stop_current(self) -> None:
        if self.current is not None:
            current, self.current = self.current, None
            current.stop()

    def close(self) -> None:
        try:
            self.stop_current()
        finally:
            if self.stub_stack is not None:
                self.stub_stack.stop()


@contextlib.contextmanager
def stack_pool(redis_url: str, tmp: pytest.TempPathFactory) -> Iterator[StackPool]:
    """A module's chaos stacks, one running at a time, and their stub."""
    made = StackPool(chaos_redis_url(redis_url), tmp)
    try:
        made.start()
        yield made
    finally:
        made.close()


# -- what a test asserts ---------------------------------------------------------------


def record(services: Services, request_id: str) -> dict[str, str]:
    raw = services.redis.hgetall(keys.request(request_id))
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"body"}


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


def wait_all_completed(running: ChaosStack, caller: ApiClient, model: str, request_ids: list[str], *,
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
