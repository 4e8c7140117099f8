"""A workspace's batches in Redis (``POST /v2/batches``): the batch's hash,
its lines ready to admit, their outcomes, and the indexes that list them.

Every key but :func:`keys.batches_unfinished` is in the workspace's slot, so
each step is one script there (``lua/batch_*.lua``). A batch is staged line
by line (with a TTL), then made durable in one step (``batch_commit.lua``).
The requests its lines become live in their providers' slots and are read
with one pipelined round trip per chunk (:meth:`BatchStore.line_states`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from . import keys
from .scripts import argv, load_script

COMMIT_ARGS = ("id", "now", "fingerprint", "idem_ttl", "max_open")
TAKE_ARGS = ("token", "now", "lease_s")
PROGRESS_ARGS = ("upto",)
FINISH_ARGS = ("id", "now", "counts", "retention", "webhook")
#: Seconds a staged batch (lines written, not yet committed) is kept: a front
#: door that died mid-upload leaves nothing for long.
STAGED_TTL_S = 3600
#: An outcome that is an error starts with this; the rest is its JSON.
ERROR_MARK = "!"
#: The request fields a batch read takes of each line's request.
_LINE_FIELDS = ("status", "error_type", "price", "cost_state", "hold")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class LineState:
    """What a batch read shows of one admitted line's request (None: past retention)."""

    status: str | None
    error_type: str | None
    credits: int
    #: "held", "charged" or "released" (``record.py``'s cost states).
    cost_state: str


def error_outcome(error_type: str, detail: str) -> str:
    """A line's outcome when it ended without a request."""
    return ERROR_MARK + json.dumps({"error_type": error_type, "detail": detail}, separators=(",", ":"))


def admitted_outcome(request_id: str, model: str) -> str:
    """A line's outcome once admitted: its request, and the model that addresses it."""
    return f"{request_id}|{model}"


class BatchStore:
    def __init__(self, client: redis.Redis, *, retention_s: int, idempotency_ttl_s: int):
        self.client = client
        self.retention_s = retention_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self._commit = load_script(client, "batch_commit", COMMIT_ARGS)
        self._take = load_script(client, "batch_take", TAKE_ARGS)
        self._progress = load_script(client, "batch_progress", PROGRESS_ARGS)
        self._cancel = load_script(client, "batch_cancel")
        self._finish = load_script(client, "batch_finish", FINISH_ARGS)

    # -- submit --------------------------------------------------------------
    def stage(self, workspace: str, batch_id: str, lines: list[str], outcomes: dict[int, str]) -> None:
        """Append ``lines`` (JSON each; "" for a line that ended at parsing,
        whose error is in ``outcomes``) to a batch not yet committed."""
        pipe = self.client.pipeline(transaction=False)
        lines_key, results_key = keys.batch_lines(workspace, batch_id), keys.batch_results(workspace, batch_id)
        if lines:
            pipe.rpush(lines_key, *lines)
            pipe.expire(lines_key, STAGED_TTL_S)
        if outcomes:
            pipe.hset(results_key, mapping={str(n): v for n, v in outcomes.items()})
            pipe.expire(results_key, STAGED_TTL_S)
        pipe.execute()

    def discard(self, workspace: str, batch_id: str) -> None:
        """Drop a staged batch that was not committed (a replay, a refusal)."""
        self.client.delete(keys.batch_lines(workspace, batch_id), keys.batch_results(workspace, batch_id))

    def commit(self, workspace: str, batch_id: str, fields: dict[str, Any], *, fingerprint: str, key_hash: str,
               max_open: int, now: float) -> tuple[str, str | int | None]:
        """``batch_commit.lua``: ("CREATED", None), ("REPLAY", batch id),
        ("CONFLICT", None) or ("TOO_MANY", open batches). The batch is in the
        sweeper's index before it exists, so no crash leaves it undrained."""
        self.client.zadd(keys.batches_unfinished(), {f"{workspace}|{batch_id}": now})
        flat = [str(v) for pair in fields.items() for v in pair]
        reply = self._commit(
            keys=[keys.batch(workspace, batch_id), keys.batch_lines(workspace, batch_id),
                  keys.batch_results(workspace, batch_id), keys.batches(workspace), keys.batches_open(workspace),
                  keys.batch_idempotency(workspace, key_hash or "-")],
            args=[*argv(COMMIT_ARGS, id=batch_id, now=repr(now), fingerprint=fingerprint,
                        idem_ttl=self.idempotency_ttl_s, max_open=max_open), *flat])
        code = _text(reply[0])
        if code != "CREATED":
            self.client.zrem(keys.batches_unfinished(), f"{workspace}|{batch_id}")
        if code == "REPLAY":
            return code, _text(reply[1])
        if code == "TOO_MANY":
            return code, int(reply[1])
        return code, None

    def open_batches(self, workspace: str) -> int:
        return int(self.client.zcard(keys.batches_open(workspace)))

    # -- reading -------------------------------------------------------------
    def get(self, workspace: str, batch_id: str) -> dict[str, str] | None:
        found = self.client.hgetall(keys.batch(workspace, batch_id))
        return {_text(k): _text(v) for k, v in found.items()} if found else None

    def lines(self, workspace: str, batch_id: str, start: int, count: int) -> list[str]:
        """Lines ``start`` .. ``start + count - 1`` (0-based) as staged."""
        return [_text(v) for v in self.client.lrange(keys.batch_lines(workspace, batch_id), start, start + count - 1)]

    def outcomes(self, workspace: str, batch_id: str, first: int, count: int) -> list[str | None]:
        """The outcomes of lines ``first`` .. ``first + count - 1`` (numbered from 1), None where none yet."""
        if count <= 0:
            return []
        numbers = [str(n) for n in range(first, first + count)]
        found = self.client.hmget(keys.batch_results(workspace, batch_id), numbers)
        return [None if v is None else _text(v) for v in found]

    def line_states(self, request_ids: list[str]) -> list[LineState]:
        """Each request's status, error and cost, in one pipelined round trip."""
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hmget(keys.request(request_id), _LINE_FIELDS)
        states = []
        for status, error_type, price, cost_state, hold in pipe.execute():
            if cost_state:
                credits, state = int(float(price or 0)), _text(cost_state)
            else:
                credits, state = int(float(hold or 0)), "held"
            states.append(LineState(None if status is None else _text(status),
                                    None if not error_type else _text(error_type), credits, state))
        return states

    def page(self, workspace: str, before: float | None, limit: int) -> list[tuple[str, float]]:
        """Up to ``limit`` batch ids, newest first, created before ``before`` (None: any)."""
        found = self.client.zrevrangebyscore(keys.batches(workspace), f"({before!r}" if before else "+inf", "-inf",
                                             start=0, num=limit, withscores=True)
        return [(_text(member), float(score)) for member, score in found]

    def forget(self, workspace: str, batch_ids: list[str]) -> None:
        """Drop expired batches from the workspace's index (a list met them gone)."""
        if batch_ids:
            self.client.zrem(keys.batches(workspace), *batch_ids)

    # -- drain ---------------------------------------------------------------
    def take(self, workspace: str, batch_id: str, token: str, lease_s: float, now: float) -> list[Any]:
        """``batch_take.lua``: ["TAKEN", cursor, total, cancelled], ["BUSY"], ["DONE"] or ["MISSING"]."""
        reply = self._take(keys=[keys.batch(workspace, batch_id)],
                           args=argv(TAKE_ARGS, token=token, now=repr(now), lease_s=lease_s))
        return [_text(reply[0]), *(int(v) if i < 2 else _text(v) == "1" for i, v in enumerate(reply[1:]))]

    def progress(self, workspace: str, batch_id: str, upto: int, outcomes: dict[int, str]) -> tuple[bool, bool]:
        """``batch_progress.lua``: (cancelled, drained)."""
        flat = [str(v) for pair in outcomes.items() for v in pair]
        cancelled, drained = self._progress(
            keys=[keys.batch(workspace, batch_id), keys.batch_results(workspace, batch_id),
                  keys.batch_lines(workspace, batch_id)],
            args=[*argv(PROGRESS_ARGS, upto=upto), *flat])
        return _text(cancelled) == "1", _text(drained) == "1"

    def cancel(self, workspace: str, batch_id: str) -> str:
        """``batch_cancel.lua``: "CANCELLED", "COMPLETED" or "MISSING"."""
        return _text(self._cancel(keys=[keys.batch(workspace, batch_id)])[0])

    def finish(self, workspace: str, batch_id: str, counts: dict[str, Any], now: float, *, webhook: bool) -> bool:
        """``batch_finish.lua``: True for the one caller that marked it
        COMPLETED; ``webhook``: its batch.completed webhook is owed."""
        reply = self._finish(
            keys=[keys.batch(workspace, batch_id), keys.batch_lines(workspace, batch_id),
                  keys.batch_results(workspace, batch_id), keys.batches_open(workspace)],
            args=argv(FINISH_ARGS, id=batch_id, now=repr(now), counts=json.dumps(counts), retention=self.retention_s,
                      webhook="owed" if webhook else ""))
        return _text(reply[0]) == "FINISHED"

    def note_ended(self, workspace: str, batch_id: str, lines: int) -> None:
        """A hint: the first ``lines`` lines have all ended (a lower bound, so two writers are both right)."""
        self.client.hset(keys.batch(workspace, batch_id), "ended", lines)

    def take_webhook(self, workspace: str, batch_id: str, token: str, lease_s: float) -> bool:
        """The batch's webhook for one attempt, for ``lease_s``: False while another attempt holds it."""
        return bool(self.client.set(keys.batch_webhook_lease(workspace, batch_id), token, nx=True,
                                    px=max(1, int(lease_s * 1000))))

    def release_webhook(self, workspace: str, batch_id: str) -> None:
        """The attempt's lease given back (by its holder, within it: WEBHOOK_TIMEOUT_SECONDS < the lease)."""
        self.client.delete(keys.batch_webhook_lease(workspace, batch_id))

    def mark_webhook(self, workspace: str, batch_id: str, state: str, attempts: int) -> None:
        """The batch.completed webhook's state ("owed", "delivered", "failed") and attempts so far."""
        self.client.hset(keys.batch(workspace, batch_id), mapping={"webhook": state, "webhook_attempts": attempts})

    def settled(self, workspace: str, batch_id: str) -> None:
        """Out of the sweeper's index: COMPLETED with nothing owed, or gone."""
        self.client.zrem(keys.batches_unfinished(), f"{workspace}|{batch_id}")

    def unfinished(self, limit: int = 100) -> list[tuple[str, str]]:
        """(workspace, batch id) of the oldest batches not yet COMPLETED."""
        members = self.client.zrange(keys.batches_unfinished(), 0, limit - 1)
        return [tuple(_text(m).split("|", 1)) for m in members]  # type: ignore[misc]
