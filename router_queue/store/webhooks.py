"""The webhook events requests owe, and their deliveries, in Redis.

An event is written by the script that makes the change it reports
(``lib/webhooks.lua``), so no crash falls between the two; a request's events are
delivered one at a time, in order. An attempt takes the event under a lease
(:meth:`WebhookStore.take`: its workspace's turn and its endpoint's circuit,
then the event), its outcome is recorded with the next attempt's time
(:meth:`WebhookStore.record`), and the sweeper picks what is due. Each script
touches one key family, on one Redis as on a cluster. The steps, fair taking
and circuits: ``docs/ARCHITECTURE.md``, "The webhook" and "Redis Cluster"; the
keys: ``docs/KEYS.md``.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from typing import Any, Callable

import redis

from ..urls import origin
from ..webhooks.values import WebhookEvent
from . import keys
from .effects import AppliedEffects, WorkspaceEffects
from .scripts import argv, load_script

log = logging.getLogger(__name__)

#: Attempts kept per workspace for ``router-queue ops webhooks``.
LOG_LENGTH = 200
#: Failing endpoints kept (the most recently failed), whatever their number.
FAILING_KEPT = 1000
#: webhook_turn.lua's ARGV by name (``scripts.argv``), in order.
TURN_ARGS = ("now", "lease_s", "token", "max_in_flight", "circuit_failures")
#: webhook_take.lua's ARGV by name (``scripts.argv``), in order.
TAKE_ARGS = ("request_id", "now", "lease_s", "token", "turn", "open_until", "wait_s", "window_s", "keep_s",
             "circuit_cooling_s", "jitter")
#: webhook_turn.lua's answers that hold a slot of the workspace's turn.
HELD = ("HELD", "PROBE")
#: webhook_record.lua's ARGV by name (``scripts.argv``), in order.
RECORD_ARGS = ("request_id", "token", "now", "outcome", "status", "error", "next_at", "keep_s", "msg_id")
#: webhook_turn_end.lua's ARGV by name (``scripts.argv``), in order.
TURN_END_ARGS = ("token", "now", "outcome", "endpoint_failed", "circuit_failures", "circuit_cooling_s",
                 "failing_window_s", "entry", "log_length", "probe")
#: webhook_due.lua's ARGV by name (``scripts.argv``), in order.
DUE_ARGS = ("now", "again_at", "limit")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class DeliveryLimits:
    """How the delivery pool is shared (the ``WEBHOOK_*`` settings)."""

    #: Attempts one workspace may have in flight at once; 0 for no cap.
    max_in_flight_per_workspace: int = 4
    #: Seconds before an event that waited (its workspace at its cap, its
    #: endpoint being probed) is published again: a random point of twice
    #: this, doubling with each wait in a row up to x64.
    wait_s: float = 1.0
    #: Failures in a row that open an endpoint's circuit; 0 for no circuit.
    circuit_failures: int = 5
    #: Seconds an open circuit keeps its endpoint's events waiting before one
    #: probes it; each waiting event comes back at a random point of the
    #: cooling after that (doubling with each wait in a row, up to x64).
    circuit_cooling_s: float = 30.0
    #: Seconds after an event was owed past which no attempt is made and no
    #: wait ends: it is given up; failing endpoints are kept this long.
    window_s: float = 86_400.0


@dataclass(frozen=True)
class Taken:
    """What ``take`` came to: "TAKEN" with the event, or why not ("WAIT" and
    "OPEN" with when it is due again)."""

    outcome: str
    event: WebhookEvent | None = None
    due_at: float | None = None


@dataclass(frozen=True)
class FailingEndpoint:
    """A workspace's endpoint (a URL origin) whose last attempts failed."""

    workspace: str
    origin: str
    failures: int
    last_failure_at: float
    #: Until when its circuit keeps its events waiting; None while closed.
    open_until: float | None


@dataclass(frozen=True)
class Attempt:
    """One line of a workspace's attempt log."""

    at: float
    request_id: str
    #: The URL's origin only.
    origin: str
    attempt: int
    outcome: str
    status: int | None
    error: str
    seconds: float


class WebhookStore:
    def __init__(self, client: redis.Redis, *, keep_s: int, limits: DeliveryLimits = DeliveryLimits(),
                 rand: random.Random | None = None, providers: tuple[str, ...] = (),
                 effects: WorkspaceEffects | None = None):
        self.client = client
        #: Where an ended event gives back its workspace's pending count: in
        #: the step, or owed on a split store (the request store's: ``effects.py``).
        self.effects: WorkspaceEffects = effects or AppliedEffects()
        #: The catalog's providers: each keeps its requests' pending events.
        self.providers = providers
        #: Seconds an event is kept once delivered or given up.
        self.keep_s = keep_s
        self.limits = limits
        self._rand = rand or random.Random()
        self._turn = load_script(client, "webhook_turn", TURN_ARGS)
        self._take = self.effects.load_script(client, "webhook_take", TAKE_ARGS)
        self._record = self.effects.load_script(client, "webhook_record", RECORD_ARGS)
        self._turn_end = load_script(client, "webhook_turn_end", TURN_END_ARGS)
        self._due = load_script(client, "webhook_due", DUE_ARGS)

    def take(self, request_id: str, *, now: float, lease_s: float, token: str) -> Taken:
        """Take the event for one attempt, in its workspace's turn and past its
        endpoint's circuit: the workspace's part first (``webhook_turn.lua``),
        then the event's (``webhook_take.lua``), each with its own family's
        keys. A turn held for an event the second part then does not take
        (another attempt took or ended it in between) is given back at once
        (``webhook_turn_end.lua``); one whose caller died between the two
        frees itself at its lease's end, as a killed worker's does."""
        # An event's workspace, URL and provider never change once owed:
        # reading them first races with nothing. Its state, read with them,
        # spares a duplicate or early message the workspace's turn.
        workspace, url, provider, state, next_at, lease_until = (
            _text(v) if v is not None else None for v in self.client.hmget(
                keys.webhook_event(request_id), "workspace", "url", "provider", "state", "next_at", "lease_until"))
        workspace, provider = workspace or "", provider or ""  # None: no event (the take says GONE)
        endpoint = origin(url or "")
        limits = self.limits
        turn, open_until = "", ""
        if state == "pending" and float(lease_until or 0) <= now and float(next_at or 0) <= now:
            turn, open_until = self.turn(workspace, endpoint, now=now, lease_s=lease_s, token=token)
        reply = self._take(
            keys=[keys.webhook_event(request_id), keys.webhooks_due(provider, request_id),
                  *self._workspace_keys(provider, workspace)],
            args=argv(TAKE_ARGS, request_id=request_id, now=repr(now), lease_s=lease_s, token=token, turn=turn,
                      open_until=open_until, wait_s=repr(limits.wait_s), window_s=repr(limits.window_s),
                      keep_s=self.keep_s, circuit_cooling_s=repr(limits.circuit_cooling_s),
                      jitter=repr(self._rand.random())))
        outcome = _text(reply[0])
        if turn in HELD and outcome != "TAKEN":
            self._after_event("a turn given back", lambda: self.end_turn(workspace, endpoint, token=token,
                                                                          now=now, probe=turn == "PROBE"))
        if outcome == "GAVE_UP":
            self.effects.settle(provider, reply)
        if outcome in ("WAIT", "OPEN"):
            return Taken(outcome, due_at=float(_text(reply[1])))
        if outcome != "TAKEN":
            return Taken(outcome)
        pipe = self.client.pipeline(transaction=False)  # every workspace's: the in-flight gauge
        pipe.zremrangebyscore(keys.webhooks_in_flight(), "-inf", now)
        pipe.zadd(keys.webhooks_in_flight(), {token: now + lease_s})
        self._after_event("the attempts in flight", pipe.execute)
        flat = [_text(v) for v in reply[1:]]
        return Taken(outcome, WebhookEvent.from_fields(dict(zip(flat[::2], flat[1::2]))))

    def turn(self, workspace: str, endpoint: str, *, now: float, lease_s: float, token: str) -> tuple[str, str]:
        """``webhook_turn.lua``: a slot of the workspace's turn for one attempt
        at ``endpoint`` (an origin) past its circuit: (answer, open until or
        ""). HELD and PROBE hold the slot until :meth:`end_turn` or the lease's end."""
        limits = self.limits
        answer = [_text(v) for v in self._turn(
            keys=[keys.webhook_in_flight(workspace), keys.webhook_circuit(workspace, endpoint)],
            args=argv(TURN_ARGS, now=repr(now), lease_s=lease_s, token=token,
                      max_in_flight=limits.max_in_flight_per_workspace, circuit_failures=limits.circuit_failures))]
        return answer[0], answer[1] if len(answer) > 1 else ""

    def record(self, event: WebhookEvent, *, token: str, now: float, outcome: str, status: int | None,
               error: str, seconds: float, next_at: float | None, endpoint_failed: bool | None = None) -> str:
        """Record an attempt's ``outcome`` ("delivered", "gone", "failed");
        ``next_at`` None after a failure gives the event up. ``endpoint_failed``
        says whether a failure was the endpoint's (it counts towards its
        circuit): by default, every failure is. The event's part first
        (``webhook_record.lua``, and the workspace's pending count it owes,
        given through ``effects``), then the workspace's (``webhook_turn_end.lua``:
        the slot freed, the circuit, the attempt log), then every workspace's
        (the in-flight gauge's set, the failing endpoints). Returns what
        ``webhook_record.lua`` answered."""
        if endpoint_failed is None:
            endpoint_failed = outcome == "failed"
        endpoint = origin(event.url)
        reply = self._record(
            keys=[keys.webhook_event(event.request_id), keys.webhooks_due(event.provider, event.request_id),
                  *self._workspace_keys(event.provider, event.workspace)],
            args=argv(RECORD_ARGS, request_id=event.request_id, token=token, now=repr(now), outcome=outcome,
                      status="" if status is None else status, error=error[:300],
                      next_at="" if next_at is None else repr(next_at), keep_s=self.keep_s, msg_id=event.msg_id))
        recorded = _text(self.effects.settle(event.provider, reply)[0])
        entry = json.dumps({"at": now, "request_id": event.request_id, "event": event.event, "origin": endpoint,
                            "attempt": event.attempt, "outcome": outcome, "status": status, "error": error[:300],
                            "seconds": round(seconds, 3)}, separators=(",", ":"))
        self._after_event("the workspace's part of a record", lambda: self.end_turn(
            event.workspace, endpoint, token=token, now=now, outcome=outcome, endpoint_failed=endpoint_failed,
            entry="" if recorded == "MISSING" else entry))
        failing, member = keys.webhooks_failing(), f"{event.workspace}|{endpoint}"
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(keys.webhooks_in_flight(), token)
        if outcome in ("delivered", "gone"):
            pipe.zrem(failing, member)  # it answered
        elif endpoint_failed:
            pipe.zadd(failing, {member: now})
            # bounded: none older than the window, at most FAILING_KEPT of them
            pipe.zremrangebyscore(failing, "-inf", now - int(self.limits.window_s))
            pipe.zremrangebyrank(failing, 0, -(FAILING_KEPT + 1))
        self._after_event("the failing endpoints", pipe.execute)
        return recorded

    @staticmethod
    def _after_event(what: str, step: Callable[[], object]) -> None:
        """A step after the event's part, whose outcome is written then: one
        that fails is logged, not raised. What it leaves is bounded: a slot
        frees itself at its lease's end, a gauge's member leaves at the next
        take after it; a circuit or the attempt log misses this attempt."""
        try:
            step()
        except redis.RedisError as exc:
            log.warning("webhook attempt: %s not written (%s)", what, exc)

    def end_turn(self, workspace: str, endpoint: str, *, token: str, now: float, outcome: str = "",
                  endpoint_failed: bool = False, entry: str = "", probe: bool = False) -> None:
        """The workspace's part of an attempt's end (``webhook_turn_end.lua``),
        or, ``outcome`` "", of a turn given back unused (``probe``: it was to
        probe the endpoint)."""
        limits = self.limits
        self._turn_end(
            keys=[keys.webhook_in_flight(workspace), keys.webhook_circuit(workspace, endpoint),
                  keys.webhook_log(workspace)],
            args=argv(TURN_END_ARGS, token=token, now=repr(now), outcome=outcome,
                      endpoint_failed="1" if endpoint_failed else "0", circuit_failures=limits.circuit_failures,
                      circuit_cooling_s=repr(limits.circuit_cooling_s), failing_window_s=int(limits.window_s),
                      entry=entry, log_length=LOG_LENGTH, probe="1" if probe else ""))

    def _workspace_keys(self, provider: str, workspace: str) -> list[str]:
        """The KEYS where an ended event's step gives back its workspace's
        pending count (``effects``' target). An event gone (no provider read)
        ends nowhere: its step answers MISSING before it could reach them."""
        if provider:
            return self.effects.workspace_keys(provider, workspace)
        return [keys.workspace(workspace), keys.ledger(workspace)]

    def due(self, *, now: float, again_at: float, limit: int = 500) -> list[str]:
        """The events to publish now, each pushed back to ``again_at``
        (``webhook_due.lua``), at most ``limit`` a provider."""
        due = []
        for key in map(keys.webhooks_due, self.providers):
            due += [_text(i) for i in self._due(keys=[key], args=argv(DUE_ARGS, now=repr(now), again_at=repr(again_at),
                                                                    limit=limit))]
        return due

    def owed(self, request_id: str) -> bool:
        """Whether the request has a webhook event pending (a hint for the
        fast path: whether to publish its delivery now)."""
        return self.client.hget(keys.webhook_event(request_id), "state") == b"pending"

    def event(self, request_id: str) -> dict[str, str]:
        """Every field of a request's event being delivered, or its last
        (the operator's and the tests' view)."""
        return {_text(k): _text(v) for k, v in self.client.hgetall(keys.webhook_event(request_id)).items()}

    def queued(self, request_id: str) -> list[dict[str, str]]:
        """The request's events owed behind the one being delivered, oldest first."""
        return [json.loads(raw) for raw in self.client.lrange(keys.webhook_next(request_id), 0, -1)]

    def pending(self) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in map(keys.webhooks_due, self.providers):
            pipe.zcard(key)
        return sum(pipe.execute())

    def in_flight(self, now: float) -> int:
        """Attempts running now, every workspace's (leases not yet run out)."""
        return int(self.client.zcount(keys.webhooks_in_flight(), f"({now!r}", "+inf"))

    def attempts(self, workspace: str, count: int = 50) -> list[Attempt]:
        """The workspace's last ``count`` attempts, newest first (origins only,
        lines written before origins were kept included)."""
        rows = [json.loads(raw) for raw in self.client.lrange(keys.webhook_log(workspace), 0, count - 1)]
        return [Attempt(r["at"], r["request_id"], origin(r.get("origin") or r.get("url") or ""), r["attempt"],
                        r["outcome"], r["status"], r["error"], r["seconds"]) for r in rows]

    def failing(self, workspace: str | None = None, *, now: float | None = None) -> list[FailingEndpoint]:
        """Endpoints whose last attempts failed, most failures first; one
        workspace's, or every one's (at most :data:`FAILING_KEPT`)."""
        members = [_text(m) for m in self.client.zrevrange(keys.webhooks_failing(), 0, FAILING_KEPT - 1)]
        if workspace is not None:
            members = [m for m in members if m.partition("|")[0] == workspace]
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            ws, _, endpoint = member.partition("|")
            pipe.hmget(keys.webhook_circuit(ws, endpoint), "failures", "open_until", "last_failure_at")
        rows = []
        for member, (failures, open_until, last_at) in zip(members, pipe.execute() if members else []):
            if not failures:
                continue  # its circuit expired; the member goes at the next trim
            ws, _, endpoint = member.partition("|")
            failures = int(failures)
            is_open = self.limits.circuit_failures and failures >= self.limits.circuit_failures
            rows.append(FailingEndpoint(ws, endpoint, failures, float(last_at or 0),
                                        float(open_until) if is_open and open_until else None))
        return sorted(rows, key=lambda row: (-row.failures, row.workspace, row.origin))

    def open_circuits(self) -> list[FailingEndpoint]:
        """The failing endpoints whose circuit is open (its events waiting)."""
        return [row for row in self.failing() if row.open_until is not None]
