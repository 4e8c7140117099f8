"""The sweeper's part for the object store: an object lives as long as its record.

Each sweep deletes, per provider, the objects whose records have expired
(``store/objects.py`` says which), a batch at a time. Once an hour, one
sweeper lists the store's hour folders (``blobs/pointers.py``) and deletes
those entirely past retention plus a grace: objects whose pointer was never
recorded (a worker that died between the put and complete.lua) and anything
the index missed; and, in the body folders older than a grace, the body
objects no ``P:body:{id}`` points at (an admission refused or cut short
after its put; a body's life has no fixed bound, since retries extend it).
The bucket's lifecycle rule (``deploy/object-store/``) backs both up.
"""

from __future__ import annotations

import logging

from router_queue.blobs.pointers import BODIES, RESULTS, hour_of
from router_queue.blobs.store import BlobUnavailable
from router_queue.store.objects import ResultObjects

from .context import WorkerContext

log = logging.getLogger(__name__)

#: Objects of one provider deleted per sweep at most (the rest: next sweep).
OBJECTS_PER_SWEEP = 1000
#: Seconds between two passes over the store for orphans, fleet-wide.
ORPHAN_PASS_EVERY_S = 3600
#: Seconds past retention an hour folder must be before the orphan pass
#: deletes it: longer than a worker may take from its put to its completion.
ORPHAN_GRACE_S = 3600
#: Seconds an hour folder spans.
HOUR_S = 3600


def expire_objects(context: WorkerContext, now: float) -> tuple[int, int]:
    """(objects whose records expired, orphans) deleted this sweep."""
    services = context.services
    blobs = services.blobs
    if blobs is None:
        return 0, 0
    index = ResultObjects(services.redis)
    deleted = 0
    try:
        for provider in services.catalog.providers():
            due = index.due(provider, now, OBJECTS_PER_SWEEP)
            if due:
                blobs.delete([entry.key for entry in due])
                index.forget(provider, due)
                deleted += len(due)
        orphans = _delete_orphans(context, index, now)
    except BlobUnavailable as exc:  # kept in the index: the next sweep tries again
        log.warning("sweeper: the object store did not answer (%s); expired objects wait for the next sweep", exc)
        orphans = 0
    services.metrics.objects("deleted", deleted)
    services.metrics.objects("orphans_deleted", orphans)
    return deleted, orphans


def _delete_orphans(context: WorkerContext, index: ResultObjects, now: float) -> int:
    blobs = context.services.blobs
    assert blobs is not None
    if not index.take_orphan_pass(ORPHAN_PASS_EVERY_S):
        return 0
    cutoff = now - context.services.settings.result_retention_s - ORPHAN_GRACE_S
    orphans = 0
    for folder in blobs.folders(RESULTS):
        start = hour_of(folder)
        if start is None or start + HOUR_S > cutoff:
            continue
        stale = blobs.keys_under(folder)
        blobs.delete(stale)
        orphans += len(stale)
    for folder in blobs.folders(BODIES):
        start = hour_of(folder)
        if start is None or start + HOUR_S > now - ORPHAN_GRACE_S:
            continue
        unpointed = index.unpointed_bodies(blobs.keys_under(folder))
        blobs.delete(unpointed)
        orphans += len(unpointed)
    if orphans:
        log.warning("sweeper: %d object(s) past retention deleted by the hourly pass (orphans, or missed)", orphans)
    return orphans
