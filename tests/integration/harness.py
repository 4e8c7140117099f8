"""Helpers the integration tests share: an HTTP caller, polling, the stub's counters.

Plain code, no fixtures (those are in ``conftest.py``). Every wait has a bound in
seconds and fails with what it last saw, so a hang reads as a clear failure.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import requests

from router_queue.store import keys
from router_queue.broker.celery_app import queue_name

#: The BFL model most tests use: submit, then poll; its adapter checks for a cancel between polls.
FLUX = "bfl/flux-2-pro"
GEMINI = "vertexai/gemini-3.1-flash-image"
TTS = "openai/gpt-4o-mini-tts"

#: Threads of the one test worker (``Stack.start_worker``'s default).
WORKER_CONCURRENCY = 8
#: Seconds any single wait below may take before the test fails.
DEFAULT_WAIT_S = 20.0


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


@dataclass
class Caller:
    """One workspace's API key, speaking plain HTTP to the front door."""

    base_url: str
    workspace: str
    api_key: str
    session: requests.Session = field(default_factory=requests.Session)

    def __enter__(self) -> "Caller":
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


def forget_pace(services: Any) -> None:
    """Drop every provider's measured pace, so Retry-After starts from its defaults."""
    services.redis.delete(*[keys.stats(p) for p in services.catalog.providers()])


def broker_drained(services: Any, provider: str) -> bool:
    """No delivery of ``provider`` waiting in the broker, nor reserved and unacked by a worker."""
    return services.redis.llen(queue_name(provider)) == 0 and services.redis.hlen("unacked") == 0


@contextmanager
def saturated_worker(caller: Caller, *, threads: int = WORKER_CONCURRENCY) -> Iterator[list[str]]:
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
