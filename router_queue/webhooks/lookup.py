"""A webhook host's name lookup, bounded in time and in number.

``getaddrinfo`` has no timeout: a nameserver that never answers holds its
caller for the system resolver's whole schedule (about 10 s by resolv.conf's
defaults). So each lookup runs on a thread of its own (a greenlet under
gevent's patched ``threading``, calling gevent's resolver) and its caller waits
at most its budget. Past it the lookup is abandoned, not stopped: it keeps one
of :data:`MAX_LOOKUPS` places until the system gives up, so a tar-pit
nameserver ties up a bounded share of a process.
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

# A plain lock held for a counter's update only (never across a wait), so it
# serves threads and greenlets alike, whenever gevent patched the process.
_lock = threading.Lock()
_running = 0


class LookupTimedOut(Exception):
    """The name did not resolve within the budget; the lookup was abandoned."""


class LookupsBusy(Exception):
    """Every place was held by a lookup still running; none was started."""


def _take_place() -> bool:
    global _running
    with _lock:
        if _running >= MAX_LOOKUPS:
            return False
        _running += 1
        return True


def _leave_place() -> None:
    global _running
    with _lock:
        _running -= 1


def running() -> int:
    """Lookups under way in this process, abandoned ones included."""
    return _running


def resolve_within(resolve: Callable[..., list], host: str, port: int, timeout_s: float) -> list:
    """``resolve(host, port, type=SOCK_STREAM)``'s answer (``getaddrinfo``'s
    shape) or its error, within ``timeout_s``; else :class:`LookupTimedOut`."""
    if not _take_place():
        raise LookupsBusy()
    outcome: list[Any] = []
    done = threading.Event()  # made per call: gevent's when the process is patched

    def run() -> None:
        try:
            outcome.append(resolve(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome.append(exc)
        finally:
            _leave_place()
            done.set()

    started = time.monotonic()
    threading.Thread(target=run, name="webhook-lookup", daemon=True).start()
    if not done.wait(max(0.0, timeout_s - (time.monotonic() - started))):
        raise LookupTimedOut()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
