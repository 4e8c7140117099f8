"""Bulk actions' state (``POST /v2/requests/bulk``): each action's progress
hash in its workspace's slot, its Idempotency-Key, the lease its steps run
under, the index the sweeper resumes unfinished ones from, and the walk over
the workspace's history that finds the requests a filter matches.

The walk reads the history's own index with ``history.lua`` (the list's
script), newest first, from a cursor, so a step costs the same at any depth;
``bulk_note.lua`` counts each matched request once, however often a step is
run again. What is done to each request is the callers' (``workers/bulk.py``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from .. import states
from . import keys
from .record import READ_NAMES, RequestRecord, iso
from .requests_front import HISTORY_ARGS
from .scripts import argv, load_script

#: Kinds of outcome a matched request is counted under (the hash's counters).
DONE, SKIPPED, FAILED = "done", "skipped", "failed"
#: Seconds a step's lease lasts: a step longer than this would let another run beside it.
LEASE_S = 120
#: The scripts' arguments, by name (``scripts.argv``).
CREATE_ARGS = ("bulk_id", "bound_to", "keep", "max_running", "now")  # then the new hash's field, value pairs
NOTE_ARGS = ("act", "entry", "kind", "outcome", "now")
LEASE_ARGS = ("act", "token", "seconds")
#: Seconds after which an unfinished action whose step did not report is resumed by the sweeper.
STALE_S = 60.0


@dataclass(frozen=True)
class BulkFilter:
    """A bulk action's filter, checked (the history list's, and ``batch_id``)."""

    model: str | None = None
    status: str = ""
    error_type: str = ""
    since: float | None = None
    until: float | None = None
    batch_id: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}

    def as_json_wire(self) -> dict[str, Any]:
        """As the caller sent it: ``since`` and ``until`` as date-times."""
        shown = self.as_json()
        for name in ("since", "until"):
            if name in shown:
                shown[name] = iso(shown[name])
        return shown

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BulkFilter":
        return cls(**data)

    def matches(self, workspace: str, record: RequestRecord) -> bool:
        """As the history list filters (``RequestStore._listed``), and by ``batch_id``."""
        return (record.workspace == workspace and (not self.status or record.status == self.status)
                and (not self.error_type or record.error_type == self.error_type)
                and (self.batch_id is None or record.batch_id == self.batch_id))


@dataclass(frozen=True)
class Matched:
    """One request the filter matched, with its history entry's stream id."""

    entry: str
    record: RequestRecord


@dataclass(frozen=True)
class Walk:
    """A stretch of the history: the requests matched, the last entry examined, and whether it ended."""

    matched: list[Matched]
    last: str | None
    ended: bool
    examined: int = 0


@dataclass
class Progress:
    """A bulk action as ``GET /v2/requests/bulk/{id}`` shows it."""

    bulk_id: str
    workspace: str
    action: str
    status: str
    filter: BulkFilter
    created_at: float
    upper_ms: int
    base_url: str
    cursor: str = ""
    matched: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    waiting: str = ""
    limited: bool = False
    completed_at: float | None = None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class BulkActions:
    """Reads and writes bulk actions' state (``docs/KEYS.md``, "Bulk actions")."""

    def __init__(self, client: redis.Redis, *, keep_s: int, max_running: int = 10):
        self.client = client
        #: Seconds an action's progress (and its Idempotency-Key) is kept from its start.
        self.keep_s = keep_s
        #: Unfinished actions a workspace may have at once (``MAX_BULK_ACTIONS_RUNNING``).
        self.max_running = max_running
        self._create = load_script(client, "bulk_create", CREATE_ARGS)
        self._note = load_script(client, "bulk_note", NOTE_ARGS)
        self._lease = load_script(client, "bulk_lease", LEASE_ARGS)
        self._history = load_script(client, "history", HISTORY_ARGS)

    def create(self, workspace: str, bulk_id: str, *, action: str, filter: BulkFilter, base_url: str,
               key_hash: str = "", fingerprint: str = "", now: float | None = None) -> tuple[str, str]:
        """A new action ("CREATED", its id), or the one its key names ("REPLAY", id), or ("CONFLICT", ""),
        or ("FULL", "") when the workspace has :attr:`max_running` unfinished."""
        now = time.time() if now is None else now
        upper = now if filter.until is None else min(now, filter.until)
        own = keys.bulk(workspace, bulk_id)
        fields = {"workspace": workspace, "action": action, "status": states.IN_PROGRESS, "created_at": repr(now),
                  "filter": json.dumps(filter.as_json()), "upper_ms": str(math.floor(upper * 1000)),
                  "base_url": base_url, "cursor": "", "matched": "0"}
        reply = self._create(keys=[keys.bulk_idempotency(workspace, key_hash) if key_hash else own, own,
                                   keys.workspace_bulks(workspace)],
                             args=[*argv(CREATE_ARGS, bulk_id=bulk_id, bound_to=fingerprint, keep=self.keep_s,
                                         max_running=self.max_running, now=repr(now)),
                                   *(x for kv in fields.items() for x in kv)])
        outcome = _text(reply[0])
        chosen = _text(reply[1]) if len(reply) > 1 else ""
        if outcome in ("CREATED", "REPLAY"):
            self.due(workspace, chosen, now)  # a replay of one whose index entry was lost is resumed too
        return outcome, chosen

    def progress(self, workspace: str, bulk_id: str) -> Progress | None:
        raw = {_text(k): _text(v) for k, v in self.client.hgetall(keys.bulk(workspace, bulk_id)).items()}
        if not raw.get("status"):
            return None
        counts = {kind: int(raw.get(kind, 0)) for kind in (DONE, SKIPPED, FAILED)}
        outcomes: dict[str, dict[str, int]] = {DONE: {}, SKIPPED: {}, FAILED: {}}
        for name, value in raw.items():
            kind, _, outcome = name.partition(":")
            if outcome and kind in outcomes:
                outcomes[kind][outcome] = int(value)
        return Progress(bulk_id, workspace, raw["action"], raw["status"],
                        BulkFilter.from_json(json.loads(raw["filter"])),
                        float(raw["created_at"]), int(raw["upper_ms"]), raw.get("base_url", ""),
                        raw.get("cursor", ""), int(raw.get("matched", 0)), counts, outcomes, raw.get("waiting", ""),
                        raw.get("limited") == "1", float(raw["completed_at"]) if raw.get("completed_at") else None)

    def walk(self, workspace: str, flt: BulkFilter, *, upper_ms: int, since: float, after: str = "",
             examine: int = 500) -> Walk:
        """The requests ``flt`` matches among at most ``examine`` history entries
        admitted in [``since``, ``upper_ms``), newest first, below ``after``."""
        own = keys.history(workspace)
        newest = f"({after}" if after else f"({upper_ms}-0"
        oldest = f"{max(0, math.floor(since * 1000))}-0"
        reply = self._history(keys=[own, keys.model_history(workspace, flt.model) if flt.model else own],
                              args=argv(HISTORY_ARGS, newest=newest, oldest=oldest, examined=examine))
        # {"OK", more, the rate windows (none counted here), entries...}: history.lua
        found = [(_text(entry), _text(request_id)) for entry, request_id in reply[3:]]
        pipe = self.client.pipeline(transaction=False)
        for _, request_id in found:
            pipe.hmget(keys.request(request_id or "-"), READ_NAMES)
        matched = []
        for (entry, request_id), values in zip(found, pipe.execute()):
            record = RequestRecord.from_values(values) if request_id else None
            if record is not None and flt.matches(workspace, record):
                matched.append(Matched(entry, record))
        return Walk(matched, found[-1][0] if found else None, not int(reply[1]), len(found))

    def retry_standing(self, records: list[RequestRecord], retry_max: int) -> list[bool]:
        """Whether a retry would take each record now: failed, its body kept,
        its chain under ``retry_max`` retries (as admit.lua checks; an estimate
        for a dry run: nothing is held)."""
        failed = [r for r in records if r.status == states.COMPLETED and r.error_type]
        pipe = self.client.pipeline(transaction=False)
        for record in failed:
            pipe.hmget(keys.request(record.id), ("body_of", "body"))
        owners = [(_text(of) if of else record.id, body is not None)
                  for record, (of, body) in zip(failed, pipe.execute())]
        for owner, _ in owners:
            pipe.hget(keys.body_refs(owner), "retries")
            pipe.exists(keys.body(owner))
        replies = pipe.execute()
        standing = {}
        for i, (record, (_, inline)) in enumerate(zip(failed, owners)):
            retries, kept = replies[2 * i], replies[2 * i + 1]
            standing[record.id] = int(retries or 0) < retry_max and (bool(kept) or inline)
        return [standing.get(r.id, False) for r in records]

    def note(self, workspace: str, bulk_id: str, entry: str, kind: str, outcome: str) -> int:
        """Count one matched request's outcome once (``bulk_note.lua``): 1 counted, 0 before, -1 gone."""
        return int(self._note(keys=[keys.bulk(workspace, bulk_id)],
                              args=argv(NOTE_ARGS, act="note", entry=entry, kind=kind, outcome=outcome,
                                        now=time.time())))

    def pass_to(self, workspace: str, bulk_id: str, entry: str) -> int:
        """Move the cursor past unmatched entries down to ``entry``."""
        return int(self._note(keys=[keys.bulk(workspace, bulk_id)],
                              args=argv(NOTE_ARGS, act="pass", entry=entry, kind="", outcome="", now=time.time())))

    def finish(self, workspace: str, bulk_id: str, *, limited: bool = False) -> None:
        self._note(keys=[keys.bulk(workspace, bulk_id)],
                   args=argv(NOTE_ARGS, act="end", entry="", kind="limited" if limited else "", outcome="",
                             now=time.time()))
        self.forget(workspace, bulk_id)

    def waiting(self, workspace: str, bulk_id: str, reason: str) -> None:
        """The step stopped on a refusal that passes (a full backlog ...): shown until the next note."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.bulk(workspace, bulk_id), "waiting", reason)
        pipe.hincrby(keys.bulk(workspace, bulk_id), f"waits:{reason}", 1)
        pipe.execute()

    def take(self, workspace: str, bulk_id: str, token: str) -> bool:
        return bool(self._lease(keys=[keys.bulk_lease(workspace, bulk_id)],
                                args=argv(LEASE_ARGS, act="take", token=token, seconds=LEASE_S)))

    def give(self, workspace: str, bulk_id: str, token: str) -> None:
        self._lease(keys=[keys.bulk_lease(workspace, bulk_id)],
                    args=argv(LEASE_ARGS, act="give", token=token, seconds=0))

    def due(self, workspace: str, bulk_id: str, at: float) -> None:
        """When the action's next step is due (the sweeper publishes it then, should its message be lost)."""
        self.client.zadd(keys.bulks_running(), {f"{workspace}|{bulk_id}": at})

    def overdue(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        """Unfinished actions whose step is overdue by :data:`STALE_S`, each pushed
        that far ahead (so one sweep publishes it, not every sweep)."""
        members = self.client.zrangebyscore(keys.bulks_running(), "-inf", repr(now - STALE_S), start=0, num=limit)
        found = []
        for member in members:
            workspace, _, bulk_id = _text(member).partition("|")
            found.append((workspace, bulk_id))
            self.due(workspace, bulk_id, now)
        return found

    def forget(self, workspace: str, bulk_id: str) -> None:
        """An action ended (or whose progress expired) leaves the indexes of unfinished ones."""
        self.client.zrem(keys.bulks_running(), f"{workspace}|{bulk_id}")
        self.client.zrem(keys.workspace_bulks(workspace), bulk_id)
