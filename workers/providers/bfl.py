"""Black Forest Labs: submit, then poll the ``polling_url`` until ``Ready``.

Submit answers ``{"id", "polling_url"}``; the poll answers ``{"status": ...}``
with ``Ready`` carrying ``result.sample``. The final poll body is the native
output the caller collects, byte for byte.
"""

from __future__ import annotations

import time

from router_queue import states

from .base import ProviderCall, ProviderFailure, ProviderOutput, output_of, send, sleep_unless_cancelled, unexpected

#: Poll answers that mean "not finished yet".
_RUNNING = {"Pending", "Queued", "Processing"}
#: Poll answers that are a moderation refusal.
_MODERATED = {"Request Moderated", "Content Moderated"}


def _submit(call: ProviderCall) -> str:
    response = send(
        call, "POST", call.url, data=call.body,
        headers={"x-key": call.api_key, "Content-Type": "application/json", "Accept": "application/json"},
    )
    if response.status_code == 200:
        polling_url = response.json().get("polling_url")
        if not polling_url:
            raise ProviderFailure(states.PROVIDER_ERROR, "bfl accepted the request but named no polling_url")
        return polling_url
    if response.status_code in (400, 422):
        raise ProviderFailure(states.INVALID_INPUT, f"bfl rejected the input: {response.text[:500]}")
    raise unexpected(call, response)


def run(call: ProviderCall) -> ProviderOutput:
    polling_url = _submit(call)
    deadline = time.monotonic() + call.entry.policy.max_run_s
    while True:
        response = send(call, "GET", polling_url, headers={"x-key": call.api_key, "Accept": "application/json"})
        if response.status_code != 200:
            raise unexpected(call, response)
        status = response.json().get("status")
        if status == "Ready":
            return output_of(response)
        if status in _MODERATED:
            raise ProviderFailure(states.CONTENT_POLICY_VIOLATION, f"bfl refused the request: {status}")
        if status not in _RUNNING:
            raise ProviderFailure(states.PROVIDER_ERROR, f"bfl ended the generation with status {status!r}")
        if time.monotonic() > deadline:
            raise ProviderFailure(states.PROVIDER_TIMEOUT, f"bfl did not finish within {call.entry.policy.max_run_s:.0f} s")
        sleep_unless_cancelled(call, call.entry.policy.poll_interval_s)
