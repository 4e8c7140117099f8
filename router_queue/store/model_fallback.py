"""A request's turn from its model to one it named in X-Comfy-Fallback-Models.

The worker tells :meth:`ModelFallback.trouble` each time the request's
model could not run (its pool kept it waiting, or a member failed it);
``fallback_turn.lua`` keeps the clock on the record and, once the trouble
has lasted ``FALLBACK_AFTER_SECONDS`` (or the request's start deadline came
first), names the next model in one step on the record's own key, so two
deliveries never turn it twice. ``docs/POOLS.md``, "Fallback between models".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import redis

from ..requests.record import RequestRecord
from . import keys
from .scripts import argv, load_script

TURN_ARGS = ("now", "after", "model", "next", "next_price", "member", "error_type")


@dataclass(frozen=True)
class Turn:
    """``model``: the model the request runs on now (another than the one it
    was told about: it turned); else ``wait_s`` until a turn is due (inf:
    none will be); ``gone``: the request is no longer running."""

    model: str = ""
    wait_s: float = 0.0
    gone: bool = False


def models_named(record: RequestRecord) -> list[str]:
    """The fallback models the request named, in the caller's order."""
    return [m for m in (record.fallback_models or "").split(",") if m]


def next_model(record: RequestRecord, current: str) -> str:
    """The first model named after ``current`` that it has not run on yet ("" for none)."""
    left = {current, record.model, *(t.get("model", "") for t in record.tried or [])}
    return next((m for m in models_named(record) if m not in left), "")


class ModelFallback:
    def __init__(self, client: redis.Redis, *, after_s: float, clock: Callable[[], float] = time.time):
        self.client = client
        self.after_s = after_s
        self.clock = clock
        self._turn = load_script(client, "fallback_turn", TURN_ARGS)

    def trouble(self, record: RequestRecord, current: str, upcoming: str, member: str = "", error_type: str = "",
                *, next_price: int | None = None) -> Turn:
        """``record``'s model ``current`` could not run (``member`` and
        ``error_type`` say why, "" when its pool had no member to give).
        ``upcoming``: the model a turn names, the caller's
        :func:`next_model`; ``next_price``: its price, which a turn makes
        the request's."""
        reply = self._turn(keys=[keys.request(record.id)],
                           args=argv(TURN_ARGS, now=repr(self.clock()), after=repr(self.after_s), model=current,
                                     next=upcoming, next_price="" if next_price is None else next_price, member=member,
                                     error_type=error_type))
        if reply[0] == b"GONE":
            return Turn(gone=True)
        if reply[0] == b"TURNED":
            return Turn(model=reply[1].decode())
        wait_s = float(reply[1])
        return Turn(wait_s=math.inf if wait_s < 0 else wait_s)
