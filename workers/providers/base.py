"""What every provider adapter shares: the call it is handed, what it returns,
and how HTTP failures become the contract's buckets.

An adapter speaks one provider's real wire format. Given the provider's real
URL and key it talks to the provider; given the stub's origin (settings'
``PROVIDER_ORIGIN_OVERRIDE``) it talks to the stub, unchanged.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import requests

from router_queue import states
from router_queue.catalog import ModelEntry
from router_queue.settings import Settings

from .hosts import ProviderHosts


@dataclass(frozen=True)
class ProviderCall:
    """One generation to run: the model, the caller's body, where and how."""

    entry: ModelEntry
    #: The caller's native JSON body, exactly as admitted.
    body: bytes
    url: str
    #: The provider's credential, asked for at each use (workers/credentials.py).
    credential: Callable[[], str]
    session: requests.Session
    #: What should stop the run between two steps: "cancel" (the caller
    #: asked), "shutdown" (this worker is stopping), or None.
    interruption: Callable[[], str | None]
    #: The provider's handle on a generation an earlier delivery submitted
    #: (its worker died or handed it back): resume it, do not resubmit.
    upstream_ref: dict[str, Any] | None = None
    #: Keeps the provider's handle on a submitted generation in the record.
    remember: Callable[[dict[str, Any]], None] = lambda ref: None
    #: Told how far the generation is, 0..1, when the provider says (best effort).
    progressed: Callable[[float], None] = lambda progress: None
    #: When the request started running (Unix s), across deliveries.
    started_at: float = 0.0
    #: Told how long each HTTP exchange with the provider took (metrics).
    timed: Callable[[float], None] = lambda seconds: None
    #: Where calls may go (``PROVIDER_HOSTS``, the override's origin).
    hosts: ProviderHosts = ProviderHosts(Settings().provider_hosts)
    #: OpenAI: the organisation the pool's member bills to ("" for the key's default).
    organization: str = ""

    @property
    def api_key(self) -> str:
        """The credential to send now: an API key, or an access token that is
        refreshed before it expires. A ``ProviderFailure`` when there is none,
        raised inside the adapter so the call policy handles it."""
        return self.credential()

    @property
    def timeout(self) -> tuple[float, float]:
        return (self.entry.policy.connect_timeout_s, self.entry.policy.read_timeout_s)


@dataclass(frozen=True)
class ProviderOutput:
    """The provider's answer, byte for byte, under its own Content-Type."""

    content: bytes
    content_type: str


class ProviderFailure(Exception):
    """An answer that is not an output; ``error_type`` is the bucket it ends in.

    ``retryable`` failures (connection errors, timeouts, 5xx, 429) are tried
    again under the model's call policy and end in their bucket only once the
    attempts are spent; the others are final at once.
    """

    def __init__(self, error_type: str, detail: str, *, billable: bool = False, retryable: bool = False,
                 retry_after_s: float | None = None, http_status: int | None = None):
        super().__init__(detail)
        #: The provider's HTTP status, when it answered one: a 429 pauses the
        #: member that answered it, a 401 or 403 takes it out (``workers/members.py``).
        self.http_status = http_status
        self.error_type = error_type
        self.detail = detail
        #: Whether the provider charges us for this outcome.
        self.billable = billable
        self.retryable = retryable
        #: The provider's own pace (a 429's Retry-After), in seconds.
        self.retry_after_s = retry_after_s


class HandBack(Exception):
    """This worker is shutting down: give the request to another one to resume."""


def send(call: ProviderCall, method: str, url: str, **kwargs) -> requests.Response:
    """One HTTP exchange; transport failures become retryable provider failures.

    Only to an allowed host (``call.hosts``), and never following a redirect:
    requests would carry our ``x-key`` header along to wherever a 3xx points
    (it drops only ``Authorization`` on a change of host). A 3xx is answered
    to the adapter like any other status, so it ends as a provider error."""
    refused = call.hosts.refusal(url)
    if refused is not None:
        raise ProviderFailure(states.PROVIDER_ERROR, f"refused to call {call.entry.provider}: {refused}")
    started = time.monotonic()
    try:
        return call.session.request(method, url, timeout=call.timeout, allow_redirects=False, **kwargs)
    except requests.Timeout as exc:
        raise ProviderFailure(states.PROVIDER_TIMEOUT, f"{call.entry.provider} did not answer in time: {exc}",
                              retryable=True) from exc
    except requests.RequestException as exc:
        raise ProviderFailure(states.PROVIDER_ERROR, f"could not reach {call.entry.provider}: {exc}",
                              retryable=True) from exc
    finally:
        call.timed(time.monotonic() - started)


def _retry_after(response: requests.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


def unexpected(call: ProviderCall, response: requests.Response) -> ProviderFailure:
    """A failure for an answer the adapter has no better reading of.

    429 and 5xx are worth another attempt (a 429 at the provider's own pace);
    any other status is final, a redirect (never followed) among them.
    """
    if response.is_redirect:
        where = urlsplit(response.headers.get("Location", "")).hostname or "nowhere"
        return ProviderFailure(states.PROVIDER_ERROR, f"{call.entry.provider} answered HTTP {response.status_code}, "
                                                      f"a redirect to {where}, which is not followed")
    excerpt = response.text[:300].replace("\n", " ")
    detail = f"{call.entry.provider} answered HTTP {response.status_code}: {excerpt}"
    if response.status_code == 429:
        return ProviderFailure(states.PROVIDER_ERROR, detail, retryable=True, retry_after_s=_retry_after(response),
                               http_status=429)
    return ProviderFailure(states.PROVIDER_ERROR, detail, retryable=response.status_code >= 500,
                           http_status=response.status_code)


def cancelled() -> ProviderFailure:
    return ProviderFailure(states.CANCELLED, "cancelled by the caller while running")


def output_of(response: requests.Response) -> ProviderOutput:
    return ProviderOutput(response.content, response.headers.get("Content-Type", "application/octet-stream"))


def before_calling(call: ProviderCall) -> None:
    """The check a synchronous adapter makes before it sends anything."""
    stop = call.interruption()
    if stop == "cancel":
        raise cancelled()
    if stop == "shutdown":
        raise HandBack()


def json_or_empty(response: requests.Response) -> dict[str, Any]:
    try:
        payload = response.json()
    except (ValueError, json.JSONDecodeError):
        return {}
    return payload if isinstance(payload, dict) else {}
