"""The request store: every read and write of request state in Redis.

Writes that depend on what is already there run as the Lua scripts in
``lua/`` (one atomic step each); plain reads are pipelined into one round
trip. The key layout is in ``keys.py``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import redis

from .. import states
from ..blobs.pointers import ResultPointer
from . import keys
from .accounts import DEFAULT_LEDGER_RETENTION_S
from .admission import ADMIT_ARGS, LostReplies, TwoStepAdmission, counted_windows
from .connect import UNREACHABLE, bounded, primaries_info, queue_script
from .ids import well_formed
from .outcomes import Admit, Cancel, Claim, Complete, ExpireQueued, Status
from .owed import OwedEffects
from .quotas import DEFAULT_MAX_PENDING_WEBHOOKS, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_STORED_BYTES
from .rate_counts import SyncedRateCounts
from .record import READ_NAMES, RequestRecord, Submission, admitted_values
from .replication import NO_REPLICATION, ReplicatedWrites, Replication
from .scripts import argv, explain, load_script

log = logging.getLogger(__name__)

#: The record's fields every read takes, in this order (declared in ``record.py``).
_FIELDS = READ_NAMES

_PACE_FIELDS = ("avg_run_s", "avg_gap_s")
#: A result's pointer into the object store, on its record (complete.lua).
_POINTER_FIELDS = ("blob_key", "blob_size", "blob_sha256", "content_type")
#: complete.lua also counts, in rq:stats:{provider}, completions in windows
#: of this many seconds, in a ring of this many fields ("done|<window mod
#: ring>" = "<window>:<count>"): "per minute" is what ended in the last
#: minute, written in the write complete.lua already makes.
COMPLETIONS_WINDOW_S = 10
COMPLETIONS_RING = 6
_TOTALS_FIELDS = ("completed", "ran", "waited_s", *(f"done|{slot}" for slot in range(COMPLETIONS_RING)))
#: status.lua's refusal as it arrives (bytes): the hot path compares without decoding.
_RATE_LIMITED = Status.RATE_LIMITED.encode()
#: Seconds the read replica is passed over once it failed to answer.
REPLICA_RETRY_S = 5.0
#: Seconds a rate count outside the hot routes' own scripts may wait on Redis.
SPEND_RATE_TIMEOUT_S = 0.5
#: Seconds by which Redis's clock may lag the front door's without a late
#: write slipping past its deadline (see ``RequestStore._deadline``).
CLOCK_ALLOWANCE_S = 0.2
#: Seconds an admission whose reply was lost is read back for, when the
#: caller set no write deadline (the front door's is its wait).
LOST_REPLY_BUDGET_S = 1.0
#: A request's priority within its workspace (``X-Comfy-Priority``).
PRIORITIES = ("high", "normal", "low")
#: status.lua's ARGV by name: the request's id, where "workspace" and
#: "status" are among the fields it reads (1-based, as Lua counts), how many
#: fields; the fields follow (its ARG_REST), then the rate windows' pairs.
STATUS_ARGS = ("id", "at_workspace", "at_status", "nfields")
#: status.lua's ARGV after the id (``STATUS_ARGS``' others, then the fields), built once: a
#: status poll is the hottest call.
_STATUS_FIELD_ARGS = (_FIELDS.index("workspace") + 1, _FIELDS.index("status") + 1, len(_FIELDS), *_FIELDS)
#: A history page examines at most this many history entries per entry it may
#: list: a filter on status or error_type that matches little answers a
#: short page and a cursor rather than reading the whole history.
HISTORY_EXAMINED_PER_ENTRY = 5


#: Each script's ARGV by name (``load_script``, ``argv``), in order: the Lua
#: reads ``ARGV[ARG_ID]`` and so on; the script's header says what each holds
#: (admission's: ``admission.py``).
CLAIM_ARGS = ("id", "now", "lease_s", "cap", "low_headroom_pct", "queue_timeout_s", "retention", "token",
              "max_takeovers", "resume_key", "grant_until", "template", "split")
COMPLETE_ARGS = ("id", "now", "retention", "error_type", "detail", "content_type", "output", "billable", "cap",
                 "low_headroom_pct", "grant_until", "template", "split", "blob_key", "blob_size", "blob_sha256",
                 "fallback_max")
EXPIRE_QUEUED_ARGS = ("id", "now", "queue_timeout_s", "retention", "workspace", "cap", "low_headroom_pct",
                      "grant_until", "template", "split")
CANCEL_ARGS = ("id", "workspace", "model", "now", "retention", "cap", "low_headroom_pct", "grant_until", "template",
               "write_deadline", "by", "split")
GRANT_ARGS = ("cap", "low_headroom_pct", "now", "grant_until", "template")
GRANT_UNSENT_ARGS = ("due_at",)  # then the ids
RENEW_ARGS = ("id", "token", "now", "lease_s", "successor", "hand_back")
PROGRESS_ARGS = ("id", "token", "progress", "now", "every_s")
HISTORY_ARGS = ("newest", "oldest", "examined")  # then the rate windows' pairs
POSITIONS_ARGS = ("workspace",)  # then the request ids
REAP_ARGS = ("now", "again_at", "limit")


#: A caller's rate-window key (``keys.rate_window``), for the front door's
#: rate limits, which name their windows but leave the layout to the store.
rate_window = keys.rate_window


def event_source(channel: bytes | str) -> tuple[str | None, str | None]:
    """What an ``event_feed`` message's channel names: (provider, None) when a
    provider's queue moved, (None, request id) when a request changed."""
    name = channel.decode() if isinstance(channel, bytes) else channel
    if name.startswith(keys.PROVIDER_EVENTS):
        return name[len(keys.PROVIDER_EVENTS):], None
    return None, name.rsplit(":", 1)[-1]


def key_event_source(channel: bytes | str) -> str | None:
    """The key id an ``event_feed`` message's channel names when it is an API
    key's (revoked or rotated: ``keys.key_events_channel``), else None."""
    name = channel.decode() if isinstance(channel, bytes) else channel
    return name[len(keys.KEY_EVENTS):] if name.startswith(keys.KEY_EVENTS) else None


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
class Pace:
    """A provider's recent pace, for Retry-After: moving averages in seconds."""

    avg_run_s: float | None
    avg_gap_s: float | None


@dataclass(frozen=True)
class DeliveryTotals:
    """A provider's completions, fleet-wide, for the operations page: those
    complete.lua wrote (a delivery's outcome, or a cancel of one running)."""

    completed: int
    #: Completed in the last minute (the current window and the five before it: 50 to 60 s).
    last_minute: int
    #: Mean seconds the completed requests that ran had waited IN_QUEUE.
    avg_wait_s: float


@dataclass(frozen=True)
class StatusView:
    record: RequestRecord | None
    #: Requests ahead in the provider's queue; None once the request left it.
    position: int | None
    #: The provider's pace, for Retry-After: not read (all None) for a
    #: COMPLETED request, which is sent none (web/pacing.py).
    pace: Pace


#: The pace of a status read that did not read it (a COMPLETED or missing request: status.lua).
_NO_PACE = Pace(None, None)


def _status_view(reply: list[Any]) -> StatusView:
    """status.lua's ``{"OK", values, ttl, position, pace, rate windows}``
    answer; ``ttl`` is None unless the request is COMPLETED, ``pace`` None when it is."""
    _, values, ttl, rank, pace = reply[:5]
    return StatusView(record=RequestRecord.from_values(values, ttl), position=rank,
                      pace=Pace(_seconds(pace[0]), _seconds(pace[1])) if pace else _NO_PACE)


@dataclass(frozen=True)
class HistoryPage:
    """One page of a workspace's requests, newest first (``history.lua``)."""

    #: Each listed request's record and its queue position (None unless IN_QUEUE).
    entries: list[tuple[RequestRecord, int | None]]
    #: The last history entry examined (its stream id, "{ms}-{seq}"), where
    #: the next page starts; None when the history (within the bounds) ends here.
    next_after: str | None


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq)


@dataclass(frozen=True)
class Admission:
    """The outcome of ``admit``."""

    outcome: Admit
    request_id: str | None = None
    position: int | None = None
    #: Credits the workspace had free, when it could not fund the request.
    available: int | None = None
    #: Which webhook lacked a signing secret: "header" (the request's own) or
    #: "default" (the workspace's), on NO_WEBHOOK_SECRET.
    webhook_source: str | None = None
    #: The retried request's status, on NOT_RETRYABLE: IN_QUEUE, IN_PROGRESS or SUCCEEDED.
    original_status: str | None = None
    #: Seconds until enough kept bodies expire, on STORED_BYTES_FULL.
    retry_after: int | None = None


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


@dataclass(frozen=True)
class Lease:
    """How a delivery claims a request: who holds it and under what limits."""

    #: Unique to this execution, so a broker's redelivery of the same message
    #: while the first execution still runs is told apart from it.
    token: str
    lease_s: float
    queue_timeout_s: float
    max_takeovers: int
    #: "{task id}:{retry number}": resumes a lease its holder kept for this retry.
    resume_key: str = ""


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting IN_QUEUE, as the sweeper and the ops page see it."""

    id: str
    model: str
    workspace: str
    created_at: float


@dataclass(frozen=True)
class DeadlineDue:
    """A caller's deadline that has passed (``rq:deadlines:{provider}``)."""

    #: "start" (X-Comfy-Start-Deadline) or "run" (X-Comfy-Deadline).
    kind: str
    request_id: str
    #: None when the request's record has expired.
    workspace: str | None
    model: str | None


#: What ``record_progress`` answers when the request's webhook has an event due now.
WEBHOOK_DUE = 2


class RequestStore:
    def __init__(self, client: redis.Redis, *, retention_s: int, idempotency_ttl_s: int,
                 republish_after_s: float = 30.0, max_queued: int = 1000,
                 max_in_flight: Callable[[str], int] = lambda provider: 100,
                 write_deadline_s: float | None = None, replication: Replication = NO_REPLICATION,
                 max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
                 max_pending_webhooks: int = DEFAULT_MAX_PENDING_WEBHOOKS, grants: GrantPublishing | None = None,
                 reads: redis.Redis | None = None, split: bool = False,
                 max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES, retry_max: int = 10,
                 ledger_retention_s: int = DEFAULT_LEDGER_RETENTION_S, progress_event_every_s: float,
                 low_headroom_pct: int = 0):
        self.client = client
        #: Seconds between a request's progress events at least (WEBHOOK_PROGRESS_EVERY_SECONDS).
        self.progress_event_every_s = progress_event_every_s
        #: What starts and ends owe workspaces, applied in the step (one
        #: Redis) or by a step of their own (split: a cluster; ``owed.py``).
        self.effects = OwedEffects(client, split=split)
        #: Reads back an admission whose reply was lost, within the front door's wait.
        self.lost_replies = LostReplies(client, write_deadline_s or LOST_REPLY_BUDGET_S)
        #: The writes a caller is told about, held for ``replication``'s replicas.
        self.acknowledged = ReplicatedWrites(client, replication)
        #: Split, admission's steps (``admission.py``); None: one step.
        self.two_step = TwoStepAdmission(client, self.lost_replies, self.acknowledged) if split else None
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
        #: Percent of that cap (rounded up, never all of it) low-priority work
        #: leaves free for normal and high (lib/schedule.lua, low_reserve_of).
        self.low_headroom_pct = low_headroom_pct
        #: Seconds within which an admission or cancel must reach Redis or
        #: change nothing (None: no deadline). See :meth:`_deadline`.
        self.write_deadline_s = write_deadline_s
        #: How grants are published (``Services`` hands the dispatcher's in).
        self.grants = grants if grants is not None else GrantPublishing()
        self._admit = load_script(client, "admit", ADMIT_ARGS)
        self._grant = load_script(client, "grant", GRANT_ARGS)
        self._claim = load_script(client, "claim", CLAIM_ARGS)
        self._renew = load_script(client, "renew", RENEW_ARGS)
        self._complete = load_script(client, "complete", COMPLETE_ARGS)
        self._cancel = load_script(client, "cancel", CANCEL_ARGS)
        self._expire_queued = load_script(client, "expire_queued", EXPIRE_QUEUED_ARGS)
        self._status = load_script(client, "status", STATUS_ARGS)
        self._reap = load_script(client, "reap", REAP_ARGS)
        self._grant_unsent = load_script(client, "grant_unsent", GRANT_UNSENT_ARGS)
        self._progress = load_script(client, "progress", PROGRESS_ARGS)
        self._history = load_script(client, "history", HISTORY_ARGS)
        self._positions_of = load_script(client, "positions", POSITIONS_ARGS)
        #: A call's rate count outside the hot routes' scripts waits this little
        #: on Redis: the count is let go rather than the call held.
        self._spend_rate = load_script(bounded(client, SPEND_RATE_TIMEOUT_S), "rate")
        self._purge = load_script(client, "purge")

    # -- front door --------------------------------------------------------
    def admit(self, submission: Submission, rate=None) -> Admission:
        """One atomic admission of ``submission`` (``admit.lua``): the record,
        its place in the provider's schedule, and a slot with its Celery
        message when one is free. ``rate`` (a ``ratelimit.Meter``) is
        counted first, and told where its windows stand; a spent window
        raises the refusal it makes. A lost reply is read back (``LostReplies``)."""
        rate_keys, rate_args = (rate.keys, rate.args) if rate is not None else ((), ())
        values, idem_key, provider_keys, one_step_keys = self._admit_call(submission)
        if self.two_step is not None:
            reply = self.two_step.admit(values, list(rate_keys), list(rate_args), idem_key, provider_keys)
        else:
            try:
                reply = self.acknowledged.run(self._admit, keys=[*one_step_keys, *rate_keys],
                                              args=[*argv(ADMIT_ARGS, **values), *rate_args])
            except UNREACHABLE as exc:  # sent, and no reply: Redis may have run it
                reply = self.lost_replies.reply(exc, values, idem_key if submission.idempotency_key_hash else None)
        code = Admit(_text(reply[0]))
        if code is Admit.RATE_LIMITED:
            raise rate.refusal(reply[1:])
        windows = counted_windows(reply)  # taken off before the granted ids are read
        if rate is not None and windows is not None:
            rate.counted(windows)
        return self._admission(code, reply, submission.provider)

    def admit_many(self, submissions: list[Submission]) -> list[Admission] | None:
        """Several admissions (a batch's lines: ``batches/drain.py``), each
        its own ``admit.lua`` as :meth:`admit` runs it, sent in one pipelined
        round trip, no rate counted. None where that would drop a guarantee
        :meth:`admit` keeps (a split store's steps, writes held for replicas:
        nothing is sent), or when the round trip fails (some may have been
        admitted: the caller admits each again, and its Idempotency-Key,
        which every batch line has, replays what was)."""
        if self.two_step is not None or self.acknowledged.replication.replicas:
            return None
        pipe = self.client.pipeline(transaction=False)
        for submission in submissions:
            values, _, _, one_step_keys = self._admit_call(submission)
            self._admit(keys=one_step_keys, args=argv(ADMIT_ARGS, **values), client=pipe)
        try:
            replies = pipe.execute(raise_on_error=False)
        except UNREACHABLE:
            return None
        if any(isinstance(reply, Exception) for reply in replies):
            return None
        for reply in replies:
            counted_windows(reply)  # no rate counted: an empty list, taken off before the granted ids are read
        return [self._admission(Admit(_text(reply[0])), reply, s.provider) for s, reply in zip(submissions, replies)]

    def _admit_call(self, submission: Submission) -> tuple[dict[str, Any], str, list[str], list[str]]:
        """What ``admit.lua`` is sent for ``submission``: its ARGV by name, its
        Idempotency-Key's key, the provider's keys (split) and every key (one step)."""
        request_id, workspace, model, provider = (submission.request_id, submission.workspace, submission.model,
                                                  submission.provider)
        retry_of = submission.retry_of
        idem_key = keys.idempotency(workspace, submission.idempotency_key_hash or "-")
        now = submission.now or time.time()
        list_key, template, cap, grant_until = self._granting(provider, now)
        values = dict(
            admitted_values(submission),
            body=submission.body, now=repr(now),
            fingerprint=submission.fingerprint if submission.idempotency_key_hash else "",
            idem_ttl=self.idempotency_ttl_s, require_enabled="1" if submission.require_enabled else "0",
            grant_until=grant_until, price=int(submission.price), max_queued=self.max_queued, template=template,
            cap=cap, low_headroom_pct=self.low_headroom_pct, write_deadline=self._deadline(now),
            webhook_url=submission.webhook_url,
            response_url=submission.response_url, max_queued_bytes=self.max_queued_bytes,
            max_pending_webhooks=self.max_pending_webhooks, webhook_events=submission.webhook_events,
            retention=self.retention_s, max_stored_bytes=self.max_stored_bytes, retry_max=self.retry_max,
            ledger_keep=self.ledger_retention_s,
        )
        original = retry_of or request_id
        provider_keys = [keys.request(request_id), keys.queue(provider), keys.sequence(provider),
                         keys.schedule(provider), keys.running(provider), list_key,
                         keys.request(original), keys.body(original), keys.deadlines(provider), keys.body(request_id)]
        one_step_keys = [
            keys.request(request_id), keys.queue(provider), keys.sequence(provider),
            keys.schedule(provider), keys.workspace(workspace), idem_key, keys.ledger(workspace),
            keys.running(provider), list_key, keys.request(original), keys.body(original),
            keys.deadlines(provider), keys.history(workspace), keys.model_history(workspace, model),
            keys.body(request_id), keys.stored(workspace),
        ]
        return values, idem_key, provider_keys, one_step_keys

    def _admission(self, code: Admit, reply: list[Any], provider: str) -> Admission:
        """An ``admit.lua`` reply as its :class:`Admission` (what it granted published)."""
        if code is Admit.ADMITTED:
            self._publish_granted(provider, reply[3:])
            return Admission(code, _text(reply[1]), int(reply[2]))
        if code is Admit.REPLAY:
            return Admission(code, _text(reply[1]))
        if code is Admit.INSUFFICIENT_CREDITS:
            return Admission(code, available=int(float(_text(reply[1]))))
        if code is Admit.NO_WEBHOOK_SECRET:
            return Admission(code, webhook_source=_text(reply[1]))
        if code is Admit.NOT_RETRYABLE:
            return Admission(code, original_status=_text(reply[1]))
        if code is Admit.STORED_BYTES_FULL:
            return Admission(code, retry_after=int(reply[1]))
        return Admission(code)

    @property
    def unreplicated(self) -> int:
        """Writes answered before the replicas ``REDIS_WAIT_REPLICAS`` names had them."""
        return self.acknowledged.unreplicated

    def _deadline(self, now: float) -> str:
        """Until when (Unix seconds, as Redis's ``TIME`` tells it) the script
        may still write: past it, the caller has given up waiting and answered
        503, so the script refuses ("EXPIRED") instead of taking effect late.
        It ends ``CLOCK_ALLOWANCE_S`` before the caller's wait does, so a Redis
        clock that lags ours by up to that much is still safe."""
        if self.write_deadline_s is None:
            return ""
        return repr(now + max(0.05, self.write_deadline_s - CLOCK_ALLOWANCE_S))

    # -- the schedule's grants -------------------------------------------------
    def _granting(self, provider: str, now: float) -> tuple[str, str, int, str]:
        """What a script that may grant a slot needs: the broker list and
        message template ("" when published from here), the provider's cap,
        and until when a grant waits for its worker."""
        template = self.grants.templates.get(provider)
        return (template.list_key if template else keys.schedule(provider), template.text if template else "",
                self.max_in_flight(provider), repr(now + self.republish_after_s))

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

    def grant(self, provider: str, now: float | None = None) -> None:
        """Give the provider's free slots to whom its schedule names (the
        sweeper's self-heal: a raised cap, a lost step)."""
        now = now or time.time()
        list_key, template, cap, grant_until = self._granting(provider, now)
        granted = self._grant(keys=[keys.schedule(provider), keys.running(provider), list_key],
                              args=argv(GRANT_ARGS, cap=cap,
                                        low_headroom_pct=self.low_headroom_pct, now=repr(now), grant_until=grant_until,
                                        template=template))
        self._publish_granted(provider, granted)

    def addressable(self, request_id: str, provider: str) -> bool:
        """Whether a request of ``provider`` may have this id: well formed and
        minted for it (its last byte the provider's code). Any other id is
        answered 404 unread: reading it would span two slots of a cluster."""
        return well_formed(request_id) and keys.request_prefix(request_id) == keys.provider_prefix(provider)

    def status_view(self, request_id: str, provider: str, rate=None, *, replica: bool = False) -> StatusView:
        """Record, queue position and provider pace, in one round trip (``status.lua``).

        ``rate`` (a ``ratelimit.Meter``) is counted in the same step, and told
        where its windows stand; a spent window raises the refusal it makes. On a store split per slot
        (a cluster) the caller's windows and the record are in different
        slots: the poll is counted first, in a step of its own (``rate.lua``),
        so a window stays exact across front doors. With ``replica`` and a
        replica to read (:attr:`reads`), the replica answers: ``rate`` is
        counted in this process and synced with the primary in batches
        (``rate_counts.py``), and a request the replica does not have yet (just
        admitted) or a replica that cannot answer falls back to the primary.
        A replica's view lags the primary's by its replication delay."""
        request_keys = [keys.request(request_id), keys.schedule(provider), keys.stats(provider)]
        if replica and self.reads is not None and time.monotonic() >= self._replica_down_until:
            view = self._replica_view(request_id, request_keys, rate)
            if view is not None:
                return view
            rate = None  # counted already
        if rate is not None and self.effects.split:
            self.count_apart(rate)
            rate = None
        rate_keys, rate_args = (rate.keys, rate.args) if rate is not None else ((), ())
        reply = self._status(keys=[*request_keys, *rate_keys], args=[request_id, *_STATUS_FIELD_ARGS, *rate_args])
        if reply[0] == _RATE_LIMITED:
            raise rate.refusal(reply[1:])
        if rate is not None:
            rate.counted(reply[5])
        return _status_view(reply)

    def count_apart(self, rate) -> None:
        """Count a read in the caller's windows in a step of its own (a split
        store's reads, whose windows are not in the record's slot; a read of an
        id not :meth:`addressable`, which reads nothing); raise the refusal a
        spent window makes."""
        reply = self._spend_rate(keys=rate.keys, args=rate.args)
        if reply[0]:
            raise rate.refusal(reply)
        rate.counted(reply[1:])

    def _replica_view(self, request_id: str, request_keys: list[str], rate) -> StatusView | None:
        if rate is not None:
            assert self.read_rate_counts is not None  # built with the replica
            reply = self.read_rate_counts.spend(rate.keys, rate.args)
            if reply[0]:
                raise rate.refusal(reply)
            rate.counted(reply[1:])
        try:
            reply = self._status(keys=request_keys, args=[request_id, *_STATUS_FIELD_ARGS], client=self.reads)
        except redis.RedisError as exc:
            self._replica_down_until = time.monotonic() + REPLICA_RETRY_S
            log.warning("the read replica did not answer (%s); reading the primary for %.0f s", exc, REPLICA_RETRY_S)
            return None
        view = _status_view(reply)
        return view if view.record is not None else None

    def history(self, workspace: str, *, model: str | None = None, since: float, until: float | None = None,
                after: str | None = None, limit: int = 20, status: str = "",
                error_type: str = "", rate=None) -> HistoryPage:
        """A page of the workspace's requests (of ``model`` only, if named)
        admitted in [``since``, ``until``) (to the ms), newest first, from just
        after ``after`` (a page's ``next_after``). It examines at most
        ``limit`` × :data:`HISTORY_EXAMINED_PER_ENTRY` entries, however long
        the history: a filter that matches little answers a short (even empty)
        page and a cursor, never one past an entry unread. ``rate`` is counted
        in the first step, as in :meth:`status_view`.

        Three steps, each in one slot of a cluster: the workspace's entries
        (``history.lua``), their records (one pipelined read), and the
        waiting ones' positions, one call per provider (``positions.lua``)."""
        rate_keys, rate_args = (rate.keys, rate.args) if rate is not None else ((), ())
        bound = None if until is None else (max(0, math.floor(until * 1000)), 0)
        if after is not None and (bound is None or _stream_id(after) < bound):
            bound = _stream_id(after)
        # exclusive of the bound; "(0-0" is no stream id, and nothing lies below it
        newest = "+" if bound is None else "0-0" if bound == (0, 0) else f"({bound[0]}-{bound[1]}"
        own = keys.history(workspace)
        reply = self._history(
            keys=[own, keys.model_history(workspace, model) if model else own, *rate_keys],
            args=[*argv(HISTORY_ARGS, newest=newest, oldest=f"{max(0, math.floor(since * 1000))}-0",
                        examined=limit * HISTORY_EXAMINED_PER_ENTRY), *rate_args],
        )
        if reply[0] == _RATE_LIMITED:
            raise rate.refusal(reply[1:])
        if rate is not None:
            rate.counted(reply[2])
        found = [(_text(entry_id), _text(request_id)) for entry_id, request_id in reply[3:]]
        records, examined = self._listed(workspace, [request_id for _, request_id in found], limit,
                                         status=status, error_type=error_type)
        more = examined < len(found) + int(reply[1])
        return HistoryPage(list(zip(records, self._positions(workspace, records))),
                           found[examined - 1][0] if more else None)

    def _listed(self, workspace: str, request_ids: list[str], limit: int, *, status: str,
                error_type: str) -> tuple[list[RequestRecord], int]:
        """The records of ``request_ids`` (newest first; "" for an entry whose
        request is gone) that a page lists, up to ``limit``, and how many ids
        were examined to find them. A filter reads each record's three fields
        it tests first, and whole only the records it lists."""

        def listed(values: list[Any]) -> bool:
            ws, state, error = values
            return (state is not None and ws is not None and ws.decode() == workspace
                    and (not status or state.decode() == status)
                    and (not error_type or (error is not None and error.decode() == error_type)))

        filtered = bool(status or error_type)
        tested = ("workspace", "status", "error_type") if filtered else _FIELDS
        at = [tested.index(name) for name in ("workspace", "status", "error_type")]
        examined = 0
        chosen: list[Any] = []  # ids (filtered) or HMGET replies (not)
        while examined < len(request_ids) and len(chosen) < limit:
            # unfiltered, nearly every record is listed: read as many as the page lacks
            batch = request_ids[examined:] if filtered else request_ids[examined:examined + limit - len(chosen)]
            pipe = self.client.pipeline(transaction=False)
            for request_id in batch:
                pipe.hmget(keys.request(request_id or "-"), tested)
            for request_id, values in zip(batch, pipe.execute()):
                examined += 1
                if request_id and listed([values[i] for i in at]):
                    chosen.append(request_id if filtered else values)
                    if len(chosen) == limit:
                        break
        if filtered:
            pipe = self.client.pipeline(transaction=False)
            for request_id in chosen:
                pipe.hmget(keys.request(request_id), _FIELDS)
            chosen = pipe.execute()
        records = [RequestRecord.from_values(values) for values in chosen]
        return [record for record in records if record is not None], examined

    def _positions(self, workspace: str, records: list[RequestRecord]) -> list[int | None]:
        """Each record's queue position while it waits, else None."""
        waiting: dict[str, list[str]] = {}
        for record in records:
            if record.status == states.IN_QUEUE:
                waiting.setdefault(record.provider, []).append(record.id)
        ranks: dict[str, int | None] = {}
        for provider, request_ids in waiting.items():
            reply = self._positions_of(keys=[keys.schedule(provider)],
                                       args=[*argv(POSITIONS_ARGS, workspace=workspace), *request_ids])
            ranks.update(zip(request_ids, (None if rank is None else int(rank) for rank in reply)))
        return [ranks.get(record.id) for record in records]

    def spend_rate(self, rate_keys: list[str], rate_args: list) -> list:
        """Count one call against its rate windows (``rate.lua``): the spent
        window's [index, ms left] when it refuses, else [0, then each window's
        [count, ms left]]."""
        return self._spend_rate(keys=rate_keys, args=rate_args)

    def unready(self) -> str | None:
        """Why the store cannot take writes now (full: at ``maxmemory`` under
        ``noeviction``), else None; one INFO, which also proves it answers."""
        try:
            primaries = primaries_info(self.client, "memory")
        except redis.ResponseError:  # a server without INFO (fakeredis, the embedded default): no maxmemory
            self.client.ping()
            return None
        for memory in primaries:
            used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
            policy = memory.get("maxmemory_policy", "noeviction")
            if limit and policy == "noeviction" and used >= limit:
                return f"the request store is full: used_memory {used} of maxmemory {limit} (noeviction)"
        return None

    def dump(self, request_id: str) -> tuple[dict[str, str], int]:
        """Every field stored for a request and its TTL (the operator's inspect)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.request(request_id))
        pipe.ttl(keys.request(request_id))
        pipe.get(keys.body(request_id))
        raw, ttl, body = pipe.execute()
        record = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        if body is None and "body_of" in record:
            body = self.client.get(keys.body(record["body_of"]))
        if body is not None:
            record["body"] = body.decode(errors="replace")
        return record, int(ttl)

    def event_feed(self) -> Any:
        """A subscription to every request's and provider's change notices (one
        per front-door process: the event streams and held synchronous calls
        share it, ``web/stream.py``). Each message's channel is
        ``events_channel(id)``, ``PROVIDER_EVENTS + provider`` or an API key's
        ``key_events_channel(key id)``."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.psubscribe(keys.EVENTS_PATTERN)
        return pubsub

    def pace(self, provider: str) -> Pace:
        avg_run, avg_gap = self.client.hmget(keys.stats(provider), _PACE_FIELDS)
        return Pace(_seconds(avg_run), _seconds(avg_gap))

    def delivery_totals(self, provider: str, now: float | None = None) -> DeliveryTotals:
        completed, ran, waited_s, *ring = self.client.hmget(keys.stats(provider), _TOTALS_FIELDS)
        current = int((now or time.time()) // COMPLETIONS_WINDOW_S)
        last_minute = 0
        for entry in ring:
            window, _, count = (_maybe_text(entry) or "").partition(":")
            if window and current - int(window) < COMPLETIONS_RING:
                last_minute += int(count)
        ran_n = _int(ran)
        return DeliveryTotals(_int(completed), last_minute, (_seconds(waited_s) or 0.0) / ran_n if ran_n else 0.0)

    def result(self, request_id: str) -> bytes | ResultPointer | None:
        """A succeeded request's output: its bytes when Redis holds them, the
        pointer to its object when the object store does, None once expired."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(keys.result(request_id))
        pipe.hmget(keys.request(request_id), _POINTER_FIELDS)
        output, (key, size, sha256, content_type) = pipe.execute()
        if output is not None:
            return output
        if key is None:
            return None
        return ResultPointer(_text(key), int(size or 0), _text(sha256 or b""), _text(content_type or b""))

    def cancel(self, *, request_id: str, workspace: str, model: str, provider: str,
               by_deadline: bool = False) -> Cancel:
        """What cancel.lua did (see :class:`~router_queue.store.outcomes.Cancel`).
        ``by_deadline``: the sweeper cancels for the caller's X-Comfy-Deadline."""
        now = time.time()
        (running, list_key), (cap, grant_until, template) = self._granting_args(provider, now)
        reply = self.acknowledged.run(
            self._cancel,
            keys=[keys.request(request_id), keys.queue(provider), keys.schedule(provider),
                  *self.effects.workspace_keys(provider, workspace), running, list_key, keys.deadlines(provider),
                  keys.body(request_id)],
            args=argv(CANCEL_ARGS, id=request_id, workspace=workspace, model=model, now=repr(now),
                      retention=self.retention_s, cap=cap,
                      low_headroom_pct=self.low_headroom_pct, grant_until=grant_until, template=template,
                      write_deadline=self._deadline(now), by="deadline" if by_deadline else "",
                      split=self.effects.flag),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return Cancel(_text(reply[0]))

    # -- workers -----------------------------------------------------------
    def traceparent(self, request_id: str) -> str:
        """The W3C trace context its submit left on the record ("" if none)."""
        value = self.client.hget(keys.request(request_id), "traceparent")
        return value.decode() if value else ""

    def load(self, request_id: str) -> tuple[RequestRecord | None, bytes | None]:
        """A request's record and its native body, in one round trip. A retry's
        body is its chain's first request's (``body_of``); a record admitted
        before bodies had a key of their own (an older version's, still
        waiting) holds its body in its ``body`` field: either read in a second
        trip, only when the body's key has none."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.request(request_id), _FIELDS)
        pipe.get(keys.body(request_id))
        values, body = pipe.execute()
        record = RequestRecord.from_values(values)
        if body is None and record is not None:
            owner, body = self.client.hmget(keys.request(request_id), ("body_of", "body"))
            if owner is not None:
                body = self.client.get(keys.body(owner.decode()))
        return record, body

    def claim(self, record: RequestRecord, lease: Lease, now: float | None = None) -> Claim:
        """Take the request to run it (see :class:`~router_queue.store.outcomes.Claim`)."""
        request_id, provider = record.id, record.provider
        now = now or time.time()
        (running, list_key), (cap, grant_until, template) = self._granting_args(provider, now)
        reply = self._claim(
            keys=[keys.request(request_id), keys.queue(provider), keys.schedule(provider), running,
                  *self.effects.workspace_keys(provider, record.workspace), list_key,
                  keys.deadlines(provider), keys.body(request_id)],
            args=argv(CLAIM_ARGS, id=request_id, now=repr(now), lease_s=lease.lease_s, cap=cap,
                      low_headroom_pct=self.low_headroom_pct,
                      queue_timeout_s=lease.queue_timeout_s, retention=self.retention_s, token=lease.token,
                      max_takeovers=lease.max_takeovers, resume_key=lease.resume_key, grant_until=grant_until,
                      template=template, split=self.effects.flag),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return Claim(_text(reply[0]))

    def renew(self, request_id: str, provider: str, token: str, lease_s: float, *, successor: str = "",
              hand_back: bool = False) -> bool:
        """Extend the lease ``token`` holds. ``successor``: keep it for that retry
        alone; ``hand_back``: end it now for another worker to resume."""
        return bool(self._renew(keys=[keys.request(request_id), keys.running(provider)],
                                args=argv(RENEW_ARGS, id=request_id, token=token, now=repr(time.time()),
                                          lease_s=lease_s, successor=successor, hand_back="1" if hand_back else "")))

    def renew_many(self, held: list[tuple[str, str, str]], lease_s: float) -> None:
        """Heartbeat: extend every (id, provider, token) lease in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        now = repr(time.time())
        calls = [([keys.request(request_id), keys.running(provider)],
                  argv(RENEW_ARGS, id=request_id, token=token, now=now, lease_s=lease_s, successor="", hand_back=""))
                 for request_id, provider, token in held]
        for call_keys, args in calls:
            queue_script(pipe, self._renew, call_keys, args)
        try:
            pipe.execute()
        except redis.exceptions.NoScriptError:
            for call_keys, args in calls:
                self._renew(keys=call_keys, args=args)
        except redis.exceptions.ResponseError as error:  # pipelined: raised here, not by the script
            raise explain(self._renew, error) from None

    def record_attempt(self, request_id: str) -> int:
        """Count one failed provider call worth retrying; returns the count so far."""
        return int(self.client.hincrby(keys.request(request_id), "attempts", 1))

    def remember_upstream(self, request_id: str, ref: str) -> None:
        """Keep the provider's handle on a submitted generation, to resume it."""
        self.client.hset(keys.request(request_id), "upstream_ref", ref)

    def record_progress(self, request_id: str, token: str, progress: float, now: float | None = None) -> int:
        """Keep how far a running generation is (``progress.lua``: only growing,
        only from the lease's holder), and owe its webhook's progress event:
        0 when it was no news, 1 when kept, :data:`WEBHOOK_DUE` when kept and
        a webhook event of the request is due now (publish it)."""
        return int(self._progress(keys=[keys.request(request_id)],
                                  args=argv(PROGRESS_ARGS, id=request_id, token=token, progress=repr(progress),
                                            now=repr(now or time.time()), every_s=self.progress_event_every_s)))

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
        pointer: ResultPointer | None = None,
        fallback_max: int | None = None,
    ) -> Complete:
        """Finish the request and settle its credits, once; a request already
        COMPLETED keeps its first outcome. ``billable`` defaults to "a success".
        ``pointer``: the output is that object (already written), not ``output``.
        ``fallback_max``: ``output`` is kept for an unanswering object store,
        within that many bytes of the provider's fallback (else FALLBACK_FULL)."""
        request_id, provider = record.id, record.provider
        billable = (not error_type) if billable is None else billable
        now = time.time()
        (running, list_key), (cap, grant_until, template) = self._granting_args(provider, now)
        reply = self.acknowledged.run(
            self._complete,
            keys=[
                keys.request(request_id), keys.result(request_id), keys.queue(provider),
                keys.stats(provider), keys.schedule(provider), running,
                *self.effects.workspace_keys(provider, record.workspace), list_key,
                keys.deadlines(provider), keys.body(request_id), keys.result_objects(provider),
                keys.fallback_results(provider), keys.fallback_bytes(provider),
            ],
            args=argv(COMPLETE_ARGS, id=request_id, now=repr(now), retention=self.retention_s, error_type=error_type,
                      detail=detail, content_type=pointer.content_type if pointer else content_type, output=output,
                      billable="1" if billable else "0", cap=cap,
                      low_headroom_pct=self.low_headroom_pct, grant_until=grant_until, template=template,
                      split=self.effects.flag, blob_key=pointer.key if pointer else "",
                      blob_size=pointer.size if pointer else 0, blob_sha256=pointer.sha256 if pointer else "",
                      fallback_max="" if fallback_max is None else fallback_max),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return Complete(_text(reply[0]))

    # -- sweeper and reaper ----------------------------------------------------
    def reap(self, provider: str, now: float, again_at: float, limit: int = 500) -> list[tuple[str, bool]]:
        """Take the slots whose lease ran out (``reap.lua``), each to be looked
        at again at ``again_at``: (id, started); a started one's worker died
        (or hung), a granted one's message was lost. The caller publishes them."""
        reply = self._reap(keys=[keys.running(provider)],
                           args=argv(REAP_ARGS, now=repr(now), again_at=repr(again_at), limit=limit))
        return [(_text(reply[i]), reply[i + 1] == b"1") for i in range(0, len(reply), 2)]

    def purge_expired(self, providers: list[str]) -> int:
        """Drop queue and running entries whose request record has expired
        (``purge.lua``), one call per provider (each its own slot on a cluster)."""
        return sum(int(self._purge(keys=[keys.queue(provider), keys.running(provider)], args=[]))
                   for provider in providers)

    def queue_head(self, provider: str, count: int = 100) -> list[QueuedRequest]:
        """The ``count`` longest-waiting requests of a provider's queue, oldest first."""
        ids = [_text(i) for i in self.client.zrange(keys.queue(provider), 0, count - 1)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hmget(keys.request(request_id), ("model", "workspace", "created_at"))
        return [QueuedRequest(request_id, _text(model), _text(workspace), float(created))
                for request_id, (model, workspace, created) in zip(ids, pipe.execute())
                if model and workspace and created]

    def expire_queued(self, request_id: str, provider: str, workspace: str, queue_timeout_s: float,
                      now: float) -> bool:
        """End a request that waited past its queue timeout; True when it did."""
        (running, list_key), (cap, grant_until, template) = self._granting_args(provider, now)
        reply = self._expire_queued(
            keys=[keys.request(request_id), keys.queue(provider), keys.schedule(provider),
                  *self.effects.workspace_keys(provider, workspace), running, list_key, keys.deadlines(provider),
                  keys.body(request_id)],
            args=argv(EXPIRE_QUEUED_ARGS, id=request_id, now=repr(now), queue_timeout_s=queue_timeout_s,
                      retention=self.retention_s, workspace=workspace, cap=cap,
                      low_headroom_pct=self.low_headroom_pct, grant_until=grant_until,
                      template=template, split=self.effects.flag),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return ExpireQueued(_text(reply[0])) is ExpireQueued.TIMED_OUT

    def deadlines_due(self, provider: str, now: float, limit: int = 500) -> list[DeadlineDue]:
        """The caller deadlines of ``provider`` that have passed by ``now``,
        earliest first, with each request's workspace and model (none: its
        record expired). The scripts that act on them drop them from the index."""
        members = [_text(m) for m in self.client.zrangebyscore(keys.deadlines(provider), "-inf", repr(now),
                                                               start=0, num=limit)]
        if not members:
            return []
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            pipe.hmget(keys.request(member.split("|", 1)[1]), ("workspace", "model"))
        return [DeadlineDue(kind, request_id, _maybe_text(workspace), _maybe_text(model))
                for (kind, request_id), (workspace, model) in zip((m.split("|", 1) for m in members), pipe.execute())]

    def forget_deadline(self, provider: str, due: "DeadlineDue") -> None:
        """Drop a deadline whose request expired (nothing is left to end)."""
        self.client.zrem(keys.deadlines(provider), f"{due.kind}|{due.request_id}")

    def set_draining(self, provider: str, draining: bool) -> None:
        """Stop (or resume) admitting requests for ``provider``; in-flight work
        goes on. The mark is the provider's schedule's, so admission reads it
        among the provider's own keys."""
        if draining:
            self.client.hset(keys.schedule(provider), "draining", "1")
        else:
            self.client.hdel(keys.schedule(provider), "draining")

    def draining(self, providers: list[str]) -> set[str]:
        """Which of ``providers`` are draining."""
        pipe = self.client.pipeline(transaction=False)
        for provider in providers:
            pipe.hexists(keys.schedule(provider), "draining")
        return {provider for provider, marked in zip(providers, pipe.execute()) if marked}

    def queue_depth(self, provider: str) -> int:
        return int(self.client.zcard(keys.queue(provider)))

    def waiting_workspaces(self, provider: str, largest: int = 5) -> tuple[int, list[tuple[str, int]]]:
        """How many workspaces have requests waiting on ``provider``, and the
        ``largest`` of them with their counts, most first."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(keys.schedule_workspaces(provider))
        pipe.zrevrange(keys.schedule_workspaces(provider), 0, largest - 1, withscores=True)
        count, top = pipe.execute()
        return int(count), [(_text(ws), int(n)) for ws, n in top]

    def in_flight(self, provider: str) -> int:
        return int(self.client.zcard(keys.running(provider)))

