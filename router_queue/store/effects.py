"""Where a provider's step puts what it owes a workspace (a request's start
and end, its last webhook event's end: the workspace's counts, held credits
and ledger), as the store's consistency model chose once (``consistency.py``).

A step is handed its target, not a flag to test: the two KEYS it writes
(:meth:`WorkspaceEffects.workspace_keys`) and the Lua that says what they are
(``ws_target`` in ``lua/effects/{target}.lua``, linked into the script as it
is loaded). On one Redis any step may touch any key, so each effect is
applied in the step that makes its change (:class:`AppliedEffects`); on a
Redis Cluster a provider's step cannot reach its workspace's slot, so it
owes them (``owed.py``, :class:`~router_queue.store.owed.OwedEffects`).
"""

from __future__ import annotations

from typing import Any, Protocol

import redis

from . import keys
from .scripts import load_script


class WorkspaceEffects(Protocol):
    """Where the steps that start and end requests put their workspace effects."""

    def load_script(self, client: redis.Redis, name: str, args: tuple[str, ...]) -> Any:
        """A script that owes workspace effects, linked with where they go."""
        ...

    def workspace_keys(self, provider: str, workspace: str) -> list[str]:
        """The two KEYS such a script takes for its workspace's hash and ledger."""
        ...

    def settle(self, provider: str, reply: list[Any]) -> list[Any]:
        """The script's reply without the effects it owed, those applied."""
        ...

    def reconcile(self, provider: str, now: float) -> int:
        """Apply what callers that died between the steps left owed; how many."""
        ...


class AppliedEffects:
    """One Redis: each effect is applied in the step, so nothing is ever owed."""

    #: The Lua file under ``lua/effects/`` that says so.
    TARGET = "applied"

    def load_script(self, client: redis.Redis, name: str, args: tuple[str, ...]) -> Any:
        return load_script(client, name, args, self.TARGET)

    def workspace_keys(self, provider: str, workspace: str) -> list[str]:
        return [keys.workspace(workspace), keys.ledger(workspace)]

    def settle(self, provider: str, reply: list[Any]) -> list[Any]:
        return reply

    def reconcile(self, provider: str, now: float) -> int:
        return 0
