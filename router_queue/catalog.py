"""The model catalog: which models exist, how to call them, what they cost.

Loaded once from a JSON data file (``catalog.json`` by default). Each entry
names its adapter, its upstream URL, its input schema (a class in
``schemas.py``), its price, whether it can be queued, and its call policy.
A model's provider is the first part of its id and holds the account (its
Celery queue and its pool: ``members``, each a cap and credential, or its own
``max_in_flight`` and ``credentials``, ``provider_pools.py``); the adapter is
named apart, so a second queue is another provider entry using the same
adapter (``bfl-eu/flux-2-pro``). ``docs/ARCHITECTURE.md``, "The front door's parts".
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from marshmallow import Schema

from .provider_credentials import CREDENTIAL_KINDS, CatalogError, ProviderCredentials  # noqa: F401
from .provider_pools import DEFAULT_MAX_IN_FLIGHT, Member, credential_variables, pools_of
from .schemas import SCHEMAS


@dataclass(frozen=True)
class CallPolicy:
    """How a worker calls the provider. Seconds throughout."""

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    #: Provider calls tried before a retryable failure (connection error, 5xx,
    #: 429, timeout) becomes final.
    max_attempts: int = 3
    #: Backoff between attempts: base * 2**(attempt-1), capped, with jitter;
    #: a 429's own Retry-After wins when it is longer.
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    #: First pause between two polls of a submit-then-poll provider; each
    #: further pause grows 1.5x up to ``poll_interval_max_s``.
    poll_interval_s: float = 1.0
    poll_interval_max_s: float = 5.0
    #: Longest a generation may run before it is given up as provider_timeout.
    max_run_s: float = 1800.0
    #: Longest a request may wait IN_QUEUE before it ends queue_timeout.
    queue_timeout_s: float = 86_400.0

    @property
    def hung_after_s(self) -> float:
        """Past this, one execution of a delivery is hung, not slow: the run's
        own bound plus one more exchange and backoff of slack. Its worker stops
        renewing its lease (``workers/leases.py``), the Celery time limit that
        the threads pool cannot enforce."""
        return self.max_run_s + self.connect_timeout_s + self.read_timeout_s + self.backoff_max_s


_SCHEMA_INSTANCES: dict[type[Schema], Schema] = {}


@dataclass(frozen=True)
class ModelEntry:
    id: str
    provider: str
    model: str
    adapter: str
    upstream_url: str
    input_schema: type[Schema]
    #: Describes the native output in the OpenAPI documents; None for raw bytes.
    output_schema: type[Schema] | None
    #: The Content-Types the provider answers with (the first is its default).
    output_media_types: tuple[str, ...]
    price_credits: int
    queueable: bool
    policy: CallPolicy
    #: Billing facts a caller may read before running (never the price):
    #: ``charges_on_policy_rejection``. Served as-is by ``GET /v2/models``.
    billing: dict[str, Any] = field(default_factory=dict)
    upstream_model: str = ""

    @property
    def charges_on_policy_rejection(self) -> bool:
        """Whether the provider bills a content-policy refusal (so we charge it)."""
        return bool(self.billing.get("charges_on_policy_rejection", False))

    def schema(self) -> Schema:
        """The model's input schema. One instance per model, built on first use:
        building a marshmallow schema deep-copies its fields, and validating does
        not change the instance."""
        schema = _SCHEMA_INSTANCES.get(self.input_schema)
        if schema is None:
            schema = _SCHEMA_INSTANCES[self.input_schema] = self.input_schema()
        return schema

    def upstream(self, origin_override: str = "", member: Member | None = None) -> str:
        """The upstream URL, sent to ``member``'s project and location when it
        names them, with its origin replaced when an override is set."""
        upstream = self.upstream_url if member is None else member.upstream(self.upstream_url)
        if not origin_override:
            return upstream
        base = urlsplit(origin_override)
        url = urlsplit(upstream)
        return urlunsplit((base.scheme, base.netloc, url.path, url.query, ""))


class Catalog:
    def __init__(self, entries: dict[str, ModelEntry], pools: dict[str, tuple[Member, ...]] | None = None):
        self._entries = entries
        #: Each provider's members (``provider_pools.py``); one named the catalog did not list is one default member.
        self._pools = pools or {}

    @classmethod
    def load(cls, path: str | Path) -> "Catalog":
        raw = json.loads(Path(path).read_text())
        entries = {}
        for model_id, spec in raw["models"].items():
            provider, _, model = model_id.partition("/")
            try:
                entries[model_id] = ModelEntry(
                    id=model_id,
                    provider=provider,
                    model=model,
                    adapter=spec["adapter"],
                    upstream_url=spec["upstream_url"],
                    input_schema=SCHEMAS[spec["input_schema"]],
                    output_schema=SCHEMAS[spec["output_schema"]] if spec.get("output_schema") else None,
                    output_media_types=tuple(spec.get("output_media_types", ["application/json"])),
                    price_credits=int(spec["price_credits"]),
                    queueable=bool(spec.get("queueable", True)),
                    policy=CallPolicy(**spec.get("policy", {})),
                    billing=dict(spec.get("billing", {})),
                    upstream_model=spec.get("upstream_model", ""),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise CatalogError(f"catalog entry {model_id!r}: {exc!r}") from exc
        return cls(entries, pools_of(raw))

    @staticmethod
    def credential_variables(path: str | Path) -> list[str]:
        """Every environment variable the catalog's providers name for their
        credentials: what settings read at the edge, without loading models."""
        return credential_variables(path)

    def get(self, provider: str, model: str) -> ModelEntry | None:
        return self._entries.get(f"{provider}/{model}")

    def by_id(self, model_id: str) -> ModelEntry | None:
        return self._entries.get(model_id)

    def ids(self) -> list[str]:
        """Every model id, sorted: the order the catalog route pages in."""
        return sorted(self._entries)

    def suggest(self, model_id: str, limit: int = 3) -> list[str]:
        """Up to ``limit`` catalog ids close to ``model_id``, best first."""
        return difflib.get_close_matches(model_id, self._entries, n=limit, cutoff=0.5)

    def max_in_flight(self, provider: str) -> int:
        """How many generations the provider allows us in flight, fleet-wide:
        its members' caps summed."""
        return sum(member.max_in_flight for member in self.members(provider))

    def members(self, provider: str) -> tuple[Member, ...]:
        """Where ``provider``'s generations may go (``provider_pools.py``)."""
        return self._pools.get(provider) or (Member("default", DEFAULT_MAX_IN_FLIGHT, None),)

    def credentials(self, provider: str) -> ProviderCredentials | None:
        """Where ``provider``'s default (first) member's credential comes from; None when the catalog names none."""
        return self.members(provider)[0].credentials

    def providers(self) -> list[str]:
        return sorted({entry.provider for entry in self._entries.values()})

    def __iter__(self):
        return iter(self._entries.values())
