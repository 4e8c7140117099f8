"""In-memory state of one stub process: BFL tasks and call counters.

One lock guards everything; the stub serves hundreds of concurrent polls
on werkzeug's threaded server, and each critical section is a few dict
operations, so contention is not a concern. Nothing is persisted: a
restart (or POST /stub/reset) forgets every task and counter, while
success payloads stay identical because they derive only from the body.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

# Route names used in /stub/calls and as counter namespaces.
ROUTES = ("bfl_submit", "bfl_poll", "bfl_cancel", "bfl_file", "vertex_generate", "openai_speech")


@dataclass
class Task:
    """One BFL generation, keyed by its deterministic id."""

    id: str
    body_digest: str  # sha256 of the canonical submit body
    file_digest: str  # sha256 of model + canonical body; names the sample file
    prompt: str
    seed: Any
    ext: str  # "jpeg" or "png"
    latency: float  # seconds from first submission until the result is ready
    refuse: bool
    submitted_at: float  # clock() seconds at first submission
    cancelled: bool = False


class StubState:
    """Tasks, per-route call counts, and per-body attempt counters."""

    def __init__(self, clock: Callable[[], float], sleep: Callable[[float], None]):
        self.clock = clock  # seconds, monotonic
        self.sleep = sleep  # seconds
        self._lock = threading.Lock()
        self._tasks: dict[str, Task] = {}
        self._calls: Counter[str] = Counter()  # "<route>:<digest>" -> calls
        self._totals: Counter[str] = Counter()  # "<route>" -> calls
        self._attempts: Counter[str] = Counter()  # "<route>:<digest>" -> fault-eligible calls
        self._keys: Counter[str] = Counter()  # "<route>:<key>" -> authenticated calls

    def record(self, route: str, body_digest: str | None) -> None:
        """Count one call to `route`; per digest too when the body is known."""
        with self._lock:
            self._totals[route] += 1
            if body_digest is not None:
                self._calls[f"{route}:{body_digest}"] += 1

    def record_key(self, route: str, key: str) -> None:
        """Count one call to ``route`` made with ``key`` (which pool member sent it)."""
        with self._lock:
            self._keys[f"{route}:{key}"] += 1

    def next_attempt(self, route: str, body_digest: str) -> int:
        """1-based index of this authenticated, well-formed call for this body."""
        with self._lock:
            key = f"{route}:{body_digest}"
            self._attempts[key] += 1
            return self._attempts[key]

    def submit(self, task: Task) -> Task:
        """Store `task` unless its id exists; return the stored one (first submit wins)."""
        with self._lock:
            return self._tasks.setdefault(task.id, task)

    def find(self, task_id: str) -> Task | None:
        with self._lock:
            return self._tasks.get(task_id)

    def cancel(self, task_id: str, is_finished: Callable[[Task], bool]) -> str:
        """Mark a task cancelled: returns "cancelled", "missing" or "finished"."""
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                return "missing"
            if not task.cancelled and is_finished(task):
                return "finished"
            task.cancelled = True
            return "cancelled"

    def snapshot(self) -> dict[str, dict[str, int]]:
        """The /stub/calls document."""
        with self._lock:
            return {"submits": dict(sorted(self._calls.items())), "total": dict(sorted(self._totals.items())),
                    "by_key": dict(sorted(self._keys.items()))}

    def reset(self) -> None:
        with self._lock:
            self._tasks.clear()
            self._calls.clear()
            self._totals.clear()
            self._attempts.clear()
            self._keys.clear()
