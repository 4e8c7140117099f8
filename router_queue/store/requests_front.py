"""The request store's front door: admit, status, history, results and
cancels, as the web routes call them. Each write is one Lua script
(``lua/``); plain reads are pipelined into one round trip."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import redis

from .. import states
from ..blobs.pointers import ResultPointer
from ..requests.outcomes import Admit, Cancel, Status
from ..requests.record import RequestRecord, Submission, admitted_values
from ..requests.values import Admission, HistoryPage, Pace, StatusView
from . import budgets, keys
from .admission import AdmitCall, counted_windows
from .connect import bounded
from .ids import well_formed
from .requests_base import _FIELDS, RequestStoreBase, _seconds, _text
from .scripts import argv, load_script

log = logging.getLogger(__name__)

_PACE_FIELDS = ("avg_run_s", "avg_gap_s")
#: A result's pointer into the object store, on its record (complete.lua).
_POINTER_FIELDS = ("blob_key", "blob_size", "blob_sha256", "content_type")
#: status.lua's refusal as it arrives (bytes): the hot path compares without decoding.
_RATE_LIMITED = Status.RATE_LIMITED.encode()
#: Seconds the read replica is passed over once it failed to answer.
REPLICA_RETRY_S = 5.0
#: Seconds a rate count outside the hot routes' own scripts may wait on Redis.
SPEND_RATE_TIMEOUT_S = 0.5
#: Seconds by which Redis's clock may lag the front door's without a late
#: write slipping past its deadline (see ``RequestStore._deadline``).
CLOCK_ALLOWANCE_S = 0.2
#: status.lua's ARGV by name: the request's id, where "workspace", "status"
#: and "pin_group" are among the fields it reads (1-based, as Lua counts), how
#: many fields; the fields follow (its ARG_REST), then the rate windows' pairs.
STATUS_ARGS = ("id", "at_workspace", "at_status", "at_pin_group", "nfields")
#: status.lua's ARGV after the id (``STATUS_ARGS``' others, then the fields), built once: a
#: status poll is the hottest call.
_STATUS_FIELD_ARGS = (_FIELDS.index("workspace") + 1, _FIELDS.index("status") + 1, _FIELDS.index("pin_group") + 1,
                      len(_FIELDS), *_FIELDS)
#: A history page examines at most this many history entries per entry it may
#: list: a filter on status or error_type that matches little answers a
#: short page and a cursor rather than reading the whole history.
HISTORY_EXAMINED_PER_ENTRY = 5

#: Each script's ARGV by name (``load_script``, ``argv``), in order: the Lua
#: reads ``ARGV[ARG_ID]`` and so on; the script's header says what each holds
#: (admission's: ``admission.py``).
CANCEL_ARGS = ("id", "workspace", "model", "now", "retention", "cap", "low_headroom_pct", "grant_until", "template",
               "write_deadline", "by")
HISTORY_ARGS = ("newest", "oldest", "examined")  # then the rate windows' pairs
POSITIONS_ARGS = ("workspace",)  # then the request ids


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


#: The pace of a status read that did not read it (a COMPLETED or missing request: status.lua).
_NO_PACE = Pace(None, None)


def _status_view(reply: list[Any]) -> StatusView:
    """status.lua's ``{"OK", values, ttl, position, pace, rate windows}``
    answer; ``ttl`` is None unless the request is COMPLETED, ``pace`` None when it is."""
    _, values, ttl, rank, pace = reply[:5]
    return StatusView(record=RequestRecord.from_values(values, ttl), position=rank,
                      pace=Pace(_seconds(pace[0]), _seconds(pace[1])) if pace else _NO_PACE)


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq)


class FrontDoorRequests(RequestStoreBase):
    """What the web routes call: admissions, status and history reads, results, cancels."""

    def _load_scripts(self, client: redis.Redis) -> None:
        super()._load_scripts(client)
        self._cancel = self.effects.load_script(client, "cancel", CANCEL_ARGS)
        self._status = load_script(client, "status", STATUS_ARGS)
        self._history = load_script(client, "history", HISTORY_ARGS)
        self._positions_of = load_script(client, "positions", POSITIONS_ARGS)
        #: A call's rate count outside the hot routes' scripts waits this little
        #: on Redis: the count is let go rather than the call held.
        self._spend_rate = load_script(bounded(client, SPEND_RATE_TIMEOUT_S), "rate")

    def admit(self, submission: Submission, rate=None) -> Admission:
        """The admission of ``submission`` (``admit.lua``, in the steps the
        store's model takes: :attr:`admission`): the record, its place in the
        provider's schedule, and a slot with its Celery message when one is free. ``rate`` (a ``ratelimit.Meter``) is
        counted first, and told where its windows stand; a spent window
        raises the refusal it makes. A lost reply is read back (``LostReplies``)."""
        rate_keys, rate_args = (rate.keys, rate.args) if rate is not None else ((), ())
        reply = self.admission.admit(self._admit_call(submission), rate_keys, rate_args)
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
        replies = self.admission.admit_many([self._admit_call(submission) for submission in submissions])
        if replies is None:
            return None
        for reply in replies:
            counted_windows(reply)  # no rate counted: an empty list, taken off before the granted ids are read
        return [self._admission(Admit(_text(reply[0])), reply, s.provider) for s, reply in zip(submissions, replies)]

    def _admit_call(self, submission: Submission) -> AdmitCall:
        """What admission is sent for ``submission``."""
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
            keys.body(request_id), keys.stored(workspace), keys.batch(workspace, submission.batch_id or "-"),
        ]
        return AdmitCall(values, idem_key, provider_keys, one_step_keys)

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
        if code is Admit.BUDGET_EXCEEDED:
            return Admission(code, budget=budgets.Refusal.of(reply[1:]))
        return Admission(code)

    def _deadline(self, now: float) -> str:
        """Until when (Unix seconds, as Redis's ``TIME`` tells it) the script
        may still write: past it, the caller has given up waiting and answered
        503, so the script refuses ("EXPIRED") instead of taking effect late.
        It ends ``CLOCK_ALLOWANCE_S`` before the caller's wait does, so a Redis
        clock that lags ours by up to that much is still safe."""
        if self.write_deadline_s is None:
            return ""
        return repr(now + max(0.05, self.write_deadline_s - CLOCK_ALLOWANCE_S))

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
        rate = self.consistency.rate_in_step(rate, self.count_apart)
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
        """What cancel.lua did (see :class:`~router_queue.requests.outcomes.Cancel`).
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
                      write_deadline=self._deadline(now), by="deadline" if by_deadline else ""),
        )
        reply = self.effects.settle(provider, reply)
        self._publish_granted(provider, reply[1:])
        return Cancel(_text(reply[0]))
