"""``X-Comfy-Fallback-Models``: the models a caller accepts in place of the
one in the path, checked at submit so that nothing is admitted that a
fallback could not honour.

Each must be a catalog model of the same input schema (it takes the same
body), on the same provider (its pool and fair queue: a fallback keeps the
request's place and slot), and not the path's model itself; at most
:data:`MAX_FALLBACK_MODELS`. Prices may differ: the hold is the dearest
model's (:func:`held_price`), the charge the price of the model that ran.
A submit without the header pays one lookup. ``docs/API.md``, ``docs/POOLS.md``.
"""

from __future__ import annotations

from ..catalog import Catalog, ModelEntry
from ..errors import InvalidInput

FALLBACK_HEADER = "X-Comfy-Fallback-Models"
#: Most models one request may name.
MAX_FALLBACK_MODELS = 3


def fallback_models(raw: str | None, entry: ModelEntry, catalog: Catalog) -> str:
    """The header's models, checked, comma-separated in the caller's order; "" without it."""
    if raw is None:
        return ""
    names = [name.strip() for name in raw.split(",")]
    if not all(names):
        raise InvalidInput(f"{FALLBACK_HEADER} must list provider/model ids separated by commas, not {raw[:80]!r}")
    if len(names) > MAX_FALLBACK_MODELS:
        raise InvalidInput(f"{FALLBACK_HEADER} may name at most {MAX_FALLBACK_MODELS} models, not {len(names)}")
    if len(set(names)) != len(names):
        raise InvalidInput(f"{FALLBACK_HEADER} names a model twice: {raw[:80]!r}")
    for name in names:
        _check(name, entry, catalog)
    return ",".join(names)


def held_price(entry: ModelEntry, fallback: str, catalog: Catalog) -> tuple[int, int | None]:
    """(credits to hold, the path model's price when it is less): the hold
    covers the dearest model the request may run on (``fallback``, checked)."""
    prices = [catalog.by_id(name).price_credits for name in fallback.split(",") if name]  # type: ignore[union-attr]
    hold = max([entry.price_credits, *prices])
    return hold, entry.price_credits if hold != entry.price_credits else None


def _check(name: str, entry: ModelEntry, catalog: Catalog) -> None:
    other = catalog.by_id(name)
    if other is None:
        close = catalog.suggest(name)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise InvalidInput(f"{FALLBACK_HEADER}: no model {name[:80]!r} in the catalog{hint}")
    if other.id == entry.id:
        raise InvalidInput(f"{FALLBACK_HEADER}: {name} is the model this request is for; name others")
    if other.input_schema is not entry.input_schema:
        raise InvalidInput(f"{FALLBACK_HEADER}: {name} takes {other.input_schema.__name__}, not "
                           f"{entry.input_schema.__name__} as {entry.id} does; a fallback takes the same body")
    if other.provider != entry.provider:
        raise InvalidInput(f"{FALLBACK_HEADER}: {name} runs on provider {other.provider}, not {entry.provider}; "
                           "a fallback runs on the same provider's pool")
    if not other.queueable:
        raise InvalidInput(f"{FALLBACK_HEADER}: {name} cannot be queued")
