"""Black Forest Labs: submit, then poll the ``polling_url`` until ``Ready``.

Submit answers ``{"id", "polling_url"}``; the poll answers ``{"status": ...}``
with ``Ready`` carrying ``result.sample``. The final poll body is the native
output the caller collects, byte for byte. The handle is saved in the record
the moment BFL answers, so a delivery that takes over resumes polling instead
of paying twice. The ``polling_url`` is pinned to BFL's own site
(``hosts.same_site``) as well as to ``PROVIDER_HOSTS``, so a submit answer
cannot send our key elsewhere. ``docs/ARCHITECTURE.md``, "The broker and the
workers".
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from router_queue import states

from .base import (
    HandBack,
    ProviderCall,
    ProviderFailure,
    ProviderOutput,
    cancelled,
    json_or_empty,
    output_of,
    send,
    unexpected,
)
from .hosts import same_site

#: Poll answers that mean "not finished yet".
_RUNNING = {"Pending", "Queued", "Processing"}
#: Poll answers that are a moderation refusal.
_MODERATED = {"Request Moderated", "Content Moderated"}
#: Growth of the pause between two polls, up to the policy's maximum.
_POLL_GROWTH = 1.5


def _headers(call: ProviderCall) -> dict[str, str]:
    return {"x-key": call.api_key, "Accept": "application/json"}


def _submit(call: ProviderCall) -> dict[str, Any]:
    response = send(call, "POST", call.url, data=call.body,
                    headers={**_headers(call), "Content-Type": "application/json"})
    if response.status_code == 200:
        payload = json_or_empty(response)
        if not payload.get("polling_url") or not payload.get("id"):
            raise ProviderFailure(states.PROVIDER_ERROR, "bfl accepted the request but named no id/polling_url")
        ref = {"id": payload["id"], "polling_url": payload["polling_url"]}
        _check_polling_url(call, ref)
        call.remember(ref)
        return ref
    if response.status_code in (400, 422):
        raise ProviderFailure(states.INVALID_INPUT, f"bfl rejected the input: {response.text[:500]}")
    raise unexpected(call, response)


def _check_polling_url(call: ProviderCall, ref: dict[str, Any]) -> None:
    """BFL's handle must point at BFL: its site, and an allowed host."""
    url = str(ref["polling_url"])
    if not same_site(call.url, url):
        raise ProviderFailure(states.PROVIDER_ERROR, f"bfl named a polling_url outside its own site "
                                                     f"({urlsplit(url).hostname or url[:100]!r}); not called")
    refused = call.hosts.refusal(url)
    if refused is not None:
        raise ProviderFailure(states.PROVIDER_ERROR, f"bfl named a polling_url we may not call: {refused}")


def _cancel_upstream(call: ProviderCall, ref: dict[str, Any]) -> bool:
    """Ask BFL to stop the generation; True when it did.

    BFL publishes no cancel endpoint; the stub provider has ``POST /v1/cancel``
    on the same origin. Any answer but 200 (404 where none exists, 409 where the
    generation already finished) means the generation runs on and its real
    outcome is what the caller gets.
    """
    parts = urlsplit(call.url)
    url = urlunsplit((parts.scheme, parts.netloc, "/v1/cancel", f"id={ref['id']}", ""))
    try:
        response = send(call, "POST", url, headers=_headers(call))
    except ProviderFailure:
        return False
    return response.status_code == 200


def run(call: ProviderCall) -> ProviderOutput:
    if call.upstream_ref and call.upstream_ref.get("polling_url"):
        ref = call.upstream_ref
        _check_polling_url(call, ref)  # kept by an earlier delivery, perhaps before this check existed
    else:
        ref = _submit(call)
    policy = call.entry.policy
    deadline = (call.started_at or time.time()) + policy.max_run_s
    interval = policy.poll_interval_s
    cancel_tried = False
    while True:
        response = send(call, "GET", ref["polling_url"], headers=_headers(call))
        if response.status_code != 200:
            raise unexpected(call, response)
        payload = json_or_empty(response)
        status = payload.get("status")
        if status == "Ready":
            return output_of(response)
        if status in _MODERATED:
            raise ProviderFailure(states.CONTENT_POLICY_VIOLATION, f"bfl refused the request: {status}",
                                  billable=call.entry.charges_on_policy_rejection)
        if status not in _RUNNING:
            if cancel_tried:
                raise cancelled()
            raise ProviderFailure(states.PROVIDER_ERROR, f"bfl ended the generation with status {status!r}")
        progress = payload.get("progress")
        if isinstance(progress, (int, float)) and not isinstance(progress, bool) and 0 <= progress <= 1:
            call.progressed(float(progress))
        if time.time() > deadline:
            raise ProviderFailure(states.PROVIDER_TIMEOUT, f"bfl did not finish within {policy.max_run_s:.0f} s")
        stop = call.interruption()
        if stop == "shutdown":
            raise HandBack()
        if stop == "cancel" and not cancel_tried:
            cancel_tried = True
            if _cancel_upstream(call, ref):
                raise cancelled()
        time.sleep(interval)
        interval = min(interval * _POLL_GROWTH, policy.poll_interval_max_s)
