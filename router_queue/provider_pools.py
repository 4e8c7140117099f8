"""A provider's pool: the accounts and places its generations are sent to.

A provider in the catalog is one queue and one fair schedule; its
``members`` are where its generations go (a BFL key, an OpenAI key with its
organisation, a Vertex AI project and location), each with its own cap and
credential, named by environment variable. A provider that lists none is one
member, ``default``, made of its own cap and credential, so nothing changes
for it. Read here, below the settings, which read the members' credential
variables at the edge. ``docs/POOLS.md``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .provider_credentials import CatalogError, ProviderCredentials

#: The member a provider without ``members`` is made of.
DEFAULT_MEMBER = "default"
#: Generations in flight per provider when the catalog names no cap.
DEFAULT_MAX_IN_FLIGHT = 100
#: A member's name: short, and safe in a Redis hash field and a metric label.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MEMBER_KEYS = frozenset({"name", "max_in_flight", "credentials", "organization", "project", "location",
                          "region", "any_region"})
#: The part of a Vertex AI URL that names its project and location.
_VERTEX_PLACE = re.compile(r"/projects/[^/]+/locations/[^/]+/")


@dataclass(frozen=True)
class Member:
    """One place a provider's generations may be sent to."""

    name: str
    max_in_flight: int
    #: None: the provider's adapter runs without a credential of ours (none named).
    credentials: ProviderCredentials | None
    #: OpenAI: the organisation its calls bill to (``OpenAI-Organization``).
    organization: str = ""
    #: Vertex AI: the project and location its calls go to (the URL's).
    project: str = ""
    location: str = ""
    #: Where it runs ("" when it does not say); a Vertex location is its region.
    region: str = ""
    #: Serves a workspace pinned to any region (a member without one, marked so by the operator).
    any_region: bool = False

    def serves(self, regions: tuple[str, ...]) -> bool:
        """Whether it may run a workspace's generations pinned to ``regions`` (none: any workspace's)."""
        return not regions or self.any_region or self.region in regions

    def upstream(self, url: str) -> str:
        """``url`` (the model's) sent to this member's project and location,
        on that location's host; unchanged for a member that names none."""
        if not self.project or not self.location:
            return url
        parts = urlsplit(url)
        path = _VERTEX_PLACE.sub(f"/projects/{self.project}/locations/{self.location}/", parts.path, count=1)
        host = "aiplatform.googleapis.com"
        if self.location != "global":
            host = f"{self.location}-{host}"
        return urlunsplit((parts.scheme, host, path, parts.query, ""))


def _member(provider: str, spec: Any) -> Member:
    where = f"provider {provider!r}: member {spec.get('name') if isinstance(spec, dict) else spec!r}"
    if not isinstance(spec, dict) or set(spec) - _MEMBER_KEYS:
        raise CatalogError(f"{where}: a member is an object of {sorted(_MEMBER_KEYS)}; got {spec!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CatalogError(f"{where}: name must be 1 to 64 letters, digits, '_', '.' or '-'")
    cap = spec.get("max_in_flight")
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise CatalogError(f"{where}: max_in_flight must be a whole number of at least 1")
    texts = {field: spec.get(field, "") for field in ("organization", "project", "location", "region")}
    if not all(isinstance(value, str) for value in texts.values()):
        raise CatalogError(f"{where}: organization, project, location and region are strings")
    if bool(texts["project"]) != bool(texts["location"]):
        raise CatalogError(f"{where}: a Vertex AI member names its project and its location together")
    location = texts["location"]
    region = texts["region"] or ("" if location in ("", "global") else location)
    credentials = spec.get("credentials")
    return Member(name=name, max_in_flight=cap,
                  credentials=None if credentials is None else ProviderCredentials.parse(f"{provider}/{name}",
                                                                                         credentials),
                  organization=texts["organization"], project=texts["project"], location=location,
                  region=region, any_region=bool(spec.get("any_region", False)))


def members_of(provider: str, spec: dict[str, Any]) -> tuple[Member, ...]:
    """``provider``'s members as the catalog lists them, or its one default member."""
    listed = spec.get("members")
    if listed is None:
        credentials = spec.get("credentials")
        return (Member(DEFAULT_MEMBER, int(spec.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT)),
                       None if credentials is None else ProviderCredentials.parse(provider, credentials)),)
    if "max_in_flight" in spec or "credentials" in spec:
        raise CatalogError(f"provider {provider!r}: with members, its cap is theirs summed and each names its own "
                           "credentials; drop the provider's own max_in_flight and credentials")
    if not isinstance(listed, list) or not listed:
        raise CatalogError(f"provider {provider!r}: members must be a non-empty list")
    members = tuple(_member(provider, item) for item in listed)
    names = [member.name for member in members]
    if len(set(names)) != len(names):
        raise CatalogError(f"provider {provider!r}: member names must differ; got {names}")
    return members


def provider_specs(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    providers = raw.get("providers", {})
    if not isinstance(providers, dict) or not all(isinstance(spec, dict) for spec in providers.values()):
        raise CatalogError(f"providers must map each provider to an object, got {providers!r}")
    return providers


def pools_of(raw: dict[str, Any]) -> dict[str, tuple[Member, ...]]:
    """Each provider the catalog's ``providers`` names, with its members."""
    return {provider: members_of(provider, spec) for provider, spec in provider_specs(raw).items()}


def credential_variables(path: str | Path) -> list[str]:
    """Every environment variable the catalog at ``path``'s providers' members
    name for their credentials: what settings read at the edge."""
    pools = pools_of(json.loads(Path(path).read_text()))
    return sorted({name for members in pools.values() for member in members
                   if member.credentials is not None for name in member.credentials.variables})
