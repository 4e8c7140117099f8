"""Helpers for the synchronous-route and discovery tests (test_sync_and_discovery.py).

A second front door (``SecondDoor``): gunicorn started as ``router_queue.dev.stack.Stack``
starts it, on the session stack's environment (same Redis, stub provider,
Celery worker and beat) plus settings of its own (a short
``SYNC_DEADLINE_SECONDS`` here, a short ``WEB_HEADER_TIMEOUT`` in
test_slow_clients.py), on a port of its own. Only the front door reads those
settings, so the session's worker and beat serve its requests unchanged;
nothing else of the session is touched.
"""

from __future__ import annotations

import json

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from router_queue.dev.stack import Stack, free_port

#: Seconds the whole body of one synchronous call may take client side (tests, not clients).
SYNC_READ_TIMEOUT_S = 60.0


@dataclass
class SecondDoor:
    """gunicorn (gevent workers) with front-door settings of its own, sharing the session stack."""

    stack: Stack
    base_url: str

    @classmethod
    def start(cls, env: dict[str, str], log_dir: Path, *, settings: dict[str, str], workers: int = 1) -> "SecondDoor":
        port = free_port()
        stack = Stack({**env, **settings}, log_dir=log_dir)
        stack.start_web(port, workers=workers)
        door = cls(stack, f"http://127.0.0.1:{port}")
        door.wait_serving()
        return door

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        """Until /healthz answers 200 (gunicorn workers import the app after the bind)."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            if self.stack.exited():
                break
            try:
                last = requests.get(f"{self.base_url}/healthz", timeout=2).status_code
                if last == 200:
                    return
            except requests.RequestException as exc:
                last = exc
            time.sleep(0.1)
        raise AssertionError(f"the second front door did not serve within {timeout_s} s ({last!r})\n\n"
                             f"{self.log()[-4000:]}")

    def log(self) -> str:
        path = self.stack.log_dir / "web.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def access_lines(self, method: str, path: str, status: int) -> int:
        """Lines of gunicorn's access log for ``method path`` answered ``status``
        (each a JSON line whose message is gunicorn's access format)."""
        needle = f'"{method} {path} HTTP/1.1" {status} '
        return sum(1 for line in self.log().splitlines() if needle in _message(line))

    def stop(self) -> None:
        self.stack.stop()


def _message(line: str) -> str:
    """A log line's message: the ``message`` of a JSON line, else the line."""
    try:
        parsed = json.loads(line)
    except ValueError:
        return line
    return parsed.get("message", "") if isinstance(parsed, dict) else line


def ledger_of(services: Any, workspace: str) -> dict[str, list[str]]:
    """Each request's ledger entry types (hold, charge, release), oldest first."""
    found: dict[str, list[str]] = {}
    for entry in services.accounts.ledger(workspace, count=100_000):
        found.setdefault(entry.request_id, []).append(entry.type)
    return found


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a top-level local ``$ref`` followed (``#/components/...``)."""
    while "$ref" in schema:
        node: Any = document
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def request_body_schema(document: dict[str, Any], path: str, method: str = "post") -> dict[str, Any]:
    operation = document["paths"][path][method]
    return resolve(document, operation["requestBody"]["content"]["application/json"]["schema"])


def documented_media_types(document: dict[str, Any], path: str, method: str, status: str) -> set[str]:
    return set(document["paths"][path][method]["responses"][status].get("content", {}))
