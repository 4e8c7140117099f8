"""Helpers for ``test_admission_policy.py``: workspaces with their own credits and
limits, error-answer checks, many-thread fan-out, the ledger and a Redis scan.

Plain code, no fixtures; it builds on ``harness.py``.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import requests

from router_queue.store import keys
from router_queue.store.accounts import LedgerEntry, Workspace

from .harness import WORKER_CONCURRENCY, make_caller, saturated_worker

JSON = "application/json"
#: Threads (each with its own connection) the concurrency tests send from.
THREADS = 32


@contextmanager
def saturated(stack: Any, threads: int = WORKER_CONCURRENCY) -> Iterator[list[str]]:
    """``threads`` worker threads (all of them by default) busy with a long
    generation of a separate "hog" workspace, so that, once every thread is
    busy, new requests of any workspace really wait IN_QUEUE."""
    with make_caller(stack, "hog") as hog, saturated_worker(hog, threads=threads) as ids:
        yield ids


def price(services: Any, model: str) -> int:
    return services.catalog.by_id(model).price_credits


def workspace(services: Any, workspace_id: str) -> Workspace:
    found = services.accounts.get(workspace_id)
    assert found is not None, workspace_id
    return found


def ledger(services: Any, workspace_id: str) -> list[LedgerEntry]:
    return services.accounts.ledger(workspace_id, count=100_000)


def settlements(entries: list[LedgerEntry]) -> dict[str, list[tuple[str, int]]]:
    """Per request id, its ledger entries as (type, amount), oldest first."""
    out: dict[str, list[tuple[str, int]]] = {}
    for entry in entries:
        out.setdefault(entry.request_id, []).append((entry.type, entry.amount))
    return out


def sequence(services: Any, provider: str) -> int:
    """The provider's admission counter: it moves on every admit, and only then."""
    return int(services.redis.get(keys.sequence(provider)) or 0)


def rate_counters(services: Any, workspace_id: str) -> list[bytes]:
    """The workspace's rate-limit counters (``limits``' fixed-window keys under ``rq:rate``)."""
    return list(services.redis.scan_iter(match=keys.rate_window("*", workspace_id), count=1000))


def idempotency_key_name(workspace_id: str, key: str) -> str:
    return keys.idempotency(workspace_id, hashlib.sha256(key.encode()).hexdigest())


def retry_after(response: requests.Response) -> int:
    raw = response.headers.get("Retry-After")
    assert raw is not None, f"no Retry-After on {response.status_code} {response.request.method} {response.url}"
    assert raw.isdigit() and int(raw) >= 1, f"Retry-After is not whole seconds >= 1: {raw!r}"
    return int(raw)


def assert_error(response: requests.Response, status: int, bucket: str, *,
                 retry_after_expected: bool | None = False) -> dict[str, Any]:
    """An error answer of the contract: status, the bucket in the body and on
    ``X-Comfy-Error-Type``, ``X-Comfy-Request-Id``, and ``Retry-After`` exactly
    where the contract puts one (``None``: not checked)."""
    assert response.status_code == status, (response.status_code, response.headers, response.text[:500])
    assert response.headers.get("Content-Type", "").startswith(JSON), response.headers
    body = response.json()
    assert body.get("error_type") == bucket, body
    assert response.headers.get("X-Comfy-Error-Type") == bucket, response.headers
    assert response.headers.get("X-Comfy-Request-Id"), response.headers
    assert body.get("detail"), body
    if retry_after_expected is True:
        retry_after(response)
    elif retry_after_expected is False:
        assert "Retry-After" not in response.headers, response.headers
    return body


def fan_out(call: Callable[[requests.Session, int], requests.Response], count: int, *,
            threads: int = THREADS) -> list[requests.Response]:
    """``call(session, i)`` for i in range(count) from ``threads`` threads, each on
    its own session (gunicorn's sync workers close every connection, so calls
    spread over its processes); the threads start together. Answers in i order;
    a transport error fails the test with what it was."""
    answers: list[Any] = [None] * count
    lock = threading.Lock()
    todo = iter(range(count))
    start = threading.Barrier(threads)

    def work() -> None:
        with requests.Session() as session:
            start.wait()
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    answers[i] = call(session, i)
                except Exception as exc:  # noqa: BLE001 - reported below, with its index
                    answers[i] = exc

    workers = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    errors = [(i, a) for i, a in enumerate(answers) if not isinstance(a, requests.Response)]
    assert not errors, f"{len(errors)} calls got no answer, e.g. {errors[:3]}"
    return answers


def assert_no_5xx(answers: list[requests.Response]) -> None:
    bad = [(a.status_code, a.text[:200]) for a in answers if a.status_code >= 500]
    assert not bad, f"{len(bad)} answers were 5xx, e.g. {bad[:3]}"


def redis_occurrences(client: Any, needle: bytes) -> list[str]:
    """Names of the keys whose name or value (of any type) contains ``needle``."""
    found = []
    for name in client.scan_iter(count=1000):
        kind = client.type(name).decode()
        if kind == "string":
            values = [client.get(name) or b""]
        elif kind == "hash":
            values = [b for pair in client.hgetall(name).items() for b in pair]
        elif kind == "list":
            values = client.lrange(name, 0, -1)
        elif kind == "set":
            values = list(client.smembers(name))
        elif kind == "zset":
            values = client.zrange(name, 0, -1)
        elif kind == "stream":
            values = [b for _, fields in client.xrange(name) for pair in fields.items() for b in pair]
        else:  # expired between SCAN and TYPE, or a type we never write
            values = []
        if needle in name or any(needle in value for value in values):
            found.append(name.decode(errors="replace"))
    return found
