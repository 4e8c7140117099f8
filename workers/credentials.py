"""Each provider's current credential, where the catalog says it comes from.

The catalog names the kind and the environment variables
(``providers.<name>.credentials``); settings read them once at the edge. This
module turns the two into what an adapter sends: an API key as it is, or a
Vertex AI access token that google-auth fetches again before it expires. A
credential that cannot be had is a retryable ``provider_error`` for the
request and an error in the log naming the variable. ``docs/ARCHITECTURE.md``,
"The broker and the workers".
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Mapping

import google.auth
import google.auth.exceptions
import google.auth.transport.requests
import requests
from google.auth.credentials import TokenState
from google.oauth2 import service_account

from router_queue import states
from router_queue.catalog import Catalog, ProviderCredentials
from router_queue.settings import Secret

from .providers import ProviderFailure

log = logging.getLogger(__name__)

#: What a Vertex AI call needs of Google's OAuth scopes.
GOOGLE_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
#: Seconds a token request (or a metadata-server probe) may take; google-auth's
#: own default is 120, longer than a Vertex call would wait for its token.
TOKEN_TIMEOUT_S = 10.0


class Unavailable(Exception):
    """No credential for a provider. The message is for the log (it names the
    variable); ``detail`` is for the caller."""

    def __init__(self, provider: str, message: str):
        super().__init__(message)
        self.detail = f"the router has no usable credential for {provider}"


class ApiKey:
    """A key read once from the environment: rotating it means a restart."""

    def __init__(self, provider: str, variable: str, value: str):
        self.provider, self.variable, self._value = provider, variable, value

    def __call__(self) -> str:
        if not self._value:
            raise Unavailable(self.provider, f"{self.provider}: {self.variable} is not set")
        return self._value

    def check(self) -> None:
        self()


class _TokenRequests(google.auth.transport.requests.Request):
    """google-auth's HTTP transport with a timeout it will not wait past."""

    def __call__(self, url, method="GET", body=None, headers=None, timeout=TOKEN_TIMEOUT_S, **kwargs):
        return super().__call__(url, method=method, body=body, headers=headers,
                                timeout=min(timeout or TOKEN_TIMEOUT_S, TOKEN_TIMEOUT_S), **kwargs)


class GoogleToken:
    """A Google OAuth access token for Vertex AI, current at every call.

    A token in ``token_variable`` wins as it is; otherwise the service-account
    key file named by ``file_variable``, or Application Default Credentials,
    found on first use. A stale or missing token (google-auth: 3 min 45 s
    before expiry) is refreshed by one thread while the others wait (the
    credentials are not safe to refresh concurrently); a stale token whose
    refresh fails is still sent until it expires. ``docs/ARCHITECTURE.md``,
    "The broker and the workers".
    """

    def __init__(self, provider: str, *, token: str = "", token_variable: str = "", file: str = "",
                 file_variable: str = "", session: requests.Session | None = None):
        self.provider = provider
        self._token, self._token_variable = token, token_variable
        self._file, self._file_variable = file, file_variable
        self._request = _TokenRequests(session or _token_session())
        self._lock = threading.Lock()
        self._credentials: Any = None

    def __call__(self) -> str:
        if self._token:
            return self._token
        with self._lock:
            credentials = self._loaded()
            state = credentials.token_state
            if state is not TokenState.FRESH:
                try:
                    credentials.refresh(self._request)
                except google.auth.exceptions.GoogleAuthError as exc:
                    if state is not TokenState.STALE:
                        raise Unavailable(self.provider, f"{self.provider}: could not fetch an access token: {exc}") \
                            from exc
                    # Stale is not expired: the old token still serves while
                    # the next call tries the endpoint again.
                    log.warning("%s: could not refresh the Google access token (expires %s UTC); using it while it "
                                "lasts: %s", self.provider, credentials.expiry, exc)
                else:
                    log.info("%s: fetched a Google access token (expires %s UTC)", self.provider, credentials.expiry)
            return credentials.token

    def check(self) -> None:
        """Find the credentials (no token is fetched)."""
        if not self._token:
            with self._lock:
                self._loaded()

    def _loaded(self) -> Any:
        if self._credentials is None:
            try:
                if self._file:
                    # A service-account key only: google-auth's generic loader
                    # would also run whatever external command a file names.
                    self._credentials = service_account.Credentials.from_service_account_file(
                        self._file, scopes=GOOGLE_SCOPES)
                else:
                    self._credentials, _ = google.auth.default(scopes=GOOGLE_SCOPES, request=self._request)
            except (google.auth.exceptions.GoogleAuthError, ValueError, OSError) as exc:
                raise Unavailable(self.provider, f"{self.provider}: no Google credentials ({self._where()}): {exc}") \
                    from exc
        return self._credentials

    def _where(self) -> str:
        if self._file:
            return f"the file {self._file_variable} names"
        named = f"{self._token_variable} is not set; " if self._token_variable else ""
        return f"{named}Application Default Credentials"


def _token_session() -> requests.Session:
    """Token requests go out as the provider calls do, ignoring proxy settings
    from the environment (workers/context.py), on their own small pool."""
    session = requests.Session()
    session.trust_env = False
    return session


Source = Callable[[], str]


class Credentials:
    """Every provider's members' credential sources for one worker process,
    built from the catalog (``provider_pools.py``) and the settings' credential variables."""

    def __init__(self, catalog: Catalog, values: Mapping[str, Secret], *, session: requests.Session | None = None):
        self._sources: dict[tuple[str, str], ApiKey | GoogleToken] = {}
        #: Each provider's members, in the catalog's order.
        self._members: dict[str, tuple[str, ...]] = {}
        for provider in catalog.providers():
            members = catalog.members(provider)
            self._members[provider] = tuple(member.name for member in members)
            for member in members:
                if member.credentials is not None:
                    self._sources[provider, member.name] = _source(_label(provider, member.name),
                                                                   member.credentials, values, session)

    def current(self, provider: str, member: str = "") -> str:
        """``provider``'s (``member``'s; its first member's when none is named)
        credential now; a ``ProviderFailure`` when there is none."""
        member = member or self._members.get(provider, ("default",))[0]
        source = self._sources.get((provider, member))
        label = _label(provider, member)
        try:
            if source is None:
                raise Unavailable(label, f"{label}: the catalog names no credentials for it")
            return source()
        except Unavailable as missing:
            log.error("no credential: %s", missing, extra={"provider": provider, "member": member})
            raise ProviderFailure(states.PROVIDER_ERROR, missing.detail, retryable=True) from missing

    def for_provider(self, provider: str, member: str = "") -> Source:
        return lambda: self.current(provider, member)

    def problems(self, providers: Iterable[str]) -> list[str]:
        """Why any member of ``providers`` has no credential, one line each (for
        the log when a worker starts: it names what to set)."""
        found = []
        for provider in providers:
            for member in self._members.get(provider, ("default",)):
                source = self._sources.get((provider, member))
                label = _label(provider, member)
                try:
                    if source is None:
                        raise Unavailable(label, f"{label}: the catalog names no credentials for it")
                    source.check()
                except Unavailable as missing:
                    found.append(str(missing))
        return found


def _label(provider: str, member: str) -> str:
    """How the log names a member: the provider alone for its one default member."""
    return provider if member == "default" else f"{provider} (member {member})"


def _source(provider: str, spec: ProviderCredentials, values: Mapping[str, Secret],
            session: requests.Session | None) -> ApiKey | GoogleToken:
    value = lambda name: str(values.get(name, "")) if name else ""  # noqa: E731
    if spec.kind == "api_key":
        return ApiKey(provider, spec.env, value(spec.env))
    return GoogleToken(provider, token=value(spec.env), token_variable=spec.env,
                       file=value(spec.file_env), file_variable=spec.file_env, session=session)
