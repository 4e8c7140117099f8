"""Running one admitted request: claim it, call its provider, record the outcome.

Plain functions, no Celery here, so they are tested directly. Safe to run
twice for one request: the claim lets only the first delivery through.
"""

from __future__ import annotations

import logging
import time

import requests

from router_queue import states
from router_queue.services import Services

from .providers import ADAPTERS, ProviderCall, ProviderFailure

log = logging.getLogger(__name__)


def deliver(services: Services, session: requests.Session, request_id: str) -> str:
    """Run ``request_id`` if it is still waiting; returns what happened, for logs."""
    store = services.store
    record, body = store.load(request_id)
    if record is None:
        log.warning("request %s has no record (expired or never admitted); dropping", request_id)
        return "missing"
    claimed = store.claim(request_id, record.provider)
    if claimed != "CLAIMED":
        log.info("request %s already %s; duplicate delivery dropped", request_id, claimed)
        return claimed.lower()

    entry = services.catalog.by_id(record.model)
    if entry is None:
        store.complete(request_id, record.provider, error_type=states.INTERNAL_ERROR,
                       detail=f"model {record.model} left the catalog")
        return "internal_error"
    call = ProviderCall(
        entry=entry,
        body=body or b"{}",
        url=entry.upstream(services.settings.provider_origin_override),
        api_key=services.settings.provider_key(entry.provider),
        session=session,
        cancel_requested=lambda: store.cancel_requested(request_id),
    )
    started = time.monotonic()
    try:
        output = ADAPTERS[entry.adapter](call)
    except ProviderFailure as failure:
        store.complete(request_id, record.provider, error_type=failure.error_type, detail=failure.detail)
        log.info("request %s completed with %s after %.2f s", request_id, failure.error_type,
                 time.monotonic() - started)
        return failure.error_type
    except Exception:
        log.exception("request %s failed inside the worker", request_id)
        store.complete(request_id, record.provider, error_type=states.INTERNAL_ERROR,
                       detail="the worker failed while running the request")
        return "internal_error"
    store.complete(request_id, record.provider, output=output.content, content_type=output.content_type)
    log.info("request %s completed in %.2f s", request_id, time.monotonic() - started)
    return "completed"


def republish_unpublished(services: Services, dispatcher, *, now: float | None = None) -> int:
    """Publish requests admitted but never published (a crash between the two)."""
    cutoff = (now or time.time()) - services.settings.republish_after_s
    stranded = services.store.unpublished_before(cutoff)
    for request_id, provider in stranded:
        dispatcher.publish(request_id, provider)
    if stranded:
        log.warning("sweeper re-published %d stranded request(s)", len(stranded))
    return len(stranded)
