"""Workspace effects owed by a provider's steps, on a store split into
per-slot steps (Redis Cluster: a request's provider and its workspace are in
different slots, so no one script may touch both).

A step that starts or ends a request, or ends its last webhook event, writes
what it owes the workspace into the provider's owed set in the same step
(``lua/lib/ledger.lua``, ``owe_ws``); its caller applies each in the workspace's own
step (``ws_settle.lua``) and drops it, and the sweeper applies what waited
longer than :data:`RECONCILE_AFTER_S`. The request's open entry
(``keys.open_requests``) makes each count once. On one Redis nothing is owed
(``effects.py``, ``AppliedEffects``). ``docs/ARCHITECTURE.md``, "Redis Cluster".
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

import redis

from . import keys
from .scripts import argv, load_script

log = logging.getLogger(__name__)

#: Seconds an owed effect waits for the caller that owes it before the
#: sweeper applies it instead (the caller applies it within a round trip).
RECONCILE_AFTER_S = 5.0
#: Most owed effects of one provider the sweeper applies per run.
RECONCILE_BATCH = 500
#: ws_settle.lua's ARGV by name (``scripts.argv``).
SETTLE_ARGS = ("effect",)


class OwedEffects:
    """A store split into per-slot steps (``effects.WorkspaceEffects``): each
    step owes its workspace effects into its provider's owed set."""

    #: The Lua file under ``lua/effects/`` that says so (``ws_target``).
    TARGET = "owed"

    def __init__(self, client: redis.Redis):
        self.client = client
        #: Called between a provider's step and its workspace's (tests kill
        #: the process there); None in service.
        self.between_steps: Callable[[], None] | None = None
        self._settle = load_script(client, "ws_settle", SETTLE_ARGS)

    def load_script(self, client: redis.Redis, name: str, args: tuple[str, ...]) -> Any:
        """A script that owes workspace effects, linked to owe them (``lua/effects/owed.lua``)."""
        return load_script(client, name, args, self.TARGET)

    def workspace_keys(self, provider: str, workspace: str) -> list[str]:
        """The provider's owed set, in both places a step takes its workspace's
        hash and ledger on one Redis (``ws_target``: it writes the one key)."""
        return [keys.owed(provider), keys.owed(provider)]

    def settle(self, provider: str, reply: list[Any]) -> list[Any]:
        """Apply the effects a step's reply owes (its JSON members, after the
        granted ids) and return the reply without them. An effect that fails
        to apply stays owed: the sweeper applies it."""
        owed = [item for item in reply if isinstance(item, bytes) and item.startswith(b"{")]
        if not owed:
            return reply
        if self.between_steps is not None:
            self.between_steps()
        try:
            self._apply(provider, owed)
        except redis.RedisError as exc:
            log.warning("%d workspace effect(s) of %s left to the sweeper (%s)", len(owed), provider, exc)
        return reply[:len(reply) - len(owed)]

    def reconcile(self, provider: str, now: float) -> int:
        """Apply the provider's effects owed longer than
        :data:`RECONCILE_AFTER_S` (their caller died between the steps);
        returns how many were applied now (not already applied)."""
        owed = self.client.zrangebyscore(keys.owed(provider), "-inf", now - RECONCILE_AFTER_S,
                                         start=0, num=RECONCILE_BATCH)
        return self._apply(provider, owed)

    def _apply(self, provider: str, owed: list[bytes]) -> int:
        applied = 0
        for effect in owed:
            workspace = json.loads(effect)["ws"]
            applied += int(self._settle(keys=[keys.workspace(workspace), keys.ledger(workspace),
                                              keys.open_requests(workspace)], args=argv(SETTLE_ARGS, effect=effect)))
            self.client.zrem(keys.owed(provider), effect)
        return applied
