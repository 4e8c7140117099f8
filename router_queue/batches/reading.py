"""A batch as its caller reads it: each line's state (:func:`line_views`),
and the batch's status and counts (:func:`summary`).

A line that ended at parsing or at admission is COMPLETED with its error; an
admitted line is its request as it stands; a line not yet admitted is
IN_QUEUE, or COMPLETED ``cancelled`` once its batch was cancelled. A read
costs at most one round trip per :data:`CHUNK` lines, pipelined; a COMPLETED
batch's counts are kept on it and read back without counting.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..services import Services
from ..states import COMPLETED, IN_PROGRESS, IN_QUEUE
from ..store.batches import ERROR_MARK

#: Lines read per round trip.
CHUNK = 1000


@dataclass(frozen=True)
class LineView:
    line: int
    status: str
    request_id: str | None = None
    model: str | None = None
    error_type: str | None = None
    detail: str | None = None
    credits: int = 0
    #: "held", "charged" or "released"; "" for a line with no request.
    cost_state: str = ""


@dataclass
class Summary:
    status: str
    #: Lines by status, and the ended lines by error_type.
    counts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    credits_held: int = 0
    credits_charged: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status, "counts": {**self.counts, "by_error_type": self.errors},
                "credits": {"held": self.credits_held, "charged": self.credits_charged}}


def line_views(services: Services, workspace: str, batch_id: str, batch: dict[str, str], first: int,
               count: int) -> list[LineView]:
    """Lines ``first`` .. ``first + count - 1`` (from 1) as they stand."""
    outcomes = services.batches.outcomes(workspace, batch_id, first, count)
    admitted: list[tuple[int, str, str]] = []
    for i, outcome in enumerate(outcomes):
        if outcome and not outcome.startswith(ERROR_MARK):
            request_id, _, model = outcome.partition("|")
            admitted.append((i, request_id, model))
    states = iter(services.batches.line_states([request_id for _, request_id, _ in admitted]))
    by_index = {i: (request_id, model, next(states)) for i, request_id, model in admitted}
    cancelled = batch.get("cancelled") == "1"
    views = []
    for i, outcome in enumerate(outcomes):
        number = first + i
        if outcome is None:
            views.append(LineView(number, COMPLETED, error_type="cancelled") if cancelled
                         else LineView(number, IN_QUEUE))
        elif outcome.startswith(ERROR_MARK):
            error = json.loads(outcome[len(ERROR_MARK):])
            views.append(LineView(number, COMPLETED, error_type=error["error_type"], detail=error["detail"]))
        else:
            request_id, model, state = by_index[i]
            views.append(LineView(number, state.status or COMPLETED, request_id, model, state.error_type,
                                  credits=state.credits, cost_state=state.cost_state))
    return views


def all_lines(services: Services, workspace: str, batch_id: str, batch: dict[str, str]) -> Iterator[LineView]:
    """Every line in input order, read :data:`CHUNK` at a time."""
    total = int(batch.get("total", 0))
    for first in range(1, total + 1, CHUNK):
        yield from line_views(services, workspace, batch_id, batch, first, min(CHUNK, total - first + 1))


def summary(services: Services, workspace: str, batch_id: str, batch: dict[str, str]) -> Summary:
    """The batch's status and counts: kept ones once COMPLETED, else counted now."""
    if batch.get("status") == COMPLETED and batch.get("counts"):
        kept = json.loads(batch["counts"])
        return Summary(COMPLETED, kept["counts"], kept["errors"], kept["held"], kept["charged"])
    counts: Counter[str] = Counter({IN_QUEUE: 0, IN_PROGRESS: 0, COMPLETED: 0})
    errors: Counter[str] = Counter()
    held = charged = 0
    for view in all_lines(services, workspace, batch_id, batch):
        counts[view.status] += 1
        if view.error_type:
            errors[view.error_type] += 1
        if view.cost_state == "held":
            held += view.credits
        elif view.cost_state == "charged":
            charged += view.credits
    total = int(batch.get("total", 0))
    if counts[COMPLETED] == total:
        status = COMPLETED
    elif counts[IN_PROGRESS] or counts[COMPLETED]:
        status = IN_PROGRESS
    else:
        status = IN_QUEUE
    return Summary(status, dict(counts), dict(errors), held, charged)


def kept_counts(found: Summary) -> dict[str, Any]:
    """What ``batch_finish.lua`` keeps of a COMPLETED batch's summary."""
    return {"counts": found.counts, "errors": found.errors, "held": found.credits_held,
            "charged": found.credits_charged}
