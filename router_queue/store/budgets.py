"""Credit budgets: a workspace's, and each API key's, per UTC day, ISO week
and calendar month, with alert thresholds. Limits, spend and the alerts owed
live in the workspace's hash, so admission checks them in the read it makes
anyway and writes them in its one write (``lua/lib/budget.lua``): no extra
round trip, no check-then-act. This module writes the limits, shows them,
and reads, leases and ends the crossings owed (``webhooks/budget_alerts.py``
sends them).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from . import keys
from .apikeys import AUDIT_KEPT
from .scripts import argv, load_script

#: The periods by their name on the wire and their letter in the hash's fields.
PERIODS = {"day": "d", "week": "w", "month": "m"}
PERIOD_NAMES = {letter: name for name, letter in PERIODS.items()}
#: The workspace's own scope in the fields (a key's is its id).
WORKSPACE = "ws"
#: Thresholds (per cent of each limit) alerted unless set otherwise.
DEFAULT_ALERT_AT = (80, 100)
#: budget_take.lua's, budget_sent.lua's and budget_publish.lua's ARGV by name
#: (budget_publish.lua's then the crossings).
TAKE_ARGS = ("crossing", "token", "now", "lease_until")
SENT_ARGS = ("crossing", "token", "outcome", "again_at")
PUBLISH_ARGS = ("now", "until")
_EPOCH = datetime.date(1970, 1, 1)


def period_start(period: str, at: float) -> datetime.date:
    """The first day (UTC) of the period ("day", "week", "month") holding Unix
    seconds ``at``: the day, the ISO week's Monday, the month's first. As
    ``lib/budget.lua``'s ``period_start``, which counts in Unix days."""
    day = datetime.datetime.fromtimestamp(at, datetime.timezone.utc).date()
    if period == "week":
        return day - datetime.timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    return day


def unix_day(day: datetime.date) -> int:
    return (day - _EPOCH).days


def day_of(unix_days: int) -> datetime.date:
    return _EPOCH + datetime.timedelta(days=unix_days)


def parse_alert_at(text: str) -> tuple[int, ...]:
    """"50,80,100" as sorted distinct per cents, each 1..1000; ValueError otherwise."""
    found = sorted({int(part) for part in text.split(",") if part.strip()})
    if not found or any(not 1 <= t <= 1000 for t in found):
        raise ValueError("thresholds are per cents of the budget from 1 to 1000, e.g. 50,80,100")
    return tuple(found)


@dataclass(frozen=True)
class Refusal:
    """The budget that refused a hold: whose ("workspace" or "key"), its period, limit and spend so far."""

    scope: str
    period: str
    limit: int
    spent: int

    @classmethod
    def of(cls, reply: list[Any]) -> "Refusal":
        text = [v.decode() if isinstance(v, bytes) else str(v) for v in reply[:4]]
        return cls(text[0], text[1], int(float(text[2])), int(float(text[3])))


@dataclass(frozen=True)
class Crossing:
    """A threshold crossed, owed its alert: once per scope, period and threshold."""

    workspace: str
    scope: str  # "ws" or a key id
    period: str  # "day" | "week" | "month"
    start: datetime.date
    budget: int
    threshold: int
    spent: int
    at: float
    attempts: int = 0
    #: Until when an attempt holds it, or a failed one's backoff runs (0: due now).
    due: float = 0.0
    #: Until when a message the sweeper published for it is in flight (0: none; :meth:`Budgets.publishing`).
    in_flight_until: float = 0.0

    @property
    def ident(self) -> str:
        """What budget_sent.lua finds it by."""
        return f"{self.scope}|{PERIODS[self.period]}|{unix_day(self.start)}|{self.threshold}"

    @property
    def webhook_id(self) -> str:
        """The webhook-id of every attempt at its alert: the same for a repeat, so a receiver dedupes."""
        whose = self.workspace if self.scope == WORKSPACE else f"{self.workspace}_{self.scope}"
        return f"budget_{whose}_{self.period}_{self.start.isoformat()}_{self.threshold}"

    def body(self) -> dict[str, Any]:
        found = {"type": "budget.threshold_crossed", "workspace": self.workspace, "period": self.period,
                 "period_start": self.start.isoformat(), "budget": self.budget, "threshold": self.threshold,
                 "spent": self.spent}
        if self.scope != WORKSPACE:
            found["key_id"] = self.scope
        return found


@dataclass(frozen=True)
class Budget:
    """One scope's limits (credits per period; 0: none), thresholds and spend this period."""

    scope: str
    limits: dict[str, int]
    alert_at: tuple[int, ...]
    spent: dict[str, int]


class Budgets:
    def __init__(self, client: redis.Redis):
        self.client = client
        self._take = load_script(client, "budget_take", TAKE_ARGS)
        self._sent = load_script(client, "budget_sent", SENT_ARGS)
        self._publish = load_script(client, "budget_publish", PUBLISH_ARGS)

    def set(self, workspace: str, scope: str, limits: dict[str, int | None],
            alert_at: tuple[int, ...] | None = None) -> None:
        """Set the limits named (0 clears one; None leaves it) and the thresholds."""
        ws_key = keys.workspace(workspace)
        fields: dict[str, Any] = {}
        cleared = []
        for period, limit in limits.items():
            if limit is None:
                continue
            name = f"budget|{scope}|{PERIODS[period]}"
            if limit > 0:
                fields[name] = limit
            else:
                cleared.append(name)
        if alert_at is not None:
            fields[f"budget|{scope}|alert_at"] = ",".join(map(str, alert_at))
        elif not self.client.hexists(ws_key, f"budget|{scope}|alert_at"):
            fields[f"budget|{scope}|alert_at"] = ",".join(map(str, DEFAULT_ALERT_AT))
        pipe = self.client.pipeline(transaction=False)
        if fields:
            pipe.hset(ws_key, mapping=fields)
        if cleared:
            pipe.hdel(ws_key, *cleared)
        pipe.sadd(keys.budgeted(), workspace)
        pipe.execute()

    def clear(self, workspace: str, scope: str) -> None:
        """Every limit of the scope gone (its spend stays: it keeps counting)."""
        self.client.hdel(keys.workspace(workspace), *(f"budget|{scope}|{p}" for p in PERIODS.values()),
                         f"budget|{scope}|alert_at")

    def show(self, workspace: str, now: float | None = None) -> list[Budget]:
        """The workspace's budgets (and spend, always kept) and its keys' with a limit: the workspace's first."""
        now = time.time() if now is None else now
        fields = {k.decode(): v.decode() for k, v in self.client.hgetall(keys.workspace(workspace)).items()
                  if k.startswith((b"budget|", b"spent|"))}
        scopes = sorted({WORKSPACE, *(name.split("|")[1] for name in fields if name.startswith("budget|"))},
                        key=lambda s: (s != WORKSPACE, s))
        found = []
        for scope in scopes:
            limits = {p: int(fields.get(f"budget|{scope}|{letter}", 0)) for p, letter in PERIODS.items()}
            alert_at = tuple(int(t) for t in fields.get(f"budget|{scope}|alert_at", "").split(",") if t)
            spent = {}
            for period, letter in PERIODS.items():
                start, _, amount = fields.get(f"spent|{scope}|{letter}", "").partition("|")
                current = start and int(float(start)) == unix_day(period_start(period, now))
                spent[period] = int(float(amount)) if current else 0
            found.append(Budget(scope, limits, alert_at, spent))
        return found

    @staticmethod
    def _crossing(workspace: str, c: dict[str, Any]) -> Crossing:
        return Crossing(workspace, c["scope"], PERIOD_NAMES[c["period"]], day_of(int(c["start"])), int(c["budget"]),
                        int(c["threshold"]), int(c["spent"]), float(c["at"]), int(c.get("attempts", 0)),
                        float(c.get("due", 0)), float(c.get("pub", 0)))

    def alerting(self) -> list[str]:
        """The workspaces with a budget, whose crossings may be owed."""
        return sorted(m.decode() for m in self.client.smembers(keys.budgeted()))

    def owed(self, workspaces: list[str]) -> list[Crossing]:
        """The crossings owed, of these workspaces: one pipelined read."""
        pipe = self.client.pipeline(transaction=False)
        for workspace in workspaces:
            pipe.hget(keys.workspace(workspace), "budget_owed")
        found: list[Crossing] = []
        for workspace, text in zip(workspaces, pipe.execute()):
            found.extend(self._crossing(workspace, c) for c in (json.loads(text) if text else []))
        return found

    def audit(self, crossing: Crossing, line: dict[str, Any]) -> None:
        """A crossing (``line``) in its workspace's audit log (``key audit``), newest first, kept as key changes are."""
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(keys.key_audit(crossing.workspace), json.dumps(line, separators=(",", ":")))
        pipe.ltrim(keys.key_audit(crossing.workspace), 0, AUDIT_KEPT - 1)
        pipe.execute()

    def publishing(self, workspace: str, idents: list[str], *, now: float, until: float) -> list[str]:
        """``budget_publish.lua``: those of the workspace's crossings ``idents``
        still due at ``now`` with no message in flight, each marked in flight
        until ``until`` (a take ends it sooner): the ones to publish now."""
        reply = self._publish(keys=[keys.workspace(workspace)],
                              args=[*argv(PUBLISH_ARGS, now=repr(now), until=repr(until)), *idents])
        return [v.decode() if isinstance(v, bytes) else str(v) for v in reply]

    def take(self, workspace: str, ident: str, *, token: str, now: float, lease_s: float) -> Crossing | str:
        """``budget_take.lua``: the crossing ``ident`` held for one attempt
        (``token``) until ``now + lease_s``; else "busy" (another attempt
        holds it, or its backoff runs) or "not_owed"."""
        reply = self._take(keys=[keys.workspace(workspace)],
                           args=argv(TAKE_ARGS, crossing=ident, token=token, now=repr(now),
                                     lease_until=repr(now + lease_s)))
        answer = [v.decode() if isinstance(v, bytes) else str(v) for v in reply]
        if answer[0] != "TAKEN":
            return answer[0].lower()
        return self._crossing(workspace, json.loads(answer[1]))

    def sent(self, crossing: Crossing, *, token: str, outcome: str, again_at: float = 0.0) -> int:
        """``budget_sent.lua``: the attempt ``token`` ended: "ended" (taken
        off), "failed" (an attempt counted, due again at ``again_at``) or
        "released" (not counted, due now). Its attempts now; -1 no longer
        owed, -2 another attempt holds it."""
        return int(self._sent(keys=[keys.workspace(crossing.workspace)],
                              args=argv(SENT_ARGS, crossing=crossing.ident, token=token, outcome=outcome,
                                        again_at=repr(again_at))))
