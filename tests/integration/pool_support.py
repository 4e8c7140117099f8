"""A provider pool as the pool and fallback tests build it (``test_pools.py``,
``test_model_fallback.py``): the shipped catalog with one provider's
``members`` given, and a stack of its own on that catalog. Plain code, no
fixtures; it builds on ``harness.py``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from tests.pool_catalogs import pool_catalog

from .harness import RunningStack, private_stack


@contextmanager
def pooled_stack(tmp_path_factory: Any, name: str, provider: str, members: list[dict[str, Any]], *,
                 prices: dict[str, int] | None = None, **settings: str) -> Iterator[RunningStack]:
    """A stack on a redis-server of its own whose catalog makes ``provider``
    a pool of ``members`` (:func:`pool_catalog`); ``settings`` go into its environment."""
    catalog = pool_catalog(tmp_path_factory.mktemp(name), provider, members, prices)
    with private_stack(tmp_path_factory, name, {"catalog": str(catalog), **settings}) as running:
        yield running
