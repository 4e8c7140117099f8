"""Holding a connection: the synchronous route's wait, and the slot every held
connection (a synchronous call, an event stream) takes in its workspace's cap.

The waiter follows its request on the process's one subscription (``stream.py``,
``EventHub``), then reads its status, so a completion that lands between the
admit and the follow is not missed (the hub also wakes every follower once it
has subscribed, and after a gap in its subscription); after that it sleeps
until woken, with a slow safety re-read in case a notice is lost (pub/sub
does not queue for absent listeners). The key the call was made with is
checked while it waits (``auth.HeldKey``): once revoked, the call answers 401
and its generation runs on.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from ..errors import HeldCallsFull
from ..states import COMPLETED
from ..store.held import HELD_RETRY_AFTER_S, HeldSlots
from ..store.requests_front import FrontDoorRequests
from ..store.requests_values import StatusView
from .auth import HeldKey
from .stream import EventHub

#: Seconds between two safety re-reads of the status while waiting.
RECHECK_S = 5.0


def wait_until_completed(store: FrontDoorRequests, hub: EventHub, request_id: str, provider: str,
                         hold_s: float, key: HeldKey | None = None) -> StatusView:
    """The request's view once COMPLETED, or as it stands when ``hold_s`` runs
    out; ``Unauthorized`` once ``key`` (the call's) stopped working."""
    follower = hub.follow(request_id, key=key)
    try:
        end = time.monotonic() + hold_s
        while True:
            view = store.status_view(request_id, provider)
            if view.record is None or view.record.status == COMPLETED:
                return view
            left = end - time.monotonic()
            if left <= 0:
                return view
            follower.wait(min(left, RECHECK_S))
    finally:
        hub.unfollow(follower)


def take_slot(slots: HeldSlots, workspace: str) -> str:
    """A slot in the workspace's cap on held connections, or ``429 held_calls_full``."""
    slot = slots.take(workspace)
    if slot is None:
        raise HeldCallsFull("this workspace already holds as many synchronous calls and event streams open as it "
                            "may; retry when one has ended, or poll the status route instead",
                            retry_after=HELD_RETRY_AFTER_S)
    return slot


@contextmanager
def holding(slots: HeldSlots, workspace: str) -> Iterator[str]:
    """Hold a slot for the ``with`` block (the synchronous route)."""
    slot = take_slot(slots, workspace)
    try:
        yield slot
    finally:
        slots.release(slot)


class HeldFrames:
    """A stream's frames that give back its slot when the server closes the
    response (PEP 3333 ``close()``: a stream that ended, a client that left,
    or one never started)."""

    def __init__(self, frames: Iterator[str], release: Callable[[], None]):
        self._frames = frames
        self._release: Callable[[], None] | None = release

    def __iter__(self) -> Iterator[str]:
        return self._frames

    def close(self) -> None:
        try:
            close = getattr(self._frames, "close", None)
            if close is not None:
                close()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()
