"""What every provider adapter shares: the call it is handed, what it returns,
and how HTTP failures become the contract's buckets.

An adapter speaks one provider's real wire format. Given the provider's real
URL and key it talks to the provider; given the stub's origin (settings'
``PROVIDER_ORIGIN_OVERRIDE``) it talks to the stub, unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import requests

from router_queue import states
from router_queue.catalog import ModelEntry


@dataclass(frozen=True)
class ProviderCall:
    """One generation to run: the model, the caller's body, where and how."""

    entry: ModelEntry
    #: The caller's native JSON body, exactly as admitted.
    body: bytes
    url: str
    api_key: str
    session: requests.Session
    #: True once the caller asked to cancel; checked between steps.
    cancel_requested: Callable[[], bool]

    @property
    def timeout(self) -> tuple[float, float]:
        return (self.entry.policy.connect_timeout_s, self.entry.policy.read_timeout_s)


@dataclass(frozen=True)
class ProviderOutput:
    """The provider's answer, byte for byte, under its own Content-Type."""

    content: bytes
    content_type: str


class ProviderFailure(Exception):
    """A final answer that is not an output; ``error_type`` is the bucket."""

    def __init__(self, error_type: str, detail: str, *, billable: bool = False):
        super().__init__(detail)
        self.error_type = error_type
        self.detail = detail
        #: Whether the provider charges us for this outcome (issue: billing).
        self.billable = billable


def send(call: ProviderCall, method: str, url: str, **kwargs) -> requests.Response:
    """One HTTP exchange; transport failures become provider buckets."""
    try:
        return call.session.request(method, url, timeout=call.timeout, **kwargs)
    except requests.Timeout as exc:
        raise ProviderFailure(states.PROVIDER_TIMEOUT, f"{call.entry.provider} did not answer in time: {exc}") from exc
    except requests.RequestException as exc:
        raise ProviderFailure(states.PROVIDER_ERROR, f"could not reach {call.entry.provider}: {exc}") from exc


def unexpected(call: ProviderCall, response: requests.Response) -> ProviderFailure:
    """A failure for an answer the adapter has no better reading of."""
    excerpt = response.text[:300].replace("\n", " ")
    return ProviderFailure(
        states.PROVIDER_ERROR, f"{call.entry.provider} answered HTTP {response.status_code}: {excerpt}"
    )


def cancelled() -> ProviderFailure:
    return ProviderFailure(states.CANCELLED, "cancelled by the caller while running")


def output_of(response: requests.Response) -> ProviderOutput:
    return ProviderOutput(response.content, response.headers.get("Content-Type", "application/octet-stream"))


def sleep_unless_cancelled(call: ProviderCall, seconds: float) -> None:
    """Wait ``seconds`` (the poll interval), raising at once if cancel is asked."""
    if call.cancel_requested():
        raise cancelled()
    time.sleep(seconds)
