"""The front door's gunicorn worker: gevent's, answering gunicorn's refusals of
bad input in the contract's shape and bounding how long a request head may
take. Why, and what it may import: docs/SERVING.md."""

from __future__ import annotations

import atexit
import json
import math
import os
import resource
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from gevent import get_hub, getcurrent
from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.workers import ggevent

from ..errors import InvalidInput

#: gunicorn's refusals that are not the client's malformed input (by name:
#: older gunicorn releases lack some of them).
_NOT_BAD_INPUT = tuple(getattr(http_errors, name) for name in (
    "ConfigurationProblem", "ForbiddenProxyRequest", "ExpectationFailed", "UnsupportedTransferCoding",
    "InvalidResponseHeader", "InvalidResponseHeaderName", "InvalidH2CPreface",
) if hasattr(http_errors, name))
#: Statuses gunicorn gives bad input other than 400.
_STATUS = ((http_errors.LimitRequestLine, HTTPStatus.REQUEST_URI_TOO_LONG),
           (http_errors.LimitRequestHeaders, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE))
#: Longest part of gunicorn's own message kept in ``detail`` (it may quote the input).
_DETAIL_CHARS = 200
#: The setting: seconds a connection has to send a whole request head.
HEADER_TIMEOUT_ENV = "WEB_HEADER_TIMEOUT"
#: Its default: far above what any client on a working network needs (a head
#: is one or two packets), far below the 75 s keep-alive an idle connection
#: was given before.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: libev's (and libuv's) event mask for "readable".
_READ = 1
#: Open files a worker needs besides its connections: the listener, Redis and
#: broker pools, log files, the heartbeat file.
_SPARE_FILES = 256


def refusal(exc: Exception) -> bytes | None:
    """The whole HTTP answer to ``exc``, or None when gunicorn should answer it."""
    if not isinstance(exc, http_errors.ParseException) or isinstance(exc, _NOT_BAD_INPUT):
        return None
    status = next((code for kind, code in _STATUS if isinstance(exc, kind)), HTTPStatus.BAD_REQUEST)
    error = InvalidInput(f"the server could not read this request ({status.phrase}): {str(exc)[:_DETAIL_CHARS]}")
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {status.value} {status.phrase}", "Connection: close", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *(f"{name}: {value}" for name, value in error.headers().items()),
            f"X-Comfy-Request-Id: {uuid.uuid4()}", "X-Content-Type-Options: nosniff"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def header_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """``WEB_HEADER_TIMEOUT`` in seconds (unset or empty: the default); ValueError
    unless it is a number above 0, so a typo stops gunicorn at start."""
    raw = environ.get(HEADER_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_HEADER_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"{HEADER_TIMEOUT_ENV}={raw!r}: want the seconds a client has to send a request head (> 0)")
    return seconds


def raise_open_file_limit(wanted: int) -> tuple[int, int]:
    """Raise this process's soft open-file limit to ``wanted`` if it is lower
    (never past the hard limit, which an unprivileged process cannot raise);
    the (soft, hard) limits after.

    Each connection is an open file. Many environments start processes with a
    soft limit of 1024 and a far higher hard limit (systemd's default for
    services, and containers whose runtime passes that on), and Python, unlike
    Go, does not raise it: 10,000 connections per worker would meet "Too many
    open files" at about a thousand.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft, hard


class _HeadTimedOut(BaseException):
    """Thrown into a connection's greenlet past its deadline. A BaseException, as
    gevent's own Timeout is, so no ``except Exception`` on the way swallows it."""


class HeadDeadline:
    """The bound on reading one request head: ``head_s`` from entering or, given
    ``idle_s`` (a kept-alive connection between requests), up to ``idle_s`` of
    waiting for the first byte and then ``head_s`` from that byte on.

    The first byte is seen by a watcher on the socket's descriptor, beside the
    one gevent's socket keeps while the parser waits. Bytes already buffered
    (a pipelined request) are parsed without waiting, so they never wait on
    it. Past the deadline the read is interrupted and the timeout swallowed:
    gunicorn's keep-alive loop then has no request and closes the connection,
    as it does when its own keep-alive timeout passes.
    """

    def __init__(self, client: Any, head_s: float, idle_s: float | None = None, log: Any = None,
                 peer: str = ""):
        self.client, self.head_s, self.idle_s = client, head_s, idle_s
        self.log, self.peer = log, peer
        #: "idle" or "head" while armed; which one ran out, after.
        self.phase = ""
        self._timed_out: _HeadTimedOut | None = None
        self._timer: Any = None
        self._first_byte: Any = None
        self._greenlet: Any = None

    def __enter__(self) -> "HeadDeadline":
        self._greenlet = getcurrent()
        if self.idle_s is None:
            self._arm("head", self.head_s)
        else:
            self._arm("idle", self.idle_s)
            self._first_byte = get_hub().loop.io(self.client.fileno(), _READ)
            self._first_byte.start(self._started)
        return self

    def _arm(self, phase: str, seconds: float) -> None:
        if self._timer is not None:
            self._timer.close()
        self.phase = phase
        self._timer = get_hub().loop.timer(seconds)
        self._timer.start(self._expired, update=True)

    def _started(self) -> None:
        """The next request's first byte is here: its head has ``head_s`` from now."""
        self._first_byte.close()
        self._first_byte = None
        self._arm("head", self.head_s)

    def _expired(self) -> None:
        self._timed_out = _HeadTimedOut(self.phase)
        self._greenlet.throw(self._timed_out)

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        for watcher in (self._timer, self._first_byte):
            if watcher is not None:
                watcher.close()
        self._timer = self._first_byte = None
        if exc is None or exc is not self._timed_out:
            return False
        # An idle kept-alive connection ending is routine (gunicorn says nothing either).
        if self.phase == "head" and self.log is not None:
            self.log.debug("Closing connection from ip=%s: no whole request head within %g s", self.peer,
                           self.head_s)
        return True


@dataclass(eq=False)
class _Connection:
    client: Any
    peer: str
    heads: int = 0


#: Where the workers' counters meet (router_queue/metrics.py): prometheus_client's variable.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def share_metrics_directory(log: Any, environ: Any = os.environ) -> str:
    """Give the workers one directory to count in, so that ``/metrics``,
    served by whichever worker a scrape reaches, sums them all. An operator's
    own ``PROMETHEUS_MULTIPROC_DIR`` is kept; otherwise this master makes a
    fresh one (counters start at 0 with it, as after any restart) and
    removes it when it exits. Runs in the master before any worker forks."""
    if environ.get(METRICS_DIR_ENV):
        return environ[METRICS_DIR_ENV]
    directory = tempfile.mkdtemp(prefix="router-queue-metrics-")
    environ[METRICS_DIR_ENV] = directory
    master = os.getpid()

    def remove() -> None:
        if os.getpid() == master:  # a worker exiting leaves it to the others
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
    log.info("Counting the workers' metrics in %s", directory)
    return directory


class GeventWorker(ggevent.GeventWorker):
    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """gunicorn's hook in the master, before the workers start (gevent's
        worker class has none of its own)."""
        share_metrics_directory(log)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s()
        #: The connection each greenlet serves: timeout_ctx() has no arguments.
        self._connections: dict[Any, _Connection] = {}

    def init_process(self):
        wanted = self.worker_connections + _SPARE_FILES
        soft, _ = raise_open_file_limit(wanted)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            self.log.warning("The open-file limit (%s) is below --worker-connections (%s) plus %s: past it new "
                             "connections fail to be accepted. Raise the hard limit (ulimit -Hn, LimitNOFILE, "
                             "compose ulimits).", soft, self.worker_connections, _SPARE_FILES)
        super().init_process()

    def handle(self, listener, client, addr):
        greenlet = getcurrent()
        peer = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr or "")
        self._connections[greenlet] = _Connection(client, peer)
        try:
            super().handle(listener, client, addr)
        finally:
            self._connections.pop(greenlet, None)

    def timeout_ctx(self):
        """gunicorn's keep-alive loop asks for this around each request head it
        reads: the first on a connection gets ``header_timeout_s`` from the
        accept; later ones may idle for the keep-alive first."""
        connection = self._connections.get(getcurrent())
        if connection is None:  # not a connection handle() is serving: gunicorn's own bound
            return super().timeout_ctx()
        idle_s = self.cfg.keepalive if connection.heads else None
        connection.heads += 1
        return HeadDeadline(connection.client, self.header_timeout_s, idle_s, self.log, connection.peer)

    def handle_error(self, req, client, addr, exc):
        answer = refusal(exc)
        if answer is None:
            return super().handle_error(req, client, addr, exc)
        self.log.warning("Invalid request from ip=%s: %s", (addr or ("",))[0], exc)
        try:
            util.write_nonblock(client, answer)
        except Exception:  # noqa: BLE001 - the client may be gone already; as gunicorn does
            self.log.debug("Failed to send error message.")
