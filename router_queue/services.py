"""The composition root: everything the front door and the workers share,
built once per process from one ``Settings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import redis
from celery import Celery

from .blobs.store import BlobStore, open_blob_store
from .broker.dispatch import Dispatcher
from .catalog import Catalog
from .metrics import Recorder
from .settings import Settings
from .store.accounts import Accounts
from .store.batches import BatchStore
from .store.bulk import BulkActions
from .store.connect import UNREACHABLE, connect
from .store.consistency import ONE_STEP, SPLIT_STEPS, Consistency
from .store.failures import FailureCounts
from .store.fleet import Fleet
from .store.ids import RequestIds
from .store.members import MemberStore, PoolCapacity
from .store.model_fallback import ModelFallback
from .store.regions import WorkspaceRegions
from .store.replication import Replication
from .store.requests import RequestStore
from .store.requests_base import GrantPublishing
from .store.secret_box import SecretBox, require_key
from .store.webhooks import DeliveryLimits, WebhookStore

#: Seconds a worker, the sweeper or the CLI waits on Redis before an error.
WORKER_REDIS_WAIT_S = 5.0


class Publisher(Protocol):
    """What publishes deliveries and webhook nudges: ``broker.dispatch.Dispatcher``, or a test's stand-in."""

    grants: GrantPublishing
    #: Whether the broker is the store's Redis (readiness checks one, not two).
    broker_is_store: bool
    celery: Celery

    def publish(self, request_id: str, provider: str) -> None: ...

    def publish_webhook(self, request_id: str) -> None: ...

    def publish_batch(self, workspace: str, batch_id: str) -> None: ...

    def publish_batch_webhook(self, workspace: str, batch_id: str) -> None: ...

    def publish_budget_alert(self, workspace: str, crossing: str) -> None: ...


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    store: RequestStore
    accounts: Accounts
    ids: RequestIds
    catalog: Catalog
    #: What this process counts (in its own memory: ``metrics.py``).
    metrics: Recorder
    webhooks: WebhookStore
    fleet: Fleet
    #: The providers' pools: which member a generation goes to, their pauses (``store/members.py``).
    members: MemberStore
    #: Batches of requests (``POST /v2/batches``) and their lines.
    batches: BatchStore
    #: What publishes deliveries; the store publishes its grants through it.
    #: None where nothing publishes (a grant then waits for the reaper).
    dispatcher: Publisher | None = None
    #: The object store big results live in (``OBJECT_STORE_URL``); None: all in Redis.
    blobs: BlobStore | None = None
    #: Bulk actions' state (``store/bulk.py``) and the fleet's recent failures (``store/failures.py``).
    bulk: BulkActions | None = None
    failures: FailureCounts | None = None
    #: A request's turn to a model it named in X-Comfy-Fallback-Models (``store/model_fallback.py``).
    model_fallback: ModelFallback | None = None
    #: The workspaces' region pins (``store/regions.py``).
    regions: WorkspaceRegions | None = None
    #: How the store keeps a request's provider and its workspace consistent
    #: (``store/consistency.py``): chosen once here, handed to the stores.
    consistency: Consistency = ONE_STEP

    @classmethod
    def build(cls, settings: Settings, client: redis.Redis | None = None, *, celery: Celery | None = None,
              dispatcher: Publisher | None = None, wait_s: float = WORKER_REDIS_WAIT_S,
              write_deadline_s: float | None = None, split: bool | None = None) -> "Services":
        """``client`` lets tests pass a fakeredis client; else one is made from
        the URL, waiting ``wait_s`` seconds on Redis at most. With ``celery``,
        the one :class:`Dispatcher` is built on it (tests pass a stand-in
        ``dispatcher``), and the store publishes its grants through it.
        ``write_deadline_s``: admissions and cancels that do not reach Redis
        within it change nothing (the front door's, inside its wait).
        ``split``: the store's steps run split per slot (``store/consistency.py``,
        ``SplitSteps``); by default when the store is a Redis Cluster. The one
        place the model is chosen: every store is handed it."""
        if client is None:
            client = connect(settings.redis_url, wait_s=wait_s, connect_s=min(2.0, wait_s))
        reads = None
        if settings.redis_read_url:
            reads = connect(settings.redis_read_url, wait_s=wait_s, connect_s=min(2.0, wait_s), replica=True)
        catalog = Catalog.load(settings.catalog_path)
        if dispatcher is None and celery is not None:
            dispatcher = Dispatcher(celery, providers=tuple(catalog.providers()),
                                    broker_is_store=settings.effective_broker_url == settings.redis_url)
        split = settings.store_is_cluster if split is None else split
        capacity = PoolCapacity(client, catalog.members)
        consistency = SPLIT_STEPS if split else ONE_STEP
        store = RequestStore(
            client, retention_s=settings.result_retention_s, idempotency_ttl_s=settings.idempotency_ttl_s,
            republish_after_s=settings.republish_after_s, max_queued=settings.max_queued,
            retry_max=settings.retry_max_per_request,
            max_in_flight=capacity, model_caps=capacity.model_caps, write_deadline_s=write_deadline_s,
            replication=Replication(settings.wait_replicas, settings.wait_timeout_ms),
            grants=dispatcher.grants if dispatcher is not None else None, reads=reads,
            consistency=consistency,
            ledger_retention_s=settings.ledger_retention_s,
            progress_event_every_s=settings.webhook_progress_every_s,
            low_headroom_pct=settings.low_priority_headroom_pct,
        )
        box = secret_box(settings)
        accounts = Accounts(client, providers=tuple(catalog.providers()), box=box, consistency=consistency)
        require_secrets_key(client, box)
        failures = FailureCounts(client)
        return cls(
            settings=settings,
            redis=client,
            store=store,
            accounts=accounts,
            ids=RequestIds(client),
            catalog=catalog,
            metrics=Recorder(failures=failures.count),
            webhooks=WebhookStore(client, keep_s=settings.result_retention_s, limits=webhook_limits(settings),
                                  providers=tuple(catalog.providers()), effects=store.effects),
            fleet=Fleet(client, heartbeat_s=settings.worker_heartbeat_s),
            members=MemberStore(client, grow_every_s=settings.member_grow_s),
            model_fallback=ModelFallback(client, after_s=settings.fallback_after_s),
            regions=WorkspaceRegions(client, cache_s=settings.region_pin_cache_s),
            batches=BatchStore(client, retention_s=settings.result_retention_s,
                               idempotency_ttl_s=settings.idempotency_ttl_s),
            dispatcher=dispatcher,
            blobs=open_blob_store(settings.object_store_url, allow_http=settings.object_store_allow_http),
            bulk=BulkActions(client, keep_s=settings.result_retention_s,
                             max_running=settings.max_bulk_actions_running),
            failures=failures,
            consistency=consistency,
        )


def webhook_limits(settings: Settings) -> DeliveryLimits:
    """How the webhook delivery pool is shared (``store/webhooks.py``), from the ``WEBHOOK_*`` settings."""
    return DeliveryLimits(max_in_flight_per_workspace=settings.webhook_max_in_flight_per_workspace,
                          wait_s=settings.webhook_wait_s, circuit_failures=settings.webhook_circuit_failures,
                          circuit_cooling_s=settings.webhook_circuit_cooling_s, window_s=settings.webhook_retry_for_s)


def secret_box(settings: Settings) -> SecretBox | None:
    """What seals the webhook secrets (``WEBHOOK_SECRETS_KEY``), or None when it is not set."""
    return SecretBox(settings.webhook_secrets_keys) if settings.webhook_secrets_keys else None


def require_secrets_key(client: redis.Redis, box: SecretBox | None) -> None:
    """Every process's check as it starts (``secret_box.require_key``): refused
    then, not at its first webhook. A Redis out of reach is let by: a sealed
    secret without its key then fails where it is read (``signing_secrets``)."""
    try:
        require_key(client, box)
    except UNREACHABLE:
        pass
