"""The catalog file's provider credentials: which environment variables
each provider's credential is read from. Read here, below the settings, which
read those variables at the edge (``Settings.provider_credentials``) without
loading the models (``catalog.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class CatalogError(ValueError):
    """The catalog file is malformed; the message names the entry."""


#: The kinds of provider credential a worker knows how to hand an adapter.
CREDENTIAL_KINDS = ("api_key", "google")


@dataclass(frozen=True)
class ProviderCredentials:
    """Where a provider's credential comes from. The catalog names only
    environment variables; their values are read once, at the edge, with the
    rest of the settings (``Settings.provider_credentials``).

    ``api_key``: the key is the value of ``env``. ``google``: an OAuth access
    token from google-auth; ``env``, when set, holds a ready token instead;
    ``file_env`` may name a variable holding a service-account key file's path;
    with neither, Application Default Credentials. ``docs/ARCHITECTURE.md``,
    "The broker and the workers".
    """

    kind: str
    env: str = ""
    file_env: str = ""

    @property
    def variables(self) -> tuple[str, ...]:
        """The environment variables this credential may be read from."""
        return tuple(name for name in (self.env, self.file_env) if name)

    @classmethod
    def parse(cls, provider: str, spec: Any) -> "ProviderCredentials":
        if not isinstance(spec, dict) or set(spec) - {"kind", "env", "file_env"}:
            raise CatalogError(f"provider {provider!r}: credentials must be an object with kind, env, file_env; "
                               f"got {spec!r}")
        credentials = cls(kind=spec.get("kind", ""), env=spec.get("env", ""), file_env=spec.get("file_env", ""))
        if credentials.kind not in CREDENTIAL_KINDS:
            raise CatalogError(f"provider {provider!r}: credentials kind must be one of {CREDENTIAL_KINDS}, "
                               f"got {credentials.kind!r}")
        if credentials.kind == "api_key" and (not credentials.env or credentials.file_env):
            raise CatalogError(f"provider {provider!r}: an api_key credential names its variable in env alone")
        if not all(isinstance(name, str) for name in credentials.variables):
            raise CatalogError(f"provider {provider!r}: credential variables must be names, got {spec!r}")
        return credentials
