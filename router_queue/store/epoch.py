"""Whether the store still holds the data this process started on.

A Redis restarted without its data answers as if nothing happened, so the
store carries an epoch marker (``keys.epoch``), a random token written
(``SET NX``) by the first process to check it, or with the first workspace.
A process adopts the marker at its first check (as it starts); a marker gone
or replaced later means its data is gone, and it refuses to serve
(``StoreLost``: 503, logged as critical). The check is one GET, at
``/readyz``, an API key that does not resolve, and each sweep. A store in an
earlier key layout is refused the same way (``migrate.py``). Why, and what it
cannot catch: ``docs/ARCHITECTURE.md``, "The store's parts".
"""

from __future__ import annotations

import logging
import secrets

import redis

from ..errors import StoreLost
from . import keys
from .consistency import ONE_STEP, Consistency
from .migrate import legacy_keys_present

log = logging.getLogger(__name__)


class StoreEpoch:
    def __init__(self, client: redis.Redis, *, consistency: Consistency = ONE_STEP):
        self.client = client
        #: The store's consistency model, whose needs a store must meet (``consistency.py``).
        self.consistency = consistency
        #: The marker this process adopted; None until it first read one.
        self.known: bytes | None = None

    @staticmethod
    def mint(pipe: redis.Redis | redis.client.Pipeline) -> None:
        """Write the marker, or queue its write on a pipeline (no-op once there is one)."""
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
        if self.known is None and legacy_keys_present(self.client, consistency=self.consistency):
            log.critical("the store holds keys of an earlier layout (or of one Redis, now served split); stop "
                         "the service and run `router-queue ops migrate-keys`")
            raise StoreLost("the request store holds data in an earlier key layout; nothing is served until an "
                            "operator migrates it (router-queue ops migrate-keys)", retry_after=30)
        if current is None and self.known is None:
            # A new store, or data from before the marker existed: mark it now, so that
            # every process running when it is lost knows it held something.
            self.mint(self.client)
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
