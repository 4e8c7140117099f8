"""What every part of the request store shares (``requests.py`` composes
them): the client, the settings, the writes' guarantees, and the grants a
script makes, published from here. The key layout is in ``keys.py``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import redis

from ..requests.record import READ_NAMES
from . import keys
from .accounts import DEFAULT_LEDGER_RETENTION_S
from .admission import LostReplies
from .consistency import ONE_STEP, Consistency
from .quotas import DEFAULT_MAX_PENDING_WEBHOOKS, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_STORED_BYTES
from .rate_counts import SyncedRateCounts
from .replication import NO_REPLICATION, ReplicatedWrites, Replication
from .scripts import argv, load_script

log = logging.getLogger(__name__)

#: The record's fields every read takes, in this order (declared in ``requests/record.py``).
_FIELDS = READ_NAMES
#: Seconds an admission whose reply was lost is read back for, when the
#: caller set no write deadline (the front door's is its wait).
LOST_REPLY_BUDGET_S = 1.0
#: grant_unsent.lua's ARGV by name (``load_script``, ``argv``).
GRANT_UNSENT_ARGS = ("due_at",)  # then the ids


def _text(value: bytes | str | int) -> str:
    """A reply element the script or command always gives, as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe_text(value: bytes | str | None) -> str | None:
    """A field that may be missing (an ``HMGET`` of an expired record), as text or None."""
    return None if value is None else _text(value)


def _int(value: Any) -> int:
    return int(float(value)) if value else 0


def _seconds(value: bytes | None) -> float | None:
    return float(value) if value else None


@dataclass(frozen=True)
class BrokerTemplate:
    """How the scripts publish a grant themselves: the broker's list for a
    provider's queue and its Celery message with the stand-ins lib/schedule.lua fills."""

    list_key: str
    text: str


@dataclass
class GrantPublishing:
    """Where the ids a script granted go when it did not push their message:
    ``templates`` per provider for the scripts, else ``publish(provider, ids)``
    (``dispatch.Dispatcher``'s, handed to the store as ``Services`` builds it).
    Without a publisher a grant waits for the reaper, ``REPUBLISH_AFTER_SECONDS``."""

    templates: dict[str, BrokerTemplate] = field(default_factory=dict)
    publish: Callable[[str, list[str]], None] | None = None


class RequestStoreBase:
    """The settings and shared steps of :class:`~router_queue.store.requests.RequestStore`'s parts."""

    def __init__(self, client: redis.Redis, *, retention_s: int, idempotency_ttl_s: int,
                 republish_after_s: float = 30.0, max_queued: int = 1000,
                 max_in_flight: Callable[[str], int] = lambda provider: 100,
                 model_caps: Callable[[str], str] = lambda provider: "",
                 write_deadline_s: float | None = None, replication: Replication = NO_REPLICATION,
                 max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
                 max_pending_webhooks: int = DEFAULT_MAX_PENDING_WEBHOOKS, grants: GrantPublishing | None = None,
                 reads: redis.Redis | None = None, consistency: Consistency = ONE_STEP,
                 max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES, retry_max: int = 10,
                 ledger_retention_s: int = DEFAULT_LEDGER_RETENTION_S, progress_event_every_s: float,
                 low_headroom_pct: int = 0):
        self.client = client
        #: Seconds between a request's progress events at least (WEBHOOK_PROGRESS_EVERY_SECONDS).
        self.progress_event_every_s = progress_event_every_s
        #: How the store keeps a request's provider and its workspace
        #: consistent: one Redis or a cluster's per-slot steps (``consistency.py``).
        self.consistency = consistency
        #: Where starts and ends put what they owe workspaces: applied in the
        #: step, or owed and given in a step of their own (``effects.py``).
        self.effects = consistency.effects(client)
        #: Reads back an admission whose reply was lost, within the front door's wait.
        self.lost_replies = LostReplies(client, write_deadline_s or LOST_REPLY_BUDGET_S)
        #: The writes a caller is told about, held for ``replication``'s replicas.
        self.acknowledged = ReplicatedWrites(client, replication)
        #: Admission's steps: one (``admit.lua``) or a cluster's three (``admission.py``).
        self.admission = consistency.admission(client, self.lost_replies, self.acknowledged)
        #: A replica that serves status polls and event streams' position
        #: reads (``REDIS_READ_URL``), or None: the primary serves them.
        self.reads = reads
        #: Until when (monotonic s) the replica is passed over after it failed
        #: to answer: a stalled one costs one poll per REPLICA_RETRY_S its wait, not every poll.
        self._replica_down_until = 0.0
        #: Those reads' rate counts, synced with the primary in batches.
        self.read_rate_counts = SyncedRateCounts(load_script(client, "rate_add")) if reads is not None else None
        #: Requests a workspace may have waiting unless it sets its own cap.
        self.max_queued = max_queued
        #: Body bytes and webhook events pending a workspace may have unless
        #: it sets its own (``quotas.py``).
        self.max_queued_bytes = max_queued_bytes
        self.max_pending_webhooks = max_pending_webhooks
        #: Bytes of kept bodies a workspace may store unless it sets its own.
        self.max_stored_bytes = max_stored_bytes
        #: Retries a request's chain (it, its retries and theirs) may have all told.
        self.retry_max = retry_max
        self.retention_s = retention_s
        #: Seconds a workspace's ledger keeps an entry (trimmed as holds are added).
        self.ledger_retention_s = ledger_retention_s
        self.idempotency_ttl_s = idempotency_ttl_s
        #: Seconds a granted request may wait for its delivery before the
        #: reaper publishes it again (its message was lost).
        self.republish_after_s = republish_after_s
        #: A provider's fleet-wide cap on requests in flight (the catalog's).
        self.max_in_flight = max_in_flight
        #: The models whose capacity is below that cap now ("model=cap,...": a
        #: pool's per-model pauses, ``PoolCapacity.model_caps``), "" for none.
        self.model_caps = model_caps
        #: Percent of that cap (rounded up, never all of it) low-priority work
        #: leaves free for normal and high (lib/schedule.lua, low_reserve_of).
        self.low_headroom_pct = low_headroom_pct
        #: Seconds within which an admission or cancel must reach Redis or
        #: change nothing (None: no deadline). See :meth:`_deadline`.
        self.write_deadline_s = write_deadline_s
        #: How grants are published (``Services`` hands the dispatcher's in).
        self.grants = grants if grants is not None else GrantPublishing()
        self._load_scripts(client)

    def _load_scripts(self, client: redis.Redis) -> None:
        """Load the scripts this part of the store runs; each part adds its own after ``super()``'s."""
        self._grant_unsent = load_script(client, "grant_unsent", GRANT_UNSENT_ARGS)

    @property
    def unreplicated(self) -> int:
        """Writes answered before the replicas ``REDIS_WAIT_REPLICAS`` names had them."""
        return self.acknowledged.unreplicated

    # -- the schedule's grants -------------------------------------------------
    def _granting(self, provider: str, now: float) -> tuple[str, str, int | str, str]:
        """What a script that may grant a slot needs: the broker list and
        message template ("" when published from here), the provider's cap
        (with the models below it: "cap;model=cap,...", lib/model_room.lua),
        and until when a grant waits for its worker."""
        template = self.grants.templates.get(provider)
        cap: int | str = self.max_in_flight(provider)
        below = self.model_caps(provider)
        return (template.list_key if template else keys.schedule(provider), template.text if template else "",
                f"{cap};{below}" if below else cap, repr(now + self.republish_after_s))

    def _publish_granted(self, provider: str, granted: list[Any]) -> None:
        """Publish what a script granted. The grant is already written, so a
        failed publish must not fail the caller's step: the grants are made
        due at once (``grant_unsent.lua``), and the sweeper's first run that
        can publish does; if even that write fails, their lease's end does."""
        if not granted or self.grants.publish is None:
            return
        ids = [_text(i) for i in granted]
        try:
            self.grants.publish(provider, ids)
        except Exception:
            log.exception("publishing %d grant(s) for %s failed; the sweeper publishes them again", len(ids), provider)
            try:
                self._grant_unsent(keys=[keys.running(provider), *(keys.request(i) for i in ids)],
                                   args=[*argv(GRANT_UNSENT_ARGS, due_at=repr(time.time())), *ids])
            except redis.RedisError as exc:
                log.warning("grants for %s left to their lease (%s)", provider, exc)

    def _granting_args(self, provider: str, now: float) -> tuple[list[str], list[Any]]:
        list_key, template, cap, grant_until = self._granting(provider, now)
        return [keys.running(provider), list_key], [cap, grant_until, template]
