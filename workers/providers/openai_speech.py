"""OpenAI text to speech: ``POST /v1/audio/speech`` answers raw audio bytes.

The output is the audio itself (``audio/mpeg`` for mp3), stored and served
back byte for byte under the provider's ``Content-Type``. The model id names
the upstream model, so a body that omits ``model`` gets it filled in.
"""

from __future__ import annotations

import json

from router_queue import states

from .base import ProviderCall, ProviderFailure, ProviderOutput, before_calling, output_of, send, unexpected


def _upstream_body(call: ProviderCall) -> bytes:
    body = json.loads(call.body)
    if "model" in body or not call.entry.upstream_model:
        return call.body
    return json.dumps({"model": call.entry.upstream_model, **body}).encode()


def run(call: ProviderCall) -> ProviderOutput:
    before_calling(call)
    response = send(
        call, "POST", call.url, data=_upstream_body(call),
        headers={"Authorization": f"Bearer {call.api_key}", "Content-Type": "application/json",
                 **({"OpenAI-Organization": call.organization} if call.organization else {})},
    )
    if response.status_code == 200:
        return output_of(response)
    if response.status_code == 400:
        error = _error(response)
        if error.get("code") == "content_policy_violation":
            raise ProviderFailure(states.CONTENT_POLICY_VIOLATION, error.get("message") or "refused on content policy")
        raise ProviderFailure(states.INVALID_INPUT, f"openai rejected the input: {error.get('message')}")
    raise unexpected(call, response)


def _error(response) -> dict:
    try:
        error = response.json().get("error")
    except ValueError:
        return {"message": response.text[:300]}
    return error if isinstance(error, dict) else {"message": str(error)}
