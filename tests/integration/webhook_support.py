"""The webhook receiver process and the operator CLI as the webhook tests drive
them (``test_webhooks.py``, ``test_webhook_flood.py``, ``test_quotas.py``).
Plain code, no fixtures; it builds on ``harness.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import requests

from router_queue.dev.stack import ROOT, free_port, wait_for_port
from tests.redis_servers import terminate

from .harness import ApiClient, RunningStack, make_caller, wait_for


class Receiver:
    """``webhook_receiver.py`` in a process of its own, on a free loopback port."""

    SCRIPT = Path(__file__).with_name("webhook_receiver.py")

    def __init__(self, directory: Path):
        self.port = free_port()
        self.log_path = directory / "receiver.jsonl"
        self._out = open(directory / "receiver.out", "ab")
        self.proc = subprocess.Popen([sys.executable, str(self.SCRIPT), "--port", str(self.port),
                                      "--log", str(self.log_path)], stdout=self._out, stderr=subprocess.STDOUT)
        try:
            wait_for_port(self.port, proc=self.proc)
        except BaseException:
            self.stop()
            raise

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, name: str) -> str:
        return f"{self.base_url}/hook/{name}"

    def configure(self, name: str, *, secrets: dict[str, str] | None = None, plan: list[str] | None = None) -> str:
        """Set ``name``'s secrets (label -> secret) and plan; returns its URL."""
        config: dict[str, Any] = {}
        if secrets is not None:
            config["secrets"] = secrets
        if plan is not None:
            config["plan"] = plan
        response = requests.put(f"{self.base_url}/_config/{name}", json=config, timeout=5)
        assert response.status_code == 204, response.text
        return self.url(name)

    def attempts(self, name: str) -> list[dict[str, Any]]:
        response = requests.get(f"{self.base_url}/_attempts/{name}", timeout=5)
        response.raise_for_status()
        return response.json()

    def wait_attempts(self, name: str, count: int, *, timeout_s: float = 20.0,
                      answered: bool = False) -> list[dict[str, Any]]:
        """At least ``count`` attempts at ``name`` (the last answered, with ``answered``)."""
        def enough() -> list[dict[str, Any]] | None:
            seen = self.attempts(name)
            if len(seen) < count or (answered and seen[count - 1]["answered_at"] is None):
                return None
            return seen
        return wait_for(enough, timeout_s=timeout_s, interval_s=0.05, what=f"{count} attempts at {name}")

    def stop(self) -> None:
        terminate(self.proc)
        self._out.close()


def cli(env: dict[str, str], *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """``router-queue ARGS`` as an operator runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-c", "from router_queue.cli import main; main()", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def cli_ok(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = cli(env, *args)
    assert done.returncode == 0, f"router-queue {' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def workspace_with_secret(stack: RunningStack, name: str) -> tuple[ApiClient, str]:
    """A fresh workspace, and the signing secret ``router-queue workspace webhook-secret`` printed for it."""
    caller = make_caller(stack, name)
    secret = cli_ok(stack.env, "workspace", "webhook-secret", caller.workspace).stdout.strip()
    assert secret.startswith("whsec_"), secret
    return caller, secret
