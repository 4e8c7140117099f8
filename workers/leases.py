"""The heartbeat: one thread per worker process renews the leases of every
request that process is running, in one Redis round trip each beat.

A lease that is not renewed runs out after ``LEASE_SECONDS``; the reaper then
hands the request to another delivery. Renewing every third of the lease
leaves two missed beats of slack before a live worker loses a request.
"""

from __future__ import annotations

import logging
import threading

from router_queue.store import RequestStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, store: RequestStore, lease_s: float):
        self.store = store
        self.lease_s = lease_s
        self._held: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def hold(self, request_id: str, provider: str, token: str) -> None:
        with self._lock:
            self._held[request_id] = (provider, token)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
                self._thread.start()

    def release(self, request_id: str) -> None:
        with self._lock:
            self._held.pop(request_id, None)

    def held(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return [(request_id, provider, token) for request_id, (provider, token) in self._held.items()]

    def stop(self) -> None:
        self._stopped.set()

    def _beat(self) -> None:
        while not self._stopped.wait(self.lease_s / 3):
            held = self.held()
            if not held:
                continue
            try:
                self.store.renew_many(held, self.lease_s)
            except Exception:  # a missed beat is survivable; a dead heartbeat thread is not
                log.exception("lease heartbeat failed for %d request(s)", len(held))
