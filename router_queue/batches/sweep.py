"""The sweeper's pass over batches not yet settled (``workers/sweeper.py``):
each still draining has its drain published again (a drain that died, or
whose lines waited for room); each whose lines have all ended is finished;
each finished with its webhook owed gets an attempt. Safe to run twice: the
drain's lease and the finish's one step decide."""

from __future__ import annotations

from typing import Callable

from ..services import Services
from ..states import COMPLETED
from .finish import finish_if_done, send_webhook

#: Batches looked at per sweep at most (the oldest first).
BATCHES_PER_SWEEP = 100


def sweep_batches(services: Services, publish_drain: Callable[[str, str], None]) -> int:
    """One pass; the number of batches acted on."""
    store = services.batches
    acted = 0
    for workspace, batch_id in store.unfinished(BATCHES_PER_SWEEP):
        batch = store.get(workspace, batch_id)
        if batch is None:  # never committed, or expired
            store.settled(workspace, batch_id)
            continue
        if batch.get("status") != COMPLETED and batch.get("cancelled") != "1" \
                and int(batch.get("cursor", 0)) < int(batch.get("total", 0)):
            publish_drain(workspace, batch_id)
            acted += 1
            continue
        if batch.get("status") != COMPLETED:
            finish_if_done(services, workspace, batch_id, batch)
            batch = store.get(workspace, batch_id) or {}
        if batch.get("status") == COMPLETED:
            acted += 1
            if batch.get("webhook") == "owed":
                send_webhook(services, workspace, batch_id, batch)
            else:
                store.settled(workspace, batch_id)
    return acted
