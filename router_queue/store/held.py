"""The slots of held connections: a workspace's synchronous calls and event
streams held open, counted across every front-door process (``quotas.py``).

A slot is a member of the workspace's ``{ws:<id>}:held`` (``keys.held``) scored
by when its lease lapses.
``held_take.lua`` drops the lapsed ones, counts the rest against the cap and
adds the new one in one step; the process holding slots renews them all in one
round trip every third of a lease, so a killed process's slots lapse instead
of leaking.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from typing import Callable

import redis

from . import keys
from .quotas import DEFAULT_MAX_HELD
from .scripts import argv, load_script

log = logging.getLogger(__name__)

#: Seconds a held slot's lease lasts; its process renews it every third of that.
HELD_LEASE_S = 60.0
#: Seconds a refused held connection is told to wait: no telling when one of
#: the workspace's others ends, so a short, fixed hint.
HELD_RETRY_AFTER_S = 5
#: held_take.lua's ARGV by name (``scripts.argv``), in order.
TAKE_ARGS = ("slot", "now", "lease_until", "default_max", "keep_s")


class HeldSlots:
    """This process's slots in its workspaces' caps on held connections.

    ``take`` gives a slot id, or None at the cap; ``release`` gives it back.
    One thread (started by the first slot, ending with the last) renews every
    slot this process holds, in one round trip per third of a lease.
    """

    def __init__(self, client: redis.Redis, *, default_max: int = DEFAULT_MAX_HELD, lease_s: float = HELD_LEASE_S,
                 clock: Callable[[], float] = time.time):
        self.client = client
        self.default_max = default_max
        self.lease_s = lease_s
        self.clock = clock
        self._take = load_script(client, "held_take", TAKE_ARGS)
        self._prefix = uuid.uuid4().hex[:12]
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        #: slot id -> its workspace, for every slot this process holds
        self._held: dict[str, str] = {}
        self._renewer: threading.Thread | None = None

    def _keep_s(self) -> int:
        """Seconds a workspace's set outlives its last lease (then it is gone)."""
        return int(self.lease_s) + 1

    def take(self, workspace: str) -> str | None:
        slot = f"{self._prefix}:{next(self._numbers)}"
        now = self.clock()
        reply = self._take(keys=[keys.held(workspace), keys.workspace(workspace)],
                           args=argv(TAKE_ARGS, slot=slot, now=repr(now), lease_until=repr(now + self.lease_s),
                                     default_max=self.default_max, keep_s=self._keep_s()))
        if reply[0] != b"TAKEN" and reply[0] != "TAKEN":
            return None
        with self._lock:
            self._held[slot] = workspace
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_while_held, name="held-slots", daemon=True)
                self._renewer.start()
        return slot

    def release(self, slot: str) -> None:
        """Give a slot back; a failure to reach Redis leaves it to lapse."""
        with self._lock:
            workspace = self._held.pop(slot, None)
        if workspace is None:
            return
        try:
            self.client.zrem(keys.held(workspace), slot)
        except redis.RedisError as exc:
            log.warning("could not give back a held slot of %s (%s); it lapses in %.0f s",
                        workspace, exc, self.lease_s)

    def holding(self) -> int:
        """Slots this process holds now."""
        with self._lock:
            return len(self._held)

    def held(self, workspace: str) -> int:
        """The workspace's live slots, across every process."""
        return int(self.client.zcount(keys.held(workspace), repr(self.clock()), "+inf"))

    def renew(self) -> None:
        """Extend the lease of every slot this process holds (ZADD XX: a slot
        given back meanwhile is not put back)."""
        with self._lock:
            slots = list(self._held.items())
        if not slots:
            return
        until = self.clock() + self.lease_s
        pipe = self.client.pipeline(transaction=False)
        for slot, workspace in slots:
            pipe.zadd(keys.held(workspace), {slot: until}, xx=True)
        for workspace in {w for _, w in slots}:
            pipe.expire(keys.held(workspace), self._keep_s())
        pipe.execute()

    def _renew_while_held(self) -> None:
        while True:
            time.sleep(self.lease_s / 3)
            with self._lock:
                if not self._held:
                    self._renewer = None
                    return
            try:
                self.renew()
            except redis.RedisError as exc:
                log.warning("could not renew held slots (%s); trying again in %.0f s", exc, self.lease_s / 3)
