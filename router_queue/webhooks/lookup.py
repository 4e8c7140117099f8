"""A webhook host's name lookup, bounded in time and in number.

``getaddrinfo`` has no timeout: a nameserver that never answers holds its
caller for the system resolver's whole schedule (about 10 s by resolv.conf's
defaults). So each lookup runs on a thread of its own (a greenlet under
gevent's patched ``threading``, calling gevent's resolver) and its caller waits
at most its budget. Past it the lookup is abandoned, not stopped: it keeps one
of :data:`MAX_LOOKUPS` places until the system gives up, so a tar-pit
nameserver ties up a bounded share of a process. One holder (a workspace)
takes at most :data:`MAX_LOOKUPS_PER_HOLDER` of them: one tenant's tar-pit
names leave the others' lookups room.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

#: Lookups one process runs at once, abandoned ones included. Below the 10
#: threads of gevent's resolver pool, so abandoned lookups never fill it and
#: the front door's other lookups (a Redis host's name) still run.
MAX_LOOKUPS = 8
#: Of those, the most one holder's (a workspace's) lookups may take.
MAX_LOOKUPS_PER_HOLDER = 2

# A plain lock held for a counter's update only (never across a wait), so it
# serves threads and greenlets alike, whenever gevent patched the process.
_lock = threading.Lock()
_running = 0
#: Places taken by holder (a holder with none has no entry).
_held: dict[str, int] = {}


class LookupTimedOut(Exception):
    """The name did not resolve within the budget; the lookup was abandoned."""


class LookupsBusy(Exception):
    """Every place, or every place its holder may take, was held by a lookup
    still running; none was started."""


def _take_place(holder: str) -> bool:
    global _running
    with _lock:
        if _running >= MAX_LOOKUPS or (holder and _held.get(holder, 0) >= MAX_LOOKUPS_PER_HOLDER):
            return False
        _running += 1
        if holder:
            _held[holder] = _held.get(holder, 0) + 1
        return True


def _leave_place(holder: str) -> None:
    global _running
    with _lock:
        _running -= 1
        if holder:
            left = _held.pop(holder) - 1
            if left:
                _held[holder] = left


def running() -> int:
    """Lookups under way in this process, abandoned ones included."""
    return _running


def resolve_within(resolve: Callable[..., list], host: str, port: int, timeout_s: float, holder: str = "") -> list:
    """``resolve(host, port, type=SOCK_STREAM)``'s answer (``getaddrinfo``'s
    shape) or its error, within ``timeout_s``; else :class:`LookupTimedOut`.
    ``holder``: whose lookup it is (a workspace; "" for an operator's)."""
    if not _take_place(holder):
        raise LookupsBusy()
    outcome: list[Any] = []
    done = threading.Event()  # made per call: gevent's when the process is patched

    def run() -> None:
        try:
            outcome.append(resolve(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome.append(exc)
        finally:
            _leave_place(holder)
            done.set()

    started = time.monotonic()
    threading.Thread(target=run, name="webhook-lookup", daemon=True).start()
    if not done.wait(max(0.0, timeout_s - (time.monotonic() - started))):
        raise LookupTimedOut()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
