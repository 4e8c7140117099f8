"""OpenAI text-to-speech wire format: POST /v1/audio/speech answers raw audio bytes.

Unlike the JSON providers the success body is the file itself, so the
project's adapter must stream bytes, not parse JSON; errors are JSON in
OpenAI's `{"error": {...}}` envelope. `refuse` is a 400 with code
content_policy_violation, as OpenAI reports moderation blocks.
"""

from __future__ import annotations

from flask import Blueprint, Response

from . import directives
from .outputs import mp3_bytes, wav_bytes
from .wire import bearer_token, json_response, read_body, retry_after_headers, state

bp = Blueprint("openai_tts", __name__)

_MIMETYPES = {"mp3": "audio/mpeg", "wav": "audio/wav"}


def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return json_response(body, status, headers)


def _fault(fault: directives.Fault) -> Response:
    headers = retry_after_headers(fault.retry_after)
    if fault.status == 429:
        return _error(429, "Rate limit reached", "requests", None, "rate_limit_exceeded", headers)
    if fault.status >= 500:
        message = "The server had an error while processing your request. Sorry about that!"
        return _error(fault.status, message, "server_error", headers=headers)
    return _error(fault.status, f"stub injected error {fault.status}", headers=headers)


@bp.post("/v1/audio/speech")
def speech() -> Response:
    body, body_digest = read_body()
    st = state()
    st.record("openai_speech", body_digest)
    if bearer_token() is None:
        message = "You didn't provide a valid API key in the Authorization header (Bearer auth)."
        return _error(401, message, code="invalid_api_key")
    if not isinstance(body, dict):
        return _error(400, "We could not parse the JSON body of your request.")
    for field in ("model", "input", "voice"):
        if not isinstance(body.get(field), str) or not body[field]:
            message = f"Missing required parameter: '{field}'."
            return _error(400, message, param=field, code="missing_required_parameter")
    fmt = body.get("response_format") or "mp3"
    if not isinstance(fmt, str) or fmt not in _MIMETYPES:
        message = f"Invalid value: '{fmt}'. The stub supports 'mp3' and 'wav'."
        return _error(400, message, param="response_format", code="invalid_value")

    text = body["input"]
    wanted = directives.parse(text)
    key = bearer_token() or ""
    st.record_key("openai_speech", key)
    fault = directives.key_fault(wanted, key) or directives.decide_fault(
        wanted, st.next_attempt("openai_speech", body_digest))
    if fault is not None:
        return _fault(fault)
    if wanted.reject:
        return _error(400, "stub rejected the input", param="input", code="invalid_value")
    if wanted.refuse:
        return _error(400, "stub refusal: content policy", code="content_policy_violation")
    if wanted.hang is not None:
        st.sleep(wanted.hang)
    if wanted.latency:
        st.sleep(wanted.latency)

    size = wanted.size
    audio = mp3_bytes(body_digest, text, size) if fmt == "mp3" else wav_bytes(body_digest, text, size)
    return Response(audio, mimetype=_MIMETYPES[fmt])
