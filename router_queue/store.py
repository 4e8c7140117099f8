"""The request store: every read and write of request state in Redis.

Writes that depend on what is already there run as the Lua scripts in
``lua/`` (one atomic step each); plain reads are pipelined into one round
trip. The key layout is in ``keys.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from . import keys
from .states import IN_QUEUE

_FIELDS = (
    "id", "workspace", "model", "provider", "status", "created_at", "started_at",
    "completed_at", "error_type", "detail", "content_type", "cancel_requested",
    "attempts", "upstream_ref",
)


_PACE_FIELDS = ("avg_run_s", "avg_gap_s")
#: status.lua's ARGV after the request id: the field count, then the fields.
_STATUS_FIELD_ARGS = (len(_FIELDS), *_FIELDS)


def load_script(client: redis.Redis, name: str):
    """Register ``lua/{name}.lua`` with the shared accounting of ``lua/lib.lua`` in front."""
    lua = resources.files("router_queue").joinpath("lua")
    return client.register_script(lua.joinpath("lib.lua").read_text() + lua.joinpath(f"{name}.lua").read_text())


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _seconds(value: Any) -> float | None:
    text = _text(value)
    return float(text) if text else None


@dataclass(frozen=True)
class RequestRecord:
    """What the front door and workers read about one request."""

    id: str
    workspace: str
    model: str
    provider: str
    status: str
    created_at: float
    started_at: float | None = None
    completed_at: float | None = None
    error_type: str | None = None
    detail: str | None = None
    content_type: str | None = None
    cancel_requested: bool = False
    #: Provider calls made so far that failed in a way worth retrying.
    attempts: int = 0
    #: The provider's handle on a submitted generation (JSON), for resuming.
    upstream_ref: str | None = None
    #: Seconds until Redis drops the record (set once COMPLETED), else None.
    ttl_s: int | None = None

    @classmethod
    def from_values(cls, values: list[Any], ttl: int | None = None) -> "RequestRecord | None":
        """From an ``HMGET`` of :data:`_FIELDS` (bytes or None each). Every
        status poll makes one, so the fields are unpacked by position."""
        (id_, workspace, model, provider, status, created_at, started_at, completed_at, error_type, detail,
         content_type, cancel_requested, attempts, upstream_ref) = values
        if status is None:
            return None
        return cls(
            id=id_.decode() if id_ else "",
            workspace=workspace.decode() if workspace else "",
            model=model.decode() if model else "",
            provider=provider.decode() if provider else "",
            status=status.decode(),
            created_at=float(created_at or 0),
            started_at=float(started_at) if started_at else None,
            completed_at=float(completed_at) if completed_at else None,
            error_type=error_type.decode() if error_type else None,
            detail=None if detail is None else detail.decode(),
            content_type=None if content_type is None else content_type.decode(),
            cancel_requested=bool(cancel_requested),
            attempts=int(attempts or 0),
            upstream_ref=None if upstream_ref is None else upstream_ref.decode(),
            ttl_s=ttl if ttl is not None and ttl >= 0 else None,
        )


@dataclass(frozen=True)
class Pace:
    """A provider's recent pace, for Retry-After: moving averages in seconds."""

    avg_run_s: float | None
    avg_gap_s: float | None


@dataclass(frozen=True)
class StatusView:
    record: RequestRecord | None
    #: Requests ahead in the provider's queue; None once the request left it.
    position: int | None
    pace: Pace


@dataclass(frozen=True)
class Admission:
    """The outcome of ``admit``: ``outcome`` is one of the admit.lua codes."""

    outcome: str
    request_id: str | None = None
    position: int | None = None
    #: Credits the workspace had free, when it could not fund the request.
    available: int | None = None


@dataclass(frozen=True)
class Lease:
    """How a delivery claims a request: who holds it and under what limits."""

    #: Unique to this execution, so a broker's redelivery of the same message
    #: while the first execution still runs is told apart from it.
    token: str
    lease_s: float
    max_in_flight: int
    queue_timeout_s: float
    max_takeovers: int
    #: "{task id}:{retry number}": resumes a lease its holder kept for this retry.
    resume_key: str = ""


class RequestStore:
    def __init__(self, client: redis.Redis, *, retention_s: int, idempotency_ttl_s: int,
                 republish_after_s: float = 30.0, max_queued: int = 1000):
        self.client = client
        #: Requests a workspace may have waiting unless it sets its own cap.
        self.max_queued = max_queued
        self.retention_s = retention_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self.republish_after_s = republish_after_s
        self._admit = load_script(client, "admit")
        self._claim = load_script(client, "claim")
        self._renew = load_script(client, "renew")
        self._complete = load_script(client, "complete")
        self._cancel = load_script(client, "cancel")
        self._expire_queued = load_script(client, "expire_queued")
        self._status = load_script(client, "status")

    # -- front door --------------------------------------------------------
    def admit(
        self,
        *,
        request_id: str,
        workspace: str,
        model: str,
        provider: str,
        body: str,
        fingerprint: str = "",
        idempotency_key_hash: str = "",
        require_enabled: bool = True,
        price: int = 0,
        now: float | None = None,
        rate=None,
        message=None,
    ) -> Admission:
        """One atomic admission (``admit.lua``). ``rate`` (a ``ratelimit.Allowance``)
        is counted first; a spent window raises the refusal it makes. ``message``
        (a ``dispatch.BrokerMessage``) is pushed to the broker in the same step;
        without one the request waits in ``rq:due`` for its publish."""
        rate_keys, rate_args = (rate.keys, rate.args) if rate is not None else ((), ())
        idem_key = keys.idempotency(workspace, idempotency_key_hash or "-")
        now = now or time.time()
        reply = self._admit(
            keys=[
                keys.request(request_id), keys.queue(provider), keys.sequence(provider),
                keys.due(), keys.workspace(workspace), idem_key, keys.ledger(workspace), keys.metrics(provider),
                keys.draining(), message.list_key if message else keys.due(), *rate_keys,
            ],
            args=[
                request_id, workspace, model, provider, body, repr(now),
                fingerprint if idempotency_key_hash else "", self.idempotency_ttl_s,
                "1" if require_enabled else "0", repr(now + self.republish_after_s), int(price),
                self.max_queued, message.payload if message else "", *rate_args,
            ],
        )
        code = _text(reply[0])
        if code == "RATE_LIMITED":
            raise rate.refusal(reply[1:])
        if code == "ADMITTED":
            return Admission(code, _text(reply[1]), int(reply[2]))
        if code == "REPLAY":
            return Admission(code, _text(reply[1]))
        if code == "INSUFFICIENT_CREDITS":
            return Admission(code, available=int(float(_text(reply[1]))))
        return Admission(code)

    def mark_published(self, request_id: str) -> None:
        """Forget that ``request_id`` awaits a publish."""
        self.client.zrem(keys.due(), request_id)

    def status_view(self, request_id: str, provider: str, rate=None) -> StatusView:
        """Record, queue position and provider pace, in one round trip (``status.lua``).

        ``rate`` (a ``ratelimit.Allowance``) is counted in the same step; a
        spent window raises the refusal it makes.
        """
        rate_keys, rate_args = (rate.keys, rate.args) if rate is not None else ((), ())
        reply = self._status(
            keys=[keys.request(request_id), keys.queue(provider), keys.stats(provider), *rate_keys],
            args=[request_id, *_STATUS_FIELD_ARGS, *rate_args],
        )
        if reply[0] == b"RATE_LIMITED":
            raise rate.refusal(reply[1:])
        _, values, ttl, rank, pace = reply
        return StatusView(
            record=RequestRecord.from_values(values, ttl),
            position=rank,
            pace=Pace(_seconds(pace[0]), _seconds(pace[1])),
        )

    def pace(self, provider: str) -> Pace:
        avg_run, avg_gap = self.client.hmget(keys.stats(provider), _PACE_FIELDS)
        return Pace(_seconds(avg_run), _seconds(avg_gap))

    def result(self, request_id: str) -> bytes | None:
        return self.client.get(keys.result(request_id))

    def cancel(self, *, request_id: str, workspace: str, model: str, provider: str) -> str:
        reply = self._cancel(
            keys=[keys.request(request_id), keys.queue(provider), keys.due(), keys.workspace(workspace),
                  keys.ledger(workspace)],
            args=[request_id, workspace, model, repr(time.time()), self.retention_s],
        )
        return _text(reply) or ""

    # -- workers -----------------------------------------------------------
    def load(self, request_id: str) -> tuple[RequestRecord | None, bytes | None]:
        """A request's record and its native body."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.request(request_id), _FIELDS)
        pipe.hget(keys.request(request_id), "body")
        values, body = pipe.execute()
        return RequestRecord.from_values(values), body

    def claim(self, record: RequestRecord, lease: Lease, now: float | None = None) -> str:
        """Take the request to run it; returns a claim.lua code ("CLAIMED", "RESUMED", ...)."""
        request_id, provider = record.id, record.provider
        reply = self._claim(
            keys=[keys.request(request_id), keys.queue(provider), keys.due(), keys.running(provider),
                  keys.workspace(record.workspace), keys.ledger(record.workspace)],
            args=[request_id, repr(now or time.time()), lease.lease_s, lease.max_in_flight,
                  lease.queue_timeout_s, self.retention_s, lease.token, lease.max_takeovers, lease.resume_key],
        )
        return _text(reply) or ""

    def renew(self, request_id: str, provider: str, token: str, lease_s: float, *, successor: str = "",
              hand_back: bool = False) -> bool:
        """Extend the lease ``token`` holds. ``successor``: keep it for that retry
        alone; ``hand_back``: end it now for another worker to resume."""
        return bool(self._renew(keys=[keys.request(request_id), keys.running(provider)],
                                args=[request_id, token, repr(time.time()), lease_s, successor,
                                      "1" if hand_back else ""]))

    def renew_many(self, held: list[tuple[str, str, str]], lease_s: float) -> None:
        """Heartbeat: extend every (id, provider, token) lease in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        now = repr(time.time())
        for request_id, provider, token in held:
            self._renew(keys=[keys.request(request_id), keys.running(provider)],
                        args=[request_id, token, now, lease_s, "", ""], client=pipe)
        pipe.execute()

    def defer(self, request_id: str, seconds: float) -> None:
        """A waiting request's next delivery is due within ``seconds``; else the sweeper publishes it."""
        self.client.zadd(keys.due(), {request_id: time.time() + seconds})

    def record_attempt(self, request_id: str) -> int:
        """Count one failed provider call worth retrying; returns the count so far."""
        return int(self.client.hincrby(keys.request(request_id), "attempts", 1))

    def remember_upstream(self, request_id: str, ref: str) -> None:
        """Keep the provider's handle on a submitted generation, to resume it."""
        self.client.hset(keys.request(request_id), "upstream_ref", ref)

    def cancel_requested(self, request_id: str) -> bool:
        return bool(self.client.hexists(keys.request(request_id), "cancel_requested"))

    def complete(
        self,
        record: RequestRecord,
        *,
        output: bytes = b"",
        content_type: str = "",
        error_type: str = "",
        detail: str = "",
        billable: bool | None = None,
    ) -> str:
        """Finish the request and settle its credits, once; a request already
        COMPLETED keeps its first outcome. ``billable`` defaults to "a success"."""
        request_id, provider = record.id, record.provider
        billable = (not error_type) if billable is None else billable
        reply = self._complete(
            keys=[
                keys.request(request_id), keys.result(request_id), keys.queue(provider),
                keys.stats(provider), keys.due(), keys.running(provider),
                keys.workspace(record.workspace), keys.ledger(record.workspace),
            ],
            args=[
                request_id, repr(time.time()), self.retention_s, error_type, detail,
                content_type, output, "1" if billable else "0",
            ],
        )
        return _text(reply) or ""

    # -- sweeper and reaper ----------------------------------------------------
    def overdue_waiting(self, now: float, limit: int = 500) -> list[tuple[str, str]]:
        """(id, provider) of IN_QUEUE requests past their publish due time."""
        ids = [_text(i) for i in self.client.zrangebyscore(keys.due(), "-inf", now, 0, limit)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hmget(keys.request(request_id), ("status", "provider"))
        found = []
        for request_id, (status, provider) in zip(ids, pipe.execute()):
            if _text(status) == IN_QUEUE:
                found.append((request_id, _text(provider)))
            else:
                self.client.zrem(keys.due(), request_id)
        return found

    def expired_leases(self, provider: str, now: float, limit: int = 500) -> list[str]:
        """Running requests whose lease ran out: their worker died (or hung)."""
        return [_text(i) for i in self.client.zrangebyscore(keys.running(provider), "-inf", now, 0, limit)]

    def postpone_reap(self, request_id: str, provider: str, until: float) -> None:
        """Look at an expired lease again at ``until`` (its re-publish may be lost too)."""
        self.client.zadd(keys.running(provider), {request_id: until}, xx=True)

    def queue_head(self, provider: str, count: int = 100) -> list[str]:
        """The ``count`` longest-waiting request ids of a provider's queue."""
        return [_text(i) for i in self.client.zrange(keys.queue(provider), 0, count - 1)]

    def expire_queued(self, request_id: str, provider: str, workspace: str, queue_timeout_s: float,
                      now: float) -> bool:
        """End a request that waited past its queue timeout; True when it did."""
        reply = self._expire_queued(
            keys=[keys.request(request_id), keys.queue(provider), keys.due(), keys.workspace(workspace),
                  keys.ledger(workspace)],
            args=[request_id, repr(now), queue_timeout_s, self.retention_s],
        )
        return bool(reply)

    def set_draining(self, provider: str, draining: bool) -> None:
        """Stop (or resume) admitting requests for ``provider``; in-flight work goes on."""
        (self.client.sadd if draining else self.client.srem)(keys.draining(), provider)

    def draining(self) -> set[str]:
        return {_text(p) for p in self.client.smembers(keys.draining())}

    def queue_depth(self, provider: str) -> int:
        return int(self.client.zcard(keys.queue(provider)))

    def in_flight(self, provider: str) -> int:
        return int(self.client.zcard(keys.running(provider)))

