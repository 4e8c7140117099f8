"""A batch's second phase: its lines admitted, in input order, through the
same admission as a submit (``RequestStore.admit``: credits held per line,
gating, quotas), as the workspace's backlog and quotas allow.

A line refused for room (backlog, queued or stored bytes, pending webhooks,
a draining provider) or whose admission is in doubt waits in its batch: the
drain stops there and the sweeper runs it again. Any other refusal ends that
line with its error. Each line carries its Idempotency-Key, so a drain that
dies and runs again admits nothing twice. One drain at a time holds a batch
(``batch_take.lua``); each chunk's outcomes are written in one step.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from ..errors import BudgetExceeded, IdempotencyKeyConflict, InsufficientCredits, InvalidInput, NotEnabled, RouterError
from ..requests.outcomes import Admit, Cancel
from ..requests.record import Submission
from ..requests.values import Admission
from ..services import Services
from ..store.batches import admitted_outcome, error_outcome
from ..store.connect import UNREACHABLE, Unsent

log = logging.getLogger(__name__)

#: Outcomes that leave a line waiting in its batch, tried again later: never a refusal. A line of a
#: batch cancelled first waits too: the step then finds the batch cancelled and stops, and a read
#: shows every line past the cursor cancelled.
WAITS = frozenset({Admit.BACKLOG_FULL, Admit.QUEUED_BYTES_FULL, Admit.STORED_BYTES_FULL,
                   Admit.PENDING_WEBHOOKS_FULL, Admit.DRAINING, Admit.EXPIRED, Admit.IN_DOUBT, Admit.ADMITTING,
                   Admit.RATE_LIMITED, Admit.BATCH_CANCELLED})
#: Outcomes that end a line with an error: (its error type, its detail).
ENDS: dict[Admit, tuple[type[RouterError], str]] = {
    Admit.INSUFFICIENT_CREDITS: (InsufficientCredits, "the workspace had too few credits available to hold this "
                                                      "line's price; nothing was queued or charged for it"),
    Admit.BUDGET_EXCEEDED: (BudgetExceeded, "this line's price would take a budget of the workspace over its "
                                            "limit this period; nothing was queued or held for it"),
    Admit.NOT_ENABLED: (NotEnabled, "queued delivery is not switched on for this workspace"),
    Admit.NO_WEBHOOK: (InvalidInput, "webhook events were chosen, but there is no webhook to send them to"),
    Admit.NO_WEBHOOK_SECRET: (InvalidInput, "a webhook is named, but the workspace has no webhook signing secret "
                                            "to sign its events with"),
    Admit.IDEM_CONFLICT: (IdempotencyKeyConflict, "this line's Idempotency-Key is held by a different request"),
}
#: Lines read and admitted per step.
CHUNK_LINES = 200
#: Seconds one drain holds its batch without a step (a step of CHUNK_LINES admissions takes well under
#: one): a drain whose worker died holds its batch up to this long before the sweeper's next one runs it.
LEASE_S = 10.0
#: Seconds one drain runs before it hands the rest to the next (its task publishes it again).
BUDGET_S = 30.0


@dataclass(frozen=True)
class Drained:
    """What one drain did: lines admitted (or replayed), ended with an error,
    and why it stopped: "done" (every line has its outcome), "waiting" (a
    line waits for room), "budget" (more to do), "busy" (another drain holds
    it), "cancelled" or "missing"."""

    admitted: int
    ended: int
    stopped: str


def drain(services: Services, workspace: str, batch_id: str, *, budget_s: float = BUDGET_S,
          chunk_lines: int = CHUNK_LINES) -> Drained:
    """Admit the batch's lines from its cursor until done, a line waits, or ``budget_s`` has passed."""
    store = services.batches
    token = uuid.uuid4().hex
    taken = store.take(workspace, batch_id, token, LEASE_S, time.time())
    if taken[0] != "TAKEN":
        return Drained(0, 0, {"BUSY": "busy", "DONE": "done", "MISSING": "missing"}[taken[0]])
    _, cursor, total, _ = taken
    try:
        return _steps(services, workspace, batch_id, token, cursor, total, budget_s, chunk_lines)
    finally:  # let go at once: the next drain need not wait out the lease
        store.take(workspace, batch_id, token, 0, time.time())


def _steps(services: Services, workspace: str, batch_id: str, token: str, cursor: int, total: int,
           budget_s: float, chunk_lines: int) -> Drained:
    store = services.batches
    admitted = ended = 0
    give_up_at = time.monotonic() + budget_s
    while cursor < total:
        if time.monotonic() > give_up_at:
            return Drained(admitted, ended, "budget")
        texts = store.lines(workspace, batch_id, cursor, chunk_lines)
        outcomes: dict[int, str] = {}
        new_ids: list[tuple[str, str]] = []
        first_waiting: int | None = None
        pipelined = _admit_chunk(services, workspace, batch_id, cursor, texts)
        for i, text in enumerate(texts):
            if not text:
                continue
            if pipelined is None and first_waiting is not None:
                break  # one at a time: nothing after a line that waits is tried
            outcome = pipelined[i] if pipelined is not None else _admit(
                services, workspace, batch_id, cursor + i + 1, json.loads(text))
            if outcome is None:
                first_waiting = first_waiting or cursor + i + 1
                continue
            outcomes[cursor + i + 1] = outcome  # a line after one that waits keeps its outcome too
            if outcome.startswith("!"):
                ended += 1
            else:
                admitted += 1
                new_ids.append(tuple(outcome.split("|", 1)))  # type: ignore[arg-type]
        waiting = first_waiting is not None
        number = first_waiting - 1 if first_waiting is not None else cursor + len(texts)
        cancelled, drained = store.progress(workspace, batch_id, number, outcomes)
        store.take(workspace, batch_id, token, LEASE_S, time.time())  # renewed: this drain still runs
        if cancelled:
            _cancel_admitted(services, workspace, new_ids)
            return Drained(admitted, ended, "cancelled")
        if waiting or not texts:
            return Drained(admitted, ended, "waiting" if waiting else "done")
        cursor = number
    return Drained(admitted, ended, "done")


def _submission(workspace: str, batch_id: str, number: int, line: dict) -> Submission:
    return Submission(
        request_id=line["id"], workspace=workspace, model=line["m"], provider=line["p"], body=line["b"],
        fingerprint=line["f"], idempotency_key_hash=line["k"], price=int(line["c"]), priority=line["q"],
        webhook_url=line["w"], response_url=line["u"],
        batch_id=batch_id, line=number, metadata=line.get("md"), now=time.time(),
        fallback_models=line.get("fb", ""), model_price=line.get("mp"), key_id=line.get("ki", ""),
    )


def _admit_chunk(services: Services, workspace: str, batch_id: str, cursor: int,
                 texts: list[str]) -> list[str | None] | None:
    """A chunk's lines admitted in one pipelined round trip (``RequestStore.admit_many``): each line's
    outcome (None: it waits; "" for a line that ended at parsing), or None where the store admits one
    at a time. Lines after one that waits may be admitted here: their outcomes are recorded, the
    cursor stays at the line that waits, and the next drain's admission replays them by their keys."""
    lines = [(cursor + i + 1, json.loads(text)) for i, text in enumerate(texts) if text]
    if not lines:
        return None
    admissions = services.store.admit_many([_submission(workspace, batch_id, n, line) for n, line in lines])
    if admissions is None:
        return None
    outcomes: dict[int, str | None] = {n: _outcome(services, line, a) for (n, line), a in zip(lines, admissions)}
    return [outcomes.get(cursor + i + 1, "") for i in range(len(texts))]


def _admit(services: Services, workspace: str, batch_id: str, number: int, line: dict) -> str | None:
    """One line through admission: its outcome, or None when it waits."""
    try:
        admission = services.store.admit(_submission(workspace, batch_id, number, line))
    except (*UNREACHABLE, Unsent) as exc:
        log.warning("batch %s line %d: the store did not answer (%s); it waits", batch_id, number, exc)
        return None
    return _outcome(services, line, admission)


def _outcome(services: Services, line: dict, admission: Admission) -> str | None:
    """A line's outcome from its admission; None when it waits."""
    if admission.outcome in (Admit.ADMITTED, Admit.REPLAY):
        if admission.outcome is Admit.ADMITTED:
            services.metrics.admitted(line["p"], line["m"])
        return admitted_outcome(admission.request_id or line["id"], line["m"])
    if admission.outcome in WAITS:
        return None
    error, detail = ENDS.get(admission.outcome, (InvalidInput, f"refused: {admission.outcome.lower()}"))
    if admission.outcome is Admit.INSUFFICIENT_CREDITS:
        detail = f"{detail} ({line['c']} credits; {admission.available} available)"
    return error_outcome(error.error_type, detail)


def _cancel_admitted(services: Services, workspace: str, admitted: list[tuple[str, str]]) -> None:
    """Cancel requests a step admitted as its batch was being cancelled."""
    for request_id, model in admitted:
        entry = services.catalog.get(*model.split("/", 1))
        if entry is not None:
            services.store.cancel(request_id=request_id, workspace=workspace, model=model, provider=entry.provider)


def cancel_unrecorded(services: Services, workspace: str, batch_id: str) -> list[Cancel]:
    """Cancel what a drain that died mid-step admitted and never recorded: at most its one chunk
    past the cursor, each line's request id minted when staged (MISSING: never admitted). For a
    batch just marked cancelled, which no drain takes again; a live drain cancels its own step."""
    store = services.batches
    cursor = int((store.get(workspace, batch_id) or {}).get("cursor", 0))
    texts = store.lines(workspace, batch_id, cursor, CHUNK_LINES)
    done = []
    for text, outcome in zip(texts, store.outcomes(workspace, batch_id, cursor + 1, len(texts))):
        if text and outcome is None:
            line = json.loads(text)
            done.append(services.store.cancel(request_id=line["id"], workspace=workspace, model=line["m"],
                                              provider=line["p"]))
    return done
