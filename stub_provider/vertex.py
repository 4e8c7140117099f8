"""Vertex AI Gemini wire format: one synchronous generateContent call.

The answer carries one candidate with an inline base64 PNG, the way the
Gemini image models return images (`[stub:size=BYTES]` pads it to BYTES, so
the answer is about 4/3 of that, as a real 1K image's is); `refuse` answers 200 with only
promptFeedback (no candidates), which is how Gemini blocks a prompt.
"""

from __future__ import annotations

import base64

from flask import Blueprint, Response

from . import directives
from .outputs import VERTEX_IMAGE_TOKENS, prompt_tokens, response_id, sized_png
from .wire import bearer_token, json_response, read_body, retry_after_headers, state

bp = Blueprint("vertex", __name__)

# google.rpc.Code names for the HTTP statuses a fault may carry.
_GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "NOT_IMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_MESSAGES = {
    429: "Resource exhausted. Please try again later.",
    500: "Internal error encountered.",
    503: "The service is currently unavailable.",
}


def _error(code: int, message: str | None = None, headers: dict[str, str] | None = None) -> Response:
    status = _GOOGLE_STATUS.get(code, "FAILED_PRECONDITION" if code < 500 else "UNKNOWN")
    message = message or _MESSAGES.get(code, f"stub injected error {code}")
    return json_response({"error": {"code": code, "message": message, "status": status}}, code, headers)


def _input_text(body: dict) -> str:
    """All `text` parts of all contents, concatenated in order."""
    texts = []
    for content in body.get("contents") or []:
        parts = content.get("parts") if isinstance(content, dict) else None
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return "".join(texts)


@bp.post("/v1/projects/<project>/locations/<location>/publishers/google/models/<model_action>")
def generate(project: str, location: str, model_action: str) -> Response:
    body, body_digest = read_body()
    st = state()
    st.record("vertex_generate", body_digest)
    model, _, action = model_action.rpartition(":")
    if not model or action != "generateContent":
        return _error(404, f"Method not found: {model_action}")
    if bearer_token() is None:
        return _error(401, "Request is missing required authentication credential.")
    if not isinstance(body, dict):
        return _error(400, "Invalid JSON payload received.")
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        return _error(400, "Unable to submit request because it has an empty contents field.")

    text = _input_text(body)
    wanted = directives.parse(text)
    st.record_key("vertex_generate", location)  # a Vertex AI pool's members are its locations
    st.record_key("vertex_model", model)
    fault = (directives.key_fault(wanted, location) or directives.model_fault(wanted, model)
             or directives.decide_fault(wanted, st.next_attempt("vertex_generate", body_digest)))
    if fault is not None:
        return _error(fault.status, headers=retry_after_headers(fault.retry_after))
    if wanted.reject:
        return _error(400, "stub rejected the input")
    if wanted.hang is not None:
        st.sleep(wanted.hang)
    if wanted.latency:
        st.sleep(wanted.latency)

    tokens = prompt_tokens(text)
    if wanted.refuse:
        return json_response(
            {
                "promptFeedback": {"blockReason": "SAFETY", "blockReasonMessage": "stub refusal"},
                "usageMetadata": {"promptTokenCount": tokens, "totalTokenCount": tokens},
                "modelVersion": model,
                "responseId": response_id(body_digest),
            }
        )
    image = base64.b64encode(sized_png(body_digest, wanted.size)).decode("ascii")
    return json_response(
        {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"inlineData": {"mimeType": "image/png", "data": image}}]},
                    "finishReason": "STOP",
                    "index": 0,
                }
            ],
            "usageMetadata": {
                "promptTokenCount": tokens,
                "candidatesTokenCount": VERTEX_IMAGE_TOKENS,
                "totalTokenCount": tokens + VERTEX_IMAGE_TOKENS,
            },
            "modelVersion": model,
            "responseId": response_id(body_digest),
        }
    )
