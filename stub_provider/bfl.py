"""Black Forest Labs (FLUX) wire format: submit, then poll a polling_url.

Submit answers at once with a deterministic task id; the poll reports
Pending until the `latency` directive has elapsed since the first
submission, then Ready with a sample URL served by this stub. Injected
failures (`status`, `fail_times`, `429`, `hang`, `reject`) act on the
submit only; `refuse` shows on the poll, as BFL moderates during the run.
"""

from __future__ import annotations

import hashlib
import re

from flask import Blueprint, Response, request
from werkzeug.http import HTTP_STATUS_CODES

from . import directives
from .outputs import derived_seed, image_bytes, task_id
from .state import Task
from .wire import json_response, read_body, retry_after_headers, state

bp = Blueprint("bfl", __name__)

_FILE_NAME = re.compile(r"^([0-9a-f]{64})\.(jpeg|png)$")
_OUTPUT_FORMATS = ("jpeg", "png")
MODERATED = "Content Moderated"  # the status a `refuse` task ends in


def _authenticated() -> bool:
    return bool(request.headers.get("x-key", "").strip())


def _not_authenticated() -> Response:
    return json_response({"detail": "Not authenticated - Invalid Authentication"}, 403)


def _error(status: int, headers: dict[str, str] | None = None) -> Response:
    if status == 429:
        detail = "You have exceeded the rate limit"
    else:
        detail = HTTP_STATUS_CODES.get(status, "Error")
    return json_response({"detail": detail}, status, headers)


def _invalid(loc: list[str], msg: str, kind: str) -> Response:
    """FastAPI-style 422, as BFL's API answers malformed input."""
    return json_response({"detail": [{"loc": loc, "msg": msg, "type": kind}]}, 422)


def _phase(task: Task, now: float) -> tuple[str, float | None]:
    """The task's status at `now` (seconds) and, while Pending, its progress."""
    if task.cancelled:
        return "Error", None
    elapsed = now - task.submitted_at  # seconds
    if elapsed < task.latency:
        return "Pending", min(round(elapsed / task.latency, 2), 0.99)
    return (MODERATED if task.refuse else "Ready"), None


@bp.post("/v1/<model>")
def submit(model: str) -> Response:
    body, body_digest = read_body()
    st = state()
    st.record("bfl_submit", body_digest)
    if not _authenticated():
        return _not_authenticated()
    if not isinstance(body, dict):
        return _invalid(["body"], "Input should be a valid dictionary", "dict_type")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return _invalid(["body", "prompt"], "Field required", "missing")
    ext = body.get("output_format") or "jpeg"
    if ext not in _OUTPUT_FORMATS:
        return _invalid(["body", "output_format"], "Input should be 'jpeg' or 'png'", "enum")

    wanted = directives.parse(prompt)
    key = request.headers.get("x-key", "").strip()
    st.record_key("bfl_submit", key)
    fault = directives.key_fault(wanted, key) or directives.decide_fault(wanted, st.next_attempt("bfl_submit",
                                                                                                body_digest))
    if fault is not None:
        return _error(fault.status, retry_after_headers(fault.retry_after))
    if wanted.reject:
        return _invalid(["body", "prompt"], "stub rejected the input", "value_error")
    if wanted.hang is not None:
        st.sleep(wanted.hang)

    # The model is part of the task identity: same body, other model, other task.
    file_digest = hashlib.sha256((model + directives.canonical(body)).encode("utf-8")).hexdigest()
    seed = body.get("seed")
    task = st.submit(
        Task(
            id=task_id(file_digest),
            body_digest=body_digest,
            file_digest=file_digest,
            prompt=prompt,
            seed=derived_seed(file_digest) if seed is None else seed,
            ext=ext,
            latency=wanted.latency,
            refuse=wanted.refuse,
            submitted_at=st.clock(),
        )
    )
    polling_url = f"{request.host_url}v1/get_result?id={task.id}"
    return json_response({"id": task.id, "polling_url": polling_url})


@bp.get("/v1/get_result")
def poll() -> Response:
    st = state()
    wanted_id = request.args.get("id", "")
    task = st.find(wanted_id) if wanted_id else None
    st.record("bfl_poll", task.body_digest if task else None)
    if not _authenticated():
        return _not_authenticated()
    if not wanted_id:
        return _invalid(["query", "id"], "Field required", "missing")
    if task is None:
        return json_response({"id": wanted_id, "status": "Task not found"})

    status, progress = _phase(task, st.clock())
    if status == "Pending":
        return json_response({"id": task.id, "status": status, "result": None, "progress": progress})
    if status == "Error":
        return json_response({"id": task.id, "status": status, "result": None, "details": {"reason": "cancelled"}})
    if status == MODERATED:
        details = {"Moderation Reasons": ["stub refusal"]}
        return json_response({"id": task.id, "status": status, "result": None, "details": details})
    result = {
        "sample": f"{request.host_url}files/{task.file_digest}.{task.ext}",
        "prompt": task.prompt,
        "seed": task.seed,
    }
    return json_response({"id": task.id, "status": "Ready", "result": result})


@bp.post("/v1/cancel")
@bp.delete("/v1/get_result")
def cancel() -> Response:
    """Stub-only: BFL has no public cancel, but the project's cancel path needs a target."""
    st = state()
    wanted_id = request.args.get("id", "")
    task = st.find(wanted_id) if wanted_id else None
    st.record("bfl_cancel", task.body_digest if task else None)
    if not _authenticated():
        return _not_authenticated()
    now = st.clock()
    outcome = st.cancel(wanted_id, lambda t: _phase(t, now)[0] != "Pending")
    if outcome == "missing":
        return json_response({"detail": "Task not found"}, 404)
    if outcome == "finished":
        return json_response({"detail": "Task already finished"}, 409)
    return json_response({"id": wanted_id, "status": "Cancelled"})


@bp.get("/files/<name>")
def sample_file(name: str) -> Response:
    """The delivery URL of a Ready task; bytes derive from the file name alone."""
    state().record("bfl_file", None)
    match = _FILE_NAME.match(name)
    if match is None:
        return json_response({"detail": "Not Found"}, 404)
    file_digest, ext = match.groups()
    return Response(image_bytes(file_digest, ext), mimetype=f"image/{ext}")
