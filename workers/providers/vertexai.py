"""Vertex AI Gemini: one synchronous ``generateContent`` call.

The answer is the native ``GenerateContentResponse``; an image arrives as
``candidates[0].content.parts[0].inlineData``. A safety block is a 200 with
``promptFeedback.blockReason`` or a safety ``finishReason``: a refusal.
"""

from __future__ import annotations

from router_queue import states

from .base import ProviderCall, ProviderFailure, ProviderOutput, before_calling, output_of, send, unexpected

_SAFETY_FINISH = {"SAFETY", "IMAGE_SAFETY", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII", "RECITATION"}


def run(call: ProviderCall) -> ProviderOutput:
    before_calling(call)
    response = send(
        call, "POST", call.url, data=call.body,
        headers={"Authorization": f"Bearer {call.api_key}", "Content-Type": "application/json"},
    )
    if response.status_code == 200:
        payload = response.json()
        feedback = payload.get("promptFeedback") or {}
        candidates = payload.get("candidates") or []
        if feedback.get("blockReason"):
            raise ProviderFailure(
                states.CONTENT_POLICY_VIOLATION,
                f"the model blocked the prompt: {feedback.get('blockReason')}",
                billable=call.entry.charges_on_policy_rejection,
            )
        if not candidates or candidates[0].get("finishReason") in _SAFETY_FINISH:
            reason = candidates[0].get("finishReason") if candidates else "no candidates"
            raise ProviderFailure(
                states.CONTENT_POLICY_VIOLATION,
                f"the model refused to generate: {reason}",
                billable=call.entry.charges_on_policy_rejection,
            )
        return output_of(response)
    if response.status_code == 400:
        message = _error_message(response)
        raise ProviderFailure(states.INVALID_INPUT, f"vertexai rejected the input: {message}")
    raise unexpected(call, response)


def _error_message(response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
