"""Small helpers the unit tests share."""

from __future__ import annotations


def record_of(services, request_id: str, provider: str):
    """The request's record as a worker would hold it."""
    record = services.store.status_view(request_id, provider).record
    assert record is not None, f"no record for {request_id}"
    return record
