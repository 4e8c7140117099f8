"""Workspaces and their API keys (``apikeys.py``), kept in Redis."""

from __future__ import annotations

import builtins  # builtins.list: the class's list() method shadows the name below it
import itertools
import math
import secrets
import time
from dataclasses import dataclass
from typing import Iterator

import redis

from . import keys
from .apikeys import ApiKeys
from .budgets import Budgets
from .consistency import ONE_STEP, Consistency
from .epoch import StoreEpoch
from .scripts import argv, load_script
from .secret_box import SecretBox, SecretsKeyError, open_stored

#: Seconds a rotated-out webhook secret keeps signing beside the new one, so
#: receivers can switch to the new one without missing an event.
WEBHOOK_SECRET_OVERLAP_S = 86_400
#: Seconds a workspace's ledger keeps an entry unless settings say otherwise
#: (``LEDGER_RETENTION_SECONDS``): 35 days, a monthly statement and some days to export it.
DEFAULT_LEDGER_RETENTION_S = 35 * 86_400
#: Ledger entries read per round trip by an export (``ledger_entries``).
LEDGER_PAGE = 1000
#: schedule_limits.lua's and webhook_secret.lua's ARGV by name (``scripts.argv``), in order.
LIMITS_ARGS = ("workspace", "limits")
SECRET_ARGS = ("how", "secret", "previous_until")


def _optional_int(raw: str | None) -> int | None:
    return int(raw) if raw else None


@dataclass(frozen=True)
class Workspace:
    id: str
    name: str
    queue_enabled: bool
    #: The balance: what the workspace has, holds not yet deducted.
    credits: int
    #: Credits held for requests admitted and not yet settled.
    held: int = 0
    #: Requests waiting IN_QUEUE now.
    queued: int = 0
    max_queued: int | None = None
    rate_limit: str | None = None
    #: Its share of a provider's slots against other waiting workspaces.
    weight: int = 1
    #: Its own cap on requests in flight per provider; None: only the provider's.
    max_in_flight: int | None = None
    #: Body bytes stored for its requests not yet completed, and its own quota
    #: on them (None: ``quotas.DEFAULT_MAX_QUEUED_BYTES``).
    queued_bytes: int = 0
    max_queued_bytes: int | None = None
    #: Bytes it keeps past its requests' ends (kept bodies, counted once and
    #: released as they expire: admission releases those expired before it
    #: checks), and its own quota on them (None: ``quotas.DEFAULT_MAX_STORED_BYTES``).
    stored_bytes: int = 0
    max_stored_bytes: int | None = None
    #: Webhook events pending (owed or to be owed), and its own cap on them.
    webhooks_pending: int = 0
    max_pending_webhooks: int | None = None
    #: Its own cap on synchronous calls and event streams held open at once.
    max_held: int | None = None

    @property
    def available(self) -> int:
        return self.credits - self.held


@dataclass(frozen=True)
class LedgerEntry:
    id: str
    type: str
    request_id: str
    amount: int
    balance: int
    held: int
    at: float
    #: The request's model and its caller's key id ("" for entries written before they were kept).
    model: str = ""
    key: str = ""


class Accounts:
    def __init__(self, client: redis.Redis, providers: tuple[str, ...] = (), box: SecretBox | None = None,
                 *, consistency: Consistency = ONE_STEP):
        self.client = client
        #: The store's consistency model: a new store is marked for it (``consistency.py``).
        self.consistency = consistency
        #: Seals the webhook signing secrets (``WEBHOOK_SECRETS_KEY``); None:
        #: none set, and plaintext ones are stored until a sealed one exists.
        self.box = box
        #: The catalog's providers, whose schedules keep a copy of a waiting
        #: workspace's weight and max_in_flight (``set_limits``).
        self.providers = providers
        self._schedule_limits = load_script(client, "schedule_limits", LIMITS_ARGS)
        self.keys = ApiKeys(client)
        #: Credit budgets, the workspace's and its keys' (``budgets.py``).
        self.budgets = Budgets(client)
        self.epoch = StoreEpoch(client, consistency=consistency)
        self._webhook_secret = load_script(client, "webhook_secret", SECRET_ARGS)

    def create_workspace(self, name: str, *, queue_enabled: bool = False, credits: int = 0) -> str:
        workspace_id = "ws_" + secrets.token_hex(8)
        if not self.client.exists(keys.workspaces()):
            # A new store is written in today's layout; one that holds workspaces and no
            # marker is an earlier layout's, refused until migrated (store/migrate.py).
            self.client.set(keys.layout(), keys.LAYOUT, nx=True)
            self.consistency.mark_store(self.client)
        self.client.hset(
            keys.workspace(workspace_id),
            mapping={
                "name": name,
                "queue_enabled": "1" if queue_enabled else "0",
                "credits": credits,
                "created_at": repr(time.time()),
            },
        )
        # Listed (and its keys mintable) once its hash exists: the workspace's
        # keys and the global ones may live in different Redis Cluster slots,
        # so this is a second step, not one transaction.
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(keys.workspaces(), workspace_id)
        StoreEpoch.mint(pipe)
        pipe.execute()
        return workspace_id

    def get(self, workspace_id: str) -> Workspace | None:
        values = self.client.hgetall(keys.workspace(workspace_id))
        if not values:
            return None
        row = {k.decode(): v.decode() for k, v in values.items()}
        return Workspace(
            id=workspace_id,
            name=row.get("name", ""),
            queue_enabled=row.get("queue_enabled") == "1",
            credits=int(row.get("credits", "0")),
            held=int(row.get("held", "0")),
            queued=int(row.get("queued", "0")),
            max_queued=int(row["max_queued"]) if row.get("max_queued") else None,
            rate_limit=row.get("rate_limit") or None,
            weight=int(row.get("weight") or 1),
            max_in_flight=int(row["max_in_flight"]) if row.get("max_in_flight") else None,
            queued_bytes=int(row.get("queued_bytes") or 0),
            max_queued_bytes=_optional_int(row.get("max_queued_bytes")),
            stored_bytes=int(row.get("stored_bytes") or 0),
            max_stored_bytes=_optional_int(row.get("max_stored_bytes")),
            webhooks_pending=int(row.get("webhooks_pending") or 0),
            max_pending_webhooks=_optional_int(row.get("max_pending_webhooks")),
            max_held=_optional_int(row.get("max_held")),
        )

    def any_exist(self) -> bool:
        """Whether any workspace was ever created here: a Redis where none was
        holds no router-queue data (the CLI pointed at the wrong server)."""
        return bool(self.client.exists(keys.workspaces()))

    def list(self) -> list[Workspace]:
        ids = sorted(m.decode() for m in self.client.smembers(keys.workspaces()))
        return [ws for ws in (self.get(i) for i in ids) if ws is not None]

    def _require(self, workspace_id: str) -> None:
        if not self.client.exists(keys.workspace(workspace_id)):
            raise LookupError(f"no workspace {workspace_id!r}")

    def mint_key(self, workspace_id: str, label: str = "") -> str:
        """A new API key for the workspace; the only time the key is visible."""
        return self.keys.mint(workspace_id, label=label)[0]

    def set_queue_enabled(self, workspace_id: str, enabled: bool) -> None:
        self._require(workspace_id)
        self.client.hset(keys.workspace(workspace_id), "queue_enabled", "1" if enabled else "0")

    def mint_legacy_key(self, label: str = "") -> str:
        """A key that belongs to no workspace (the kind issued before workspaces)."""
        return self.keys.mint(None, label=label)[0]

    def set_credits(self, workspace_id: str, credits: int) -> None:
        """Set the balance. Open holds stay held against it."""
        self._require(workspace_id)
        self.client.hset(keys.workspace(workspace_id), "credits", int(credits))

    def set_limits(self, workspace_id: str, *, max_queued: int | None = None, rate_limit: str | None = None,
                   weight: int | None = None, max_in_flight: int | None = None, max_held: int | None = None,
                   max_queued_bytes: int | None = None, max_pending_webhooks: int | None = None,
                   max_stored_bytes: int | None = None) -> None:
        """The workspace's own backlog cap, request rate (Flask-Limiter
        notation), fair-share weight (new requests are scheduled by it), cap
        on requests in flight per provider (0: none), and its quotas
        (``quotas.py``): connections held open, queued body bytes, bytes kept
        past requests' ends, webhook events pending. None leaves a limit as it is."""
        self._require(workspace_id)
        mapping: dict[str, str | int] = {}
        if max_queued is not None:
            mapping["max_queued"] = int(max_queued)
        if rate_limit is not None:
            mapping["rate_limit"] = rate_limit
        if weight is not None:
            mapping["weight"] = int(weight)
        if max_in_flight is not None:
            mapping["max_in_flight"] = int(max_in_flight)
        for name, value in (("max_held", max_held), ("max_queued_bytes", max_queued_bytes),
                            ("max_pending_webhooks", max_pending_webhooks), ("max_stored_bytes", max_stored_bytes)):
            if value is not None:
                mapping[name] = int(value)
        if mapping:
            self.client.hset(keys.workspace(workspace_id), mapping=mapping)
        if weight is not None or max_in_flight is not None:
            self._copy_limits_to_schedules(workspace_id)

    def _copy_limits_to_schedules(self, workspace_id: str) -> None:
        """Each provider's schedule grants by its own copy of a waiting
        workspace's limits (``lua/lib/schedule.lua``, ``ws_limits``), so a grant reads
        only the provider's keys; the copies of the workspace's waiting
        requests follow a change here at once."""
        row = self.client.hmget(keys.workspace(workspace_id), "weight", "max_in_flight")
        weight = max(int(row[0] or 1), 1)
        copy = f"{weight}:{int(row[1] or 0)}"
        for provider in self.providers:
            self._schedule_limits(keys=[keys.schedule(provider)],
                                  args=argv(LIMITS_ARGS, workspace=workspace_id, limits=copy))

    def rate_limit(self, workspace_id: str) -> str | None:
        value = self.client.hget(keys.workspace(workspace_id), "rate_limit")
        return value.decode() if value else None

    def ledger(self, workspace_id: str, count: int = 1000) -> builtins.list[LedgerEntry]:
        """The workspace's holds, charges and releases, oldest first."""
        return builtins.list(itertools.islice(self.ledger_entries(workspace_id), count))

    def ledger_entries(self, workspace_id: str, since: float | None = None, until: float | None = None,
                       page: int = LEDGER_PAGE) -> Iterator[LedgerEntry]:
        """The ledger's entries written from ``since`` to ``until`` (Unix s, to
        the ms, inclusive; None: no bound), oldest first, read ``page`` at a time
        (XRANGE): an export holds one page in memory, never the ledger. An
        entry's id is its time in ms (``lua/lib/ledger.lua``, ``ledger_add``)."""
        start = "-" if since is None else str(max(0, math.floor(since * 1000)))
        end = "+" if until is None else str(max(0, math.floor(until * 1000)))
        while True:
            rows = self.client.xrange(keys.ledger(workspace_id), start, end, count=page)
            for entry_id, fields in rows:
                row = {k.decode(): v.decode() for k, v in fields.items()}
                yield LedgerEntry(
                    id=entry_id.decode(), type=row["type"], request_id=row["request_id"], amount=int(row["amount"]),
                    balance=int(float(row["balance"])), held=int(row["held"]), at=float(row["at"]),
                    model=row.get("model", ""), key=row.get("key", ""),
                )
            if len(rows) < page:
                return
            start = "(" + rows[-1][0].decode()

    # -- webhooks ------------------------------------------------------------
    def set_webhook_url(self, workspace_id: str, url: str | None) -> None:
        """The workspace's default webhook URL (checked by the caller); None removes it.
        Requests admitted from now on take it unless they name their own."""
        self._require(workspace_id)
        if url:
            self.client.hset(keys.workspace(workspace_id), "webhook_url", url)
        else:
            self.client.hdel(keys.workspace(workspace_id), "webhook_url")

    def set_webhook_events(self, workspace_id: str, events: str | None) -> None:
        """The events its requests' webhooks get unless a request chooses its
        own (``X-Comfy-Webhook-Events``), canonical (``webhooks.event.parse_events``);
        None removes the default: ``completed``."""
        self._require(workspace_id)
        if events:
            self.client.hset(keys.workspace(workspace_id), "webhook_events", events)
        else:
            self.client.hdel(keys.workspace(workspace_id), "webhook_events")

    def webhook_events(self, workspace_id: str) -> str | None:
        value = self.client.hget(keys.workspace(workspace_id), "webhook_events")
        return value.decode() if value else None

    def webhook_url(self, workspace_id: str) -> str | None:
        value = self.client.hget(keys.workspace(workspace_id), "webhook_url")
        return value.decode() if value else None

    def webhook_secret(self, workspace_id: str, secret: str, *, rotate: bool = False,
                       now: float | None = None) -> str:
        """Create the workspace's signing secret (``secret``) unless it has one,
        or with ``rotate`` make ``secret`` the current one while the old one
        signs beside it for :data:`WEBHOOK_SECRET_OVERLAP_S`. Returns
        "CREATED", "EXISTS" (``secret`` was not stored) or "ROTATED". Stored
        sealed with ``box``; without one, plaintext unless the store holds sealed ones."""
        until = (now or time.time()) + WEBHOOK_SECRET_OVERLAP_S
        if self.box is not None:
            self.box.mark(self.client)  # first: the marker's slot is not the workspace's
            stored = self.box.seal(secret)
        elif self.client.exists(keys.secrets_sealed()):
            raise SecretsKeyError("the store's webhook secrets are encrypted: set WEBHOOK_SECRETS_KEY")
        else:
            stored = secret
        reply = self._webhook_secret(keys=[keys.workspace(workspace_id)],
                                     args=argv(SECRET_ARGS, how="rotate" if rotate else "create", secret=stored,
                                               previous_until=repr(until)))
        outcome = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if outcome == "MISSING":
            raise LookupError(f"no workspace {workspace_id!r}")
        return outcome

    def signing_secrets(self, workspace_id: str, now: float | None = None) -> builtins.list[str]:
        """The secrets that sign the workspace's events now: the current one,
        and the previous one while a rotation's overlap lasts, opened
        (``SecretsKeyError`` when the keys open neither)."""
        current, previous, until = self.client.hmget(
            keys.workspace(workspace_id), ("webhook_secret", "webhook_secret_previous", "webhook_previous_until"))
        out = [current.decode()] if current else []
        if previous and until and float(until) > (now or time.time()):
            out.append(previous.decode())
        return [open_stored(self.box, stored) for stored in out]
