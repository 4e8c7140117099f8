"""Helpers for the operations tests (``test_operations.py``).

Plain code, no fixtures: reading ``/metrics`` into comparable samples, a
background load of submits and polls, the operator CLI as a subprocess,
headless Chromium, and the JSON log lines. The tests' private stacks are
``harness.RunningStack``s.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from router_queue.dev.stack import ROOT

from .harness import FLUX, ApiClient, unique_prompt

#: Seconds the load's HTTP client waits for any one answer.
CLIENT_TIMEOUT_S = 10.0

# -- /metrics ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    """One read of ``/metrics``: every sample by (name, sorted labels)."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    text: str

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


def scrape(ops_url: str) -> Scrape:
    """``/metrics`` read on the operator listener."""
    response = requests.get(f"{ops_url}/metrics", timeout=10)
    assert response.status_code == 200, (response.status_code, response.text[:500])
    assert response.headers["Content-Type"].startswith("text/plain"), response.headers["Content-Type"]
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Scrape(samples, response.text)


# -- a background load ---------------------------------------------------------------------


@dataclass
class Answer:
    """One HTTP exchange the load made."""

    kind: str  # "submit" | "status"
    at: float  # monotonic, when it was sent
    elapsed_s: float
    status: int | None  # None: no answer (timeout, connection error)
    error_type: str | None = None
    header_error_type: str | None = None
    retry_after: str | None = None
    failure: str | None = None


#: Sends at most of one key answered 409 (in doubt, or still being admitted), as comfy-sdk resends.
KEYED_RESENDS = 30


class Load:
    """Threads that submit FLUX requests and poll the ones admitted, until stopped."""

    def __init__(self, base_url: str, callers: list[ApiClient], pause_s: float = 0.1, keyed: int = 0):
        self.base_url = base_url
        self.callers = callers
        self.pause_s = pause_s
        #: The first ``keyed`` callers send an Idempotency-Key and, as comfy-sdk
        #: does, send it again after a 409 concurrency_limit_exceeded's Retry-After.
        self.keyed = callers[:keyed]
        #: Submits whose outcome the front door did not know (504 outcome_unknown): the id it named.
        self.in_doubt: list[tuple[ApiClient, str]] = []
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.answers: list[Answer] = []
        #: Every request admitted (201), with the caller that holds it.
        self.admitted: list[tuple[ApiClient, str]] = []
        self.threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in callers]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT_S * 3)
        assert not any(t.is_alive() for t in self.threads), "a load thread did not stop"

    def _exchange(self, kind: str, call) -> requests.Response | None:
        started = time.monotonic()
        try:
            response = call()
        except requests.RequestException as exc:
            answer = Answer(kind, started, time.monotonic() - started, None, failure=repr(exc))
            response = None
        else:
            error_type = None
            if response.status_code >= 400:
                try:
                    error_type = response.json().get("error_type")
                except ValueError:
                    error_type = "<not json>"
            answer = Answer(kind, started, time.monotonic() - started, response.status_code, error_type,
                            response.headers.get("X-Comfy-Error-Type"), response.headers.get("Retry-After"))
        with self.lock:
            self.answers.append(answer)
        return response

    def _run(self, caller: ApiClient) -> None:
        mine: list[str] = []
        turn = 0
        while not self.stop_event.is_set():
            turn += 1
            body = {"prompt": unique_prompt("under load", "[stub:latency=0.5]")}
            headers = {"Idempotency-Key": f"load-{uuid.uuid4()}"} if caller in self.keyed else {}
            response = self._exchange("submit", lambda: caller.submit(FLUX, body, headers=headers))
            for _ in range(KEYED_RESENDS):  # a key in doubt is settled, even once the load is stopping
                if not (headers and response is not None and response.status_code == 409):
                    break
                time.sleep(int(response.headers.get("Retry-After", "1")))
                response = self._exchange("submit", lambda: caller.submit(FLUX, body, headers=headers))
            if response is not None and response.status_code == 504 and "request_id" in response.json():
                with self.lock:
                    self.in_doubt.append((caller, response.json()["request_id"]))
            if response is not None and response.status_code == 201:
                request_id = response.json()["request_id"]
                mine.append(request_id)
                with self.lock:
                    self.admitted.append((caller, request_id))
            if mine:
                target = mine[turn % len(mine)]
                self._exchange("status", lambda: caller.status(FLUX, target))
            self.stop_event.wait(self.pause_s)


# -- the operator CLI ----------------------------------------------------------------------


def run_ops(env: dict[str, str], *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """``router-queue ops ARGS`` as an operator runs it, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-c", "from router_queue.cli import main; main()", "ops", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
    )


def ops_ok(env: dict[str, str], *args: str) -> str:
    done = run_ops(env, *args)
    assert done.returncode == 0, f"ops {' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def depths_table(text: str) -> dict[str, dict[str, str]]:
    """``ops depths`` output by provider: {"bfl": {"waiting": "2", ...}}."""
    lines = [line.split("\t") for line in text.strip().splitlines()]
    header, rows = lines[0], lines[1:]
    assert header == ["provider", "waiting", "in_flight", "cap", "oldest_wait_s", "draining", "workspaces_waiting",
                      "largest", "workers"], header
    return {row[0]: dict(zip(header, row)) for row in rows}


# -- headless Chromium ------------------------------------------------------------------------

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage")


def chromium() -> str:
    """The Chromium binary, which ``scripts/test`` installs; fails without it."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("headless Chromium is not on PATH: scripts/test installs it (apt-get install chromium)")


def run_chromium(binary: str, profile: Path, *args: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=timeout_s)


class ProvidersTable(HTMLParser):
    """Reads ``table#providers`` rows: provider -> [(td class, text), ...], and span#updated."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[tuple[str, str]]] = {}
        self.updated = ""
        self._in_table = False
        self._row: str | None = None
        self._cell: list[str] | None = None
        self._cell_class = ""
        self._in_updated = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "table" and attributes.get("id") == "providers":
            self._in_table = True
        elif tag == "span" and attributes.get("id") == "updated":
            self._in_updated = True
        elif self._in_table and tag == "tr" and attributes.get("data-provider"):
            self._row = attributes["data-provider"]
            self.rows[self._row] = []
        elif self._row is not None and tag == "td":
            self._cell, self._cell_class = [], attributes.get("class") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag == "span":
            self._in_updated = False
        elif tag == "tr":
            self._row = None
        elif tag == "td" and self._cell is not None and self._row is not None:
            self.rows[self._row].append((self._cell_class, "".join(self._cell).strip()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_updated:
            self.updated += data

    def cell(self, provider: str, css_class: str) -> str:
        found = [text for cls, text in self.rows[provider] if cls == css_class]
        assert len(found) == 1, (provider, css_class, self.rows[provider])
        return found[0]


def parse_ops_page(html: str) -> ProvidersTable:
    table = ProvidersTable()
    table.feed(html)
    table.close()
    return table


# -- JSON logs ------------------------------------------------------------------------------------


def json_lines(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The lines that are one JSON object each, and the others."""
    objects, others = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            parsed = json.loads(line)
        except ValueError:
            others.append(line)
            continue
        if isinstance(parsed, dict):
            objects.append(parsed)
        else:
            others.append(line)
    return objects, others
