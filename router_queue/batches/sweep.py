"""The sweeper's pass over batches not yet settled (``workers/sweeper.py``):
each still draining has its drain published again (a drain that died, or
whose lines waited for room); each whose lines have all ended is finished;
each finished with its webhook owed has an attempt published. Safe to run
twice: the drain's lease, the finish's one step and the webhook's lease decide."""

from __future__ import annotations

from typing import Callable

from ..services import Services
from ..states import COMPLETED
from .finish import finish_if_done

#: Batches looked at per sweep at most (the oldest first).
BATCHES_PER_SWEEP = 100


def sweep_batches(services: Services, publish_drain: Callable[[str, str], None],
                  publish_webhook: Callable[[str, str], None]) -> int:
    """One pass; the number of batches acted on. A webhook owed is published
    to the webhooks worker, never sent here: a slow receiver holds no sweep."""
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
                publish_webhook(workspace, batch_id)
            else:
                store.settled(workspace, batch_id)
    return acted
