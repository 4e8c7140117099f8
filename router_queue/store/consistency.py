"""The store's consistency model, chosen once per process (``Services.build``)
and handed to the stores, which ask it what to do rather than test a flag.

One Redis (:class:`OneStep`): a script may touch any key, so each change is
one atomic step. Split, one Redis would pay 1.59x the admission's latency and
1.30x Redis's CPU (``bench/strategies.py``), so it keeps this path. A Redis
Cluster (:class:`SplitSteps`): a request's provider and its workspace are in
different slots, so a change is split into per-slot steps: admission takes
three (``admission.py``), effects are owed and given apart (``owed.py``), a
poll's rate is counted apart. ``docs/ARCHITECTURE.md``, "Redis Cluster".
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import redis

from . import keys
from .admission import AdmissionSteps, LostReplies, OneStepAdmission, TwoStepAdmission
from .effects import AppliedEffects, WorkspaceEffects
from .migrate_data import open_requests
from .owed import OwedEffects
from .replication import ReplicatedWrites


class Consistency(Protocol):
    """How the store keeps a request's provider and its workspace consistent."""

    def effects(self, client: redis.Redis) -> WorkspaceEffects:
        """Where the steps that start and end requests put their workspace effects."""
        ...

    def admission(self, client: redis.Redis, lost_replies: LostReplies,
                  acknowledged: ReplicatedWrites) -> AdmissionSteps:
        """Admission's steps (``admission.py``)."""
        ...

    def rate_in_step(self, rate: Any, count_apart: Callable[[Any], None]) -> Any:
        """The rate (a ``ratelimit.Meter`` or None) a status read's own step
        counts; one counted apart first (``count_apart``) leaves None."""
        ...

    def mark_store(self, client: redis.Redis) -> None:
        """Mark a store made (or migrated) for this model (``Accounts``, ``migrate``)."""
        ...

    def unprepared(self, client: redis.Redis) -> bool:
        """Whether the store lacks what this model needs of it (``migrate.legacy_keys_present``)."""
        ...

    def prepare(self, client: redis.Redis, batch: int) -> int | None:
        """Give an older store what this model needs (``ops migrate-keys``);
        how many requests that took, or None when it needs nothing."""
        ...


class OneStep:
    """One Redis: every change in one step; nothing owed, nothing to prepare."""

    def effects(self, client: redis.Redis) -> WorkspaceEffects:
        return AppliedEffects()

    def admission(self, client: redis.Redis, lost_replies: LostReplies,
                  acknowledged: ReplicatedWrites) -> AdmissionSteps:
        return OneStepAdmission(client, lost_replies, acknowledged)

    def rate_in_step(self, rate: Any, count_apart: Callable[[Any], None]) -> Any:
        return rate

    def mark_store(self, client: redis.Redis) -> None:
        pass

    def unprepared(self, client: redis.Redis) -> bool:
        return False

    def prepare(self, client: redis.Redis, batch: int) -> int | None:
        return None


class SplitSteps:
    """A Redis Cluster: a change in per-slot steps. Its effects count once by
    each request's open entry, so a store served so has them all: the mark
    ``keys.split_steps`` says so (set with the first workspace, or by
    ``ops migrate-keys`` on a store served by one Redis until then)."""

    def effects(self, client: redis.Redis) -> WorkspaceEffects:
        return OwedEffects(client)

    def admission(self, client: redis.Redis, lost_replies: LostReplies,
                  acknowledged: ReplicatedWrites) -> AdmissionSteps:
        return TwoStepAdmission(client, lost_replies, acknowledged)

    def rate_in_step(self, rate: Any, count_apart: Callable[[Any], None]) -> Any:
        # the caller's windows are not in the record's slot
        if rate is not None:
            count_apart(rate)
        return None

    def mark_store(self, client: redis.Redis) -> None:
        client.set(keys.split_steps(), 1, nx=True)

    def unprepared(self, client: redis.Redis) -> bool:
        return not client.exists(keys.split_steps())

    def prepare(self, client: redis.Redis, batch: int) -> int | None:
        return open_requests(client, batch)


#: The models' one instance each (they hold nothing).
ONE_STEP, SPLIT_STEPS = OneStep(), SplitSteps()
