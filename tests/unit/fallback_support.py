"""What the fallback and region pin unit tests share: Vertex AI request
bodies, and deliveries run as Celery would with the pool's and the
fallback's clocks moved on by each retry's countdown."""

from __future__ import annotations

from tests.unit.delivery_support import execution
from tests.unit.support import context_of
from workers.delivery import Later, deliver

NEW, OLD = "vertexai/gemini-3.1-flash-image", "vertexai/gemini-2.5-flash-image"


def gemini(text: str) -> dict:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}]}


def deliver_for(services, request_id, seconds=10_000.0):
    """Deliver as Celery would, moving the pool's and the fallback's clocks on
    by each retry's countdown; stops (None) once ``seconds`` have passed so."""
    context, retries, passed = context_of(services), 0, [0.0]
    clocks = (services.members, services.model_fallback)
    real = [c.clock for c in clocks]
    for c, clock in zip(clocks, real):
        c.clock = lambda clock=clock: clock() + passed[0]
    try:
        while passed[0] < seconds:
            try:
                return deliver(context, request_id, execution("task-1", retries))
            except Later as later:
                retries += 1
                passed[0] += max(later.countdown, 0.01)
        return None
    finally:
        for c, clock in zip(clocks, real):
            c.clock = clock
