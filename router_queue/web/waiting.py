"""Holding a connection until a request completes: the synchronous route.

The waiter subscribes to the request's completion channel, then reads its
status, so a completion that lands between the admit and the subscribe is
not missed; after that it sleeps on the channel, with a slow safety re-read
in case a notification is lost (pub/sub does not queue for absent listeners).
"""

from __future__ import annotations

import time

from ..states import COMPLETED
from ..store.requests import RequestStore, StatusView

#: Seconds between two safety re-reads of the status while waiting.
RECHECK_S = 5.0


def wait_until_completed(store: RequestStore, request_id: str, provider: str, hold_s: float) -> StatusView:
    """The request's view once COMPLETED, or as it stands when ``hold_s`` runs out."""
    with store.completions(request_id) as notices:
        end = time.monotonic() + hold_s
        while True:
            view = store.status_view(request_id, provider)
            if view.record is None or view.record.status == COMPLETED:
                return view
            left = end - time.monotonic()
            if left <= 0:
                return view
            notices.get_message(timeout=min(left, RECHECK_S))
