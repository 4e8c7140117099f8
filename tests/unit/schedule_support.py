"""A provider's schedule driven step by step, as a fleet of workers would."""

from __future__ import annotations

from router_queue.states import COMPLETED, IN_PROGRESS
from router_queue.store import keys
from router_queue.store.record import Submission
from router_queue.store.requests_values import Lease
from tests.unit.support import record_of

MODEL = "vertexai/gemini-3.1-flash-image"
PROVIDER = "vertexai"


class Fleet:
    """Drives the store as a fleet would, one step at a time: a worker claims
    each granted request in grant order, and generations end when told."""

    def __init__(self, services, cap: int):
        self.services, self.store = services, services.store
        self.store.max_in_flight = lambda provider: cap
        self.started: list[str] = []
        self.names: dict[str, str] = {}

    def workspace(self, name: str, **limits) -> str:
        ws = self.services.accounts.create_workspace(name, queue_enabled=True, credits=10**9)
        self.services.accounts.set_limits(ws, max_queued=10**6, **limits)
        return ws

    def submit(self, ws: str, name: str, priority: str = "normal") -> str:
        request_id = self.services.ids.mint(ws, MODEL)
        admission = self.store.admit(Submission(request_id=request_id, workspace=ws, model=MODEL, provider=PROVIDER,
                                     body="{}", priority=priority))
        assert admission.outcome == "ADMITTED"
        self.names[request_id] = name
        return request_id

    def granted(self) -> list[str]:
        return [i.decode() for i in self.services.redis.zrange(f"{keys.schedule(PROVIDER)}:granted", 0, -1)]

    def start_granted(self) -> None:
        for request_id in self.granted():
            assert self.store.claim(record_of(self.services, request_id, PROVIDER),
                                    Lease(f"t-{request_id}", 30, 3600, 3)) == "CLAIMED"
            self.started.append(request_id)

    def finish(self, request_id: str) -> None:
        assert self.store.complete(record_of(self.services, request_id, PROVIDER), output=b"{}",
                                   content_type="application/json") == COMPLETED

    def running(self) -> list[str]:
        return [i for i in self.started if self.status(i) == IN_PROGRESS]

    def run_all(self) -> list[str]:
        """Finish generations oldest first until nothing waits; the start order, by name."""
        self.start_granted()
        while self.running():
            self.finish(self.running()[0])
            self.start_granted()
        return [self.names[i] for i in self.started]

    def status(self, request_id: str) -> str:
        return self.store.status_view(request_id, PROVIDER).record.status

    def position(self, request_id: str) -> int | None:
        return self.store.status_view(request_id, PROVIDER).position
