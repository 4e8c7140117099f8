"""Pooled catalogs as the unit and integration tests build them (the pool,
fallback and region pin tests; ``tests/integration/pool_support.py`` starts
a stack on one): the shipped catalog with one provider's ``members`` given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from router_queue.settings import DEFAULT_CATALOG

#: The Vertex AI locations the tests' pools span.
LOCATIONS = ("us-central1", "europe-west4")


def vertex_members(max_in_flight: int = 4, locations: tuple[str, ...] = LOCATIONS) -> list[dict[str, Any]]:
    """Vertex AI members, one per location (named after it), of ``max_in_flight`` slots each."""
    return [{"name": loc, "max_in_flight": max_in_flight,
             "credentials": {"kind": "google", "env": "VERTEXAI_ACCESS_TOKEN"}, "project": "p", "location": loc}
            for loc in locations]


def pool_catalog(directory: Path, provider: str = "vertexai", members: list[dict[str, Any]] | None = None,
                 prices: dict[str, int] | None = None) -> Path:
    """The shipped catalog with ``provider`` a pool of ``members`` (None:
    as shipped) and the models in ``prices`` at those prices, written in
    ``directory`` under a name of its own (``Catalog.load`` reads it)."""
    raw = json.loads(DEFAULT_CATALOG.read_text())
    if members is not None:
        raw["providers"][provider] = {"members": members}
    for model, credits in (prices or {}).items():
        raw["models"][model]["price_credits"] = credits
    path = directory / f"catalog-{len(list(directory.iterdir()))}.json"
    path.write_text(json.dumps(raw))
    return path
