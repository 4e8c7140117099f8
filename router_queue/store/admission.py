"""Admission's arguments and its steps, one object per consistency model
(``consistency.py``): the store asks it to admit, to admit several at once,
and to give up what was left between steps. One Redis admits in one step
(:class:`OneStepAdmission`, ``admit.lua``). A cluster's provider and workspace
live in different slots, so it takes three (:class:`TwoStepAdmission`): the
admission written pending in the provider's slot (``keys.admitting``), the
workspace's part (``admit_ws.lua``), then the provider's (``admit_place.lua``),
which runs only while it is still pending. A refusal there is undone at once
(``admit_undo.lua``); one abandoned between the steps, by the sweeper
:data:`ABANDON_AFTER_S` past its write deadline. Whichever takes the member out
first decides. A lost reply is read back (:class:`LostReplies`).
``docs/ARCHITECTURE.md``, "Redis Cluster"."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, NamedTuple, Protocol

import redis

from ..blobs.pointers import BodyPointer, body_size
from ..requests.record import ADMITTED
from . import keys
from .connect import UNREACHABLE, NotAdmitted, Unsent, bounded, never_sent
from .objects import POINTER_MAX_BYTES
from .replication import ReplicatedWrites
from .scripts import argv, load_script

log = logging.getLogger(__name__)

#: admit.lua's ARGV by name, in order (its header says what each holds): the
#: fields admission carries from the submission into the record, as
#: ``requests/record.py`` declares them, then what steers the admission.
ADMIT_ARGS = (*(f.name for f in ADMITTED), "body", "now", "fingerprint", "idem_ttl", "require_enabled",
              "grant_until", "price", "max_queued", "template", "cap", "low_headroom_pct", "write_deadline",
              "webhook_url", "response_url", "max_queued_bytes", "max_pending_webhooks", "webhook_events", "retention",
              "max_stored_bytes", "retry_max", "ledger_keep")
#: The split steps' (admit_ws.lua, admit_place.lua): admit.lua's, and the
#: body's bytes (the workspace's step is not sent the body), the workspace's
#: step's answer and the pending member (the provider's step's).
SPLIT_ADMIT_ARGS = (*ADMIT_ARGS, "body_bytes", "reserved", "admitting")
#: Seconds past its write deadline before the sweeper gives a pending admission up.
ABANDON_AFTER_S = 5.0
#: The write deadline of an admission whose caller set none (not the front door's).
DEFAULT_DEADLINE_S = 10.0
#: Most pending admissions of one provider the sweeper gives up per run.
ABANDON_BATCH = 500


#: admitted.lua's ARGV by name.
ADMITTED_ARGS = ("id", "write_deadline")
#: admit_undo.lua's ARGV by name.
UNDO_ARGS = ("id", "price", "body_bytes", "now", "key_id", "since")
#: Reads of a lost admission's outcome at most, each waiting half the budget.
LOST_REPLY_READS = 2
#: Seconds between two of those reads after one failed at once (a refused connection).
LOST_REPLY_PAUSE_S = 0.05


def counted_windows(reply: list[Any]) -> list[Any] | None:
    """The ``{count, ms left}`` per rate window that admit.lua's and
    admit_ws.lua's replies end with once they counted the call, taken off the
    reply; None for a reply without them (refused by rate, expired, read back)."""
    return reply.pop() if reply and isinstance(reply[-1], list) else None


class AdmitCall(NamedTuple):
    """What an admission is sent (``FrontDoorRequests._admit_call``): ADMIT_ARGS
    by name, its Idempotency-Key's key, and admit.lua's keys, the provider's
    part (split, in admit_place.lua's order but the pending set) and all."""

    values: dict[str, Any]
    idem_key: str
    provider_keys: list[str]
    one_step_keys: list[str]


class AdmissionSteps(Protocol):
    """Admission as the store's consistency model takes it; each answers as admit.lua does."""

    def admit(self, call: AdmitCall, rate_keys: Any, rate_args: Any) -> list[Any]:
        """Admit ``call``, the caller's rate windows (keys, args) counted first."""
        ...

    def admit_many(self, calls: list[AdmitCall]) -> list[list[Any]] | None:
        """Several admissions in one round trip, no rate counted; None where
        that would drop a guarantee :meth:`admit` keeps, or on a failed round trip."""
        ...

    def abandon(self, provider: str, now: float) -> int:
        """Give up the provider's admissions left between their steps; how many were undone."""
        ...


class LostReplies:
    """What an admission whose reply never came did: ``admitted.lua`` reads
    whether its record exists, and, if not, whether Redis's clock is past
    the write deadline (then no script still in flight can admit it). A
    stalled Redis answers neither: the outcome is then in doubt.

    An attempt with an Idempotency-Key that did not itself admit is "not
    carried out" only if its key is free: an earlier attempt with the key
    (one answered in doubt) may have admitted, and this attempt's script
    may have answered its replay. So such an attempt is in doubt unless
    Redis says the key is free (:meth:`key_free`); the resend settles it."""

    def __init__(self, client: redis.Redis, budget_s: float):
        self.budget_s = budget_s
        self._bounded = bounded(client, budget_s / LOST_REPLY_READS)
        self._admitted = load_script(self._bounded, "admitted", ADMITTED_ARGS)

    def reply(self, lost: Exception, values: dict[str, Any], idem_key: str | None = None) -> list[Any]:
        """In place of the reply ``lost`` (raised by the step that writes the
        record, run with ``values``): admit.lua's ``ADMITTED`` (its granted
        ids unknown: the reaper publishes them), ``EXPIRED`` (never admitted,
        and ``idem_key``, the attempt's key if it has one, free), or
        ``IN_DOUBT`` when Redis did not tell within the budget. ``lost``
        itself again when the step never left this process (and the key is free)."""
        if never_sent(lost):
            return self.unsent(lost, values, idem_key)
        request_id = values["id"]
        reply = self._read_back(request_id, values["provider"], str(values["write_deadline"]))
        if reply[0] == b"EXPIRED" and idem_key is not None and not self.key_free(idem_key, request_id):
            reply = [b"IN_DOUBT"]
        log.warning("an admission's reply was lost (%s); read back: %s", lost, reply[0].decode(),
                    extra={"request_id": request_id})
        return reply

    def unsent(self, lost: Exception, values: dict[str, Any], idem_key: str | None) -> list[Any]:
        """For an attempt (``values``) that never reached Redis (``lost``):
        :class:`NotAdmitted` (answered 503: nothing was carried out, and its
        key, if any, is free), but ``IN_DOUBT`` for one whose key an earlier
        attempt may hold."""
        if idem_key is None or self.key_free(idem_key, values["id"]):
            raise NotAdmitted(str(lost)) from lost
        log.warning("an admission was not sent (%s) and its Idempotency-Key is held or unreadable: in doubt", lost)
        return [b"IN_DOUBT"]

    def key_free(self, idem_key: str, request_id: str) -> bool:
        """Whether Redis says no attempt but this one (``request_id``: split,
        its workspace's step reserved the key, and is undone) holds
        ``idem_key``; False when it does not answer within half the budget."""
        try:
            held = self._bounded.get(idem_key)
            return held is None or held.decode().endswith(f"|{request_id}")
        except UNREACHABLE as exc:
            log.warning("an Idempotency-Key could not be read (%s)", exc)
            return False

    def _read_back(self, request_id: str, provider: str, write_deadline: str) -> list[Any]:
        give_up_at = time.monotonic() + self.budget_s
        for _ in range(LOST_REPLY_READS):
            pause = LOST_REPLY_PAUSE_S
            try:
                found = self._admitted(keys=[keys.request(request_id), keys.schedule(provider)],
                                       args=argv(ADMITTED_ARGS, id=request_id, write_deadline=write_deadline))
            except UNREACHABLE as exc:
                log.warning("an admission's outcome could not be read (%s)", exc)
            else:
                if found[0] == b"ADMITTED":
                    return [b"ADMITTED", request_id.encode(), found[1]]
                if found[0] == b"NOT_ADMITTED":
                    return [b"EXPIRED"]
                if float(found[1]) < 0:  # no write deadline: a script in flight may still admit it
                    break
                pause += float(found[1])  # Redis's clock is behind ours: read again once it is past
            if time.monotonic() + pause >= give_up_at:
                break
            time.sleep(pause)
        return [b"IN_DOUBT"]


class OneStepAdmission:
    """One Redis: each admission is ``admit.lua``'s one atomic step, written
    once the replicas have it (``acknowledged``); nothing is ever left between
    steps. A lost reply is read back (``lost_replies``)."""

    def __init__(self, client: redis.Redis, lost_replies: LostReplies, acknowledged: ReplicatedWrites):
        self.client = client
        self.lost_replies = lost_replies
        self.acknowledged = acknowledged
        self._admit = load_script(client, "admit", ADMIT_ARGS)

    def admit(self, call: AdmitCall, rate_keys: Any, rate_args: Any) -> list[Any]:
        try:
            return self.acknowledged.run(self._admit, keys=[*call.one_step_keys, *rate_keys],
                                         args=[*argv(ADMIT_ARGS, **call.values), *rate_args])
        except UNREACHABLE as exc:  # sent, and no reply: Redis may have run it
            return self.lost_replies.reply(exc, call.values, call.idem_key if call.values["fingerprint"] else None)

    def admit_many(self, calls: list[AdmitCall]) -> list[list[Any]] | None:
        """Each its own ``admit.lua``, pipelined; None when writes are held
        for replicas (nothing is sent) or the round trip fails (some may have been admitted)."""
        if self.acknowledged.replication.replicas:
            return None
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            self._admit(keys=call.one_step_keys, args=argv(ADMIT_ARGS, **call.values), client=pipe)
        try:
            replies = pipe.execute(raise_on_error=False)
        except UNREACHABLE:
            return None
        return None if any(isinstance(reply, Exception) for reply in replies) else replies

    def abandon(self, provider: str, now: float) -> int:
        return 0  # nothing is ever between steps


class TwoStepAdmission:
    """A Redis Cluster: each admission in the three steps the module's docstring tells."""

    def __init__(self, client: redis.Redis, lost_replies: LostReplies, acknowledged: ReplicatedWrites):
        self.client = client
        self.lost_replies = lost_replies
        #: The provider's step, which writes the record the caller is told of, waits for the replicas.
        self.acknowledged = acknowledged
        #: Called between the workspace's step and the provider's (tests kill
        #: the process there); None in service.
        self.between_steps: Callable[[], None] | None = None
        self._reserve = load_script(client, "admit_ws", SPLIT_ADMIT_ARGS)
        self._place = load_script(client, "admit_place", SPLIT_ADMIT_ARGS)
        self._undo = load_script(client, "admit_undo", UNDO_ARGS)

    def admit(self, call: AdmitCall, rate_keys: Any, rate_args: Any) -> list[Any]:
        """Admit in the three steps; answers as admit.lua does."""
        values, idem_key, provider_keys = call.values, call.idem_key, call.provider_keys
        request_id, workspace, provider = values["id"], values["workspace"], values["provider"]
        body_bytes = self._body_bytes(values)
        if not values["write_deadline"]:
            values = {**values, "write_deadline": repr(float(values["now"]) + DEFAULT_DEADLINE_S)}
        pending = json.dumps({"id": request_id, "ws": workspace, "price": int(values["price"]), "bytes": body_bytes,
                              "idem": idem_key, "key": values["key_id"], "at": values["now"]},
                             separators=(",", ":"))
        admitting = keys.admitting(provider)
        try:
            self.client.zadd(admitting, {pending: float(values["write_deadline"])})
            reserved = self._reserve(
                keys=[keys.workspace(workspace), idem_key, keys.ledger(workspace), keys.history(workspace),
                      keys.model_history(workspace, values["model"]), keys.open_requests(workspace),
                      keys.stored(workspace), keys.batch(workspace, values["batch_id"] or "-"), *rate_keys],
                args=[*argv(SPLIT_ADMIT_ARGS, **{**values, "body": "", "body_bytes": body_bytes, "reserved": "",
                                                 "admitting": ""}), *rate_args])
            if reserved[0] != b"RESERVED":
                self.client.zrem(admitting, pending)
                if reserved[0] == b"REPLAY" and self._between_steps(workspace, reserved[1].decode()):
                    # the original may yet be refused: its id is not an answer yet
                    return [b"ADMITTING", *reserved[2:]]  # and where the rate windows stand
                return reserved
            windows = counted_windows(reserved)  # the placed reply ends with them, as admit.lua's does
        except UNREACHABLE as exc:
            # The provider's step, the only one that writes the record, was not
            # sent: not admitted (a workspace part left pending, the sweeper undoes).
            unsent = Unsent(f"admission stopped before its provider's step: {exc}")
            unsent.__cause__ = exc
            return self.lost_replies.unsent(unsent, values, idem_key if values["fingerprint"] else None)
        if self.between_steps is not None:
            self.between_steps()
        try:
            placed = self.acknowledged.run(self._place, keys=[*provider_keys, admitting],
                                           args=argv(SPLIT_ADMIT_ARGS, **{**values, "body_bytes": body_bytes,
                                                                "reserved": reserved[1], "admitting": pending}))
        except UNREACHABLE as exc:
            if never_sent(exc):
                self._give_back(admitting, pending)
            placed = self.lost_replies.reply(exc, values, idem_key if values["fingerprint"] else None)
        if placed[0] not in (b"ADMITTED", b"IN_DOUBT"):  # in doubt: the sweeper undoes it if it was not placed
            self._give_back(admitting, pending)
        return [*placed, windows] if windows is not None else placed

    def admit_many(self, calls: list[AdmitCall]) -> list[list[Any]] | None:
        return None  # each admission's steps wait on the one before: not pipelined

    def abandon(self, provider: str, now: float) -> int:
        """Give up the provider's admissions pending :data:`ABANDON_AFTER_S`
        past their write deadline (their caller died or gave up between the
        steps): each undone once; returns how many were undone now."""
        admitting = keys.admitting(provider)
        undone = 0
        for pending in self.client.zrangebyscore(admitting, "-inf", now - ABANDON_AFTER_S, start=0,
                                                 num=ABANDON_BATCH):
            if self.client.zrem(admitting, pending):
                undone += self._undo_reserved(json.loads(pending))
        return undone

    def _between_steps(self, workspace: str, request_id: str) -> bool:
        """Whether an admission has its workspace's part and not (yet) its
        record: its open entry still owes its end, and no record exists. A
        replay then must not answer its id, which may never exist; a record
        long expired (its end given) is replayed as on one Redis."""
        if self.client.exists(keys.request(request_id)):
            return False
        owes = self.client.hget(keys.open_requests(workspace), request_id)
        return owes is not None and b"e" in owes

    def _give_back(self, admitting: str, pending: str) -> None:
        """Undo a refused admission's workspace part, then end it; if this
        fails, the sweeper does both."""
        try:
            self._undo_reserved(json.loads(pending))
            self.client.zrem(admitting, pending)
        except redis.RedisError as exc:
            log.warning("a refused admission's workspace part left to the sweeper to undo (%s)", exc)

    def _undo_reserved(self, pending: dict[str, Any]) -> int:
        workspace = pending["ws"]
        return int(self._undo(keys=[keys.workspace(workspace), keys.ledger(workspace), pending["idem"],
                                    keys.open_requests(workspace)],
                              args=argv(UNDO_ARGS, id=pending["id"], price=pending["price"],
                                        body_bytes=pending["bytes"], now=repr(time.time()),
                                        key_id=pending.get("key", ""), since=pending.get("at", ""))))

    def _body_bytes(self, values: dict[str, Any]) -> int:
        """The bytes the body will take: a retry's is its original's (kept
        apart, shared with its chain's first request, or in its record by an
        earlier version). Another caller's or model's original counts 0, as
        an unknown one does: its size is read only once it is the caller's,
        so the quotas' answers tell nothing of it (the provider's step then
        refuses it as unknown)."""
        if not values["retry_of"]:
            return body_size(values["body"])
        original = keys.request(values["retry_of"])
        workspace, model, owner = self.client.hmget(original, ("workspace", "model", "body_of"))
        if workspace != values["workspace"].encode() or model != values["model"].encode():
            return 0
        kept_key = keys.body(owner.decode() if owner else values["retry_of"])
        pipe = self.client.pipeline(transaction=False)
        pipe.strlen(kept_key)
        pipe.getrange(kept_key, 0, POINTER_MAX_BYTES)  # a pointer's text names the object's size
        pipe.hstrlen(original, "body")
        kept, head, in_record = pipe.execute()
        if BodyPointer.parse(head) is not None:
            return body_size(head)
        return int(kept or in_record or 0)
