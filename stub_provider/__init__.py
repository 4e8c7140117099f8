"""Stub provider: a local HTTP stand-in for BFL, Vertex AI Gemini and OpenAI TTS.

Run it with ``python -m stub_provider --host 127.0.0.1 --port 8300``; it prints
``stub provider listening on http://HOST:PORT`` once ready. It speaks each
provider's real wire format, so the project's real adapters talk to it just by
pointing their base URL at it. It is a test double for the outside world only.

Determinism
    The body digest is sha256 of ``json.dumps(body, sort_keys=True,
    separators=(",", ":"))``. Success payloads derive only from it (BFL: from
    model + canonical body), so they are byte-identical across calls and
    restarts: no timestamps, no random ids.

Directives
    Written anywhere in the input text as ``[stub:NAME]`` or
    ``[stub:NAME=VALUE]``; several may appear, the last of a name wins, unknown
    or malformed ones are ignored, and they stay in the text (so in echoes and
    in the digest). Input text is BFL ``prompt``; Vertex all
    ``contents[*].parts[*].text`` concatenated; OpenAI ``input``.

    ==============  ===========================================================
    latency=S       generation takes S seconds (default 0). Vertex/OpenAI: the
                    200 is delayed S s. BFL: submit answers at once, polls say
                    Pending (with progress) until S s after first submission.
    status=CODE     every call fails with CODE (400-599), provider error format.
    fail_times=N    first N calls with this body digest fail with 500.
    hang[=S]        sleep S seconds (default 120) then answer normally.
    429=S           first call per digest answers 429 + ``Retry-After: S``.
    429_times=N     ... the first N calls instead (alone it implies 429=1).
    refuse          content-policy refusal, provider style (table below).
    reject          the provider rejects the input, 4xx (table below).
    ==============  ===========================================================

    Fault order per body digest (authenticated, well-formed calls only):
    the first ``429_times`` calls answer 429, then ``status`` fails every call,
    else the next ``fail_times`` calls answer 500. Faults answer immediately,
    without latency; ``reject`` precedes ``refuse``.

Per provider
    ======  ==========================  ====================================
    BFL     POST /v1/<model>            header ``x-key``; missing -> 403
            GET  /v1/get_result?id=     Task not found | Pending | Ready |
                                        Content Moderated | Error
            POST /v1/cancel?id=         stub-only (also DELETE
                                        /v1/get_result?id=): 200 Cancelled,
                                        404 unknown, 409 finished
            GET  /files/<sha>.<ext>     8x8 solid JPEG/PNG, no auth
            faults, hang, reject (422 FastAPI-style ``detail`` list) act on
            the submit only; ``status`` never affects polls. refuse: the poll
            ends in ``Content Moderated`` with ``details.Moderation Reasons``.
            Re-submitting a body to the same model returns the same task,
            untouched (even if it was cancelled); use /stub/reset to restart.
    Vertex  POST /v1/projects/<p>/locations/<l>/publishers/google/models/
            <model>:generateContent    ``Authorization: Bearer``; missing ->
                                        401 UNAUTHENTICATED; other action ->
                                        404; no contents -> 400
            success: one candidate, inline base64 8x8 PNG. refuse: 200 with
            ``promptFeedback.blockReason`` SAFETY, no candidates. reject: 400
            INVALID_ARGUMENT. 429: RESOURCE_EXHAUSTED + Retry-After.
    OpenAI  POST /v1/audio/speech       ``Authorization: Bearer``; missing ->
                                        401 invalid_api_key; no model/input/
                                        voice -> 400
            success: raw bytes, mp3 (``audio/mpeg``, ID3 tag + filler) or wav
            (``audio/wav``, real PCM), 64 + 32 bytes/char, max 64 KiB.
            refuse: 400 content_policy_violation. reject: 400 invalid_value.
            429: type ``requests``, code rate_limit_exceeded + Retry-After.
    ======  ==========================  ====================================

Test routes
    GET /healthz -> ``ok``. POST /stub/reset clears tasks and counters.
    GET /stub/calls -> ``{"submits": {"<route>:<body digest>": n},
    "total": {"<route>": n}}`` with routes bfl_submit, bfl_poll, bfl_cancel,
    bfl_file, vertex_generate, openai_speech. Every call counts in ``total``
    (also ones failing auth); per-digest keys need a JSON body (polls and
    cancels count under their task's submit-body digest; files never do).
"""

from .app import create_app

__all__ = ["create_app"]
