"""Whether the store still holds the data this process started on.

A Redis restarted without its append-only file comes back empty and answers
as if nothing happened: every key a 401, every admitted request a 404, and
``/readyz`` 200. So the store carries an epoch marker, ``rq:config:epoch``, a
random token written (``SET NX``) with the first workspace, at setup. A
process adopts the marker it first reads; from then on, a marker gone or
replaced means the data it served is gone too, and it refuses to serve
(``StoreLost``: 503, logged as critical) instead of answering like an empty
deployment. Restore the data, or accept the loss and restart the processes.

The check is one GET, made where an empty store would show: ``/readyz``, an
API key that does not resolve (before it is answered 401), and each sweep;
and once, to adopt the marker, at the first key that resolves.
A store still in an earlier key layout is refused the same way until
``router-queue ops migrate-keys`` moves it (``migrate.py``).
A process started after the loss cannot tell an emptied store from a new
one; its ``/readyz`` still says ready, and persistence is what prevents it
(``deploy/README.md``).
"""

from __future__ import annotations

import logging
import secrets

import redis

from ..errors import StoreLost
from . import keys
from .migrate import legacy_keys_present

log = logging.getLogger(__name__)


class StoreEpoch:
    def __init__(self, client: redis.Redis):
        self.client = client
        #: The marker this process adopted; None until it first read one.
        self.known: bytes | None = None

    @staticmethod
    def mint(pipe: redis.client.Pipeline) -> None:
        """Queue the marker's first write on ``pipe`` (no-op once there is one)."""
        pipe.set(keys.epoch(), secrets.token_hex(16), nx=True)

    def adopt(self) -> None:
        """Adopt the marker if this process holds none yet: called where data
        was just found (a key resolved), so a process that started on an empty
        store knows the data it serves before any of it can be lost."""
        if self.known is None:
            self.check()

    def check(self) -> None:
        """Adopt the marker, or raise ``StoreLost`` if the adopted one is gone or replaced."""
        current = self.client.get(keys.epoch())
        if self.known is None and legacy_keys_present(self.client):
            log.critical("the store holds keys of an earlier layout; stop the service and run "
                         "`router-queue ops migrate-keys`")
            raise StoreLost("the request store holds data in an earlier key layout; nothing is served until an "
                            "operator migrates it (router-queue ops migrate-keys)", retry_after=30)
        if current is None and self.known is None and self.client.exists(keys.workspaces()):
            # Data from before the marker existed: mark it now.
            self.client.set(keys.epoch(), secrets.token_hex(16), nx=True)
            current = self.client.get(keys.epoch())
        if self.known is None:
            self.known = current
            return
        if current != self.known:
            log.critical("the store lost its data: epoch marker %s is %s (Redis restarted empty, or flushed); "
                         "refusing to serve until this process is restarted on restored or accepted data",
                         self.known.decode(), "gone" if current is None else f"now {current.decode()}")
            raise StoreLost("the request store lost its data (Redis restarted empty?); nothing is served until "
                            "an operator restores it", retry_after=30)
