"""The heartbeat: one thread per worker process renews the leases of every
request that process is running, in one Redis round trip each beat.

A lease not renewed runs out after ``LEASE_SECONDS`` and the reaper hands the
request to another delivery; renewing every third of the lease leaves two
missed beats of slack. It is also the deliveries' time limit: a request held
past ``for_s`` (its model's ``CallPolicy.hung_after_s``) is no longer renewed,
so a hung execution loses its lease like a dead one (``MAX_TAKEOVERS`` bounds
how often). ``docs/ARCHITECTURE.md``, "The broker and the workers".
"""

from __future__ import annotations

import logging
import threading
import time

from router_queue.store.requests_delivery import DeliveryRequests

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, store: DeliveryRequests, lease_s: float):
        self.store = store
        self.lease_s = lease_s
        #: request id -> (provider, token, renewed until: time.monotonic())
        self._held: dict[str, tuple[str, str, float]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def hold(self, request_id: str, provider: str, token: str, for_s: float = float("inf")) -> None:
        with self._lock:
            self._held[request_id] = (provider, token, time.monotonic() + for_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
                self._thread.start()

    def release(self, request_id: str) -> None:
        with self._lock:
            self._held.pop(request_id, None)

    def held(self) -> list[tuple[str, str, str]]:
        """(id, provider, token) of each lease to renew; one held past its
        limit is dropped, and said so, instead."""
        now = time.monotonic()
        with self._lock:
            hung = [request_id for request_id, (_, _, until) in self._held.items() if until <= now]
            for request_id in hung:
                provider, _, _ = self._held.pop(request_id)
                log.error("request %s (%s) ran past its limit; its lease is left to run out and another "
                          "delivery takes it over", request_id, provider,
                          extra={"request_id": request_id, "outcome": "hung"})
            return [(request_id, provider, token) for request_id, (provider, token, _) in self._held.items()]

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
