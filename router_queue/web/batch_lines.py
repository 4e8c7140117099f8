"""A batch call's NDJSON body, read line by line with bounded memory, each
line checked as a submit is (``admission.py``: the catalog, the model's
schema, the priority, the webhook URL) and made ready to admit.

A bad line never refuses the batch: it becomes its own error outcome, named
by its number. Blank lines at the end are not lines; a blank line before
another line is an error line. Over ``MAX_BATCH_LINES`` lines or
``MAX_BATCH_BYTES`` bytes the whole call is ``413`` (:class:`TooLarge`).
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import IO, Any, Iterator

from ..catalog import ModelEntry
from ..errors import ModelNotFound, NotEnabled, PayloadTooLarge, RouterError
from ..services import Services
from ..store.batches import error_outcome
from . import admission, stashed
from .bodies import response_url
from .fallback_models import fallback_models, held_price

#: What a line holds besides its body, at most, in bytes: a line may be this
#: much longer than MAX_BODY_BYTES.
LINE_OVERHEAD_BYTES = 16_384
#: A line's fields; any other is refused.
LINE_FIELDS = frozenset({"model", "body", "idempotency_key", "priority", "webhook_url", "metadata",
                         "fallback_models"})
#: A line's ``metadata``: at most this many keys, each key and value this many characters at most.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: A batch line's priority when it names none: batches yield to interactive traffic.
DEFAULT_PRIORITY = "low"


class TooLarge(PayloadTooLarge):
    """The whole batch is over a limit: ``413 invalid_input``."""


@dataclass(frozen=True)
class BatchCall:
    """What every line of one batch call shares."""

    services: Services
    workspace: str
    batch_id: str
    #: The call's Idempotency-Key, or None: each line's key defaults to "{key}:{line}".
    key: str | None
    base_url: str
    #: The id of the API key the call presents ("" for none): each line is checked against its budgets.
    key_id: str = ""


@dataclass
class Chunk:
    """Lines read since the last chunk: each line's JSON ready to admit, or ""
    for a line that ended here, whose error is in ``outcomes``."""

    lines: list[str] = field(default_factory=list)
    outcomes: dict[int, str] = field(default_factory=dict)


@dataclass
class Reading:
    """The totals of a whole read: lines, bytes and the body's sha256 (what a batch Idempotency-Key is bound to)."""

    lines: int = 0
    bytes: int = 0
    digest: Any = field(default_factory=hashlib.sha256)
    #: Lines that ended at parsing (no request).
    refused: int = 0


#: Bytes read from the body at a time (its lines are split from them).
READ_BUFFER_BYTES = 65_536


def _raw_lines(stream: IO[bytes], limit: int, reading: Reading, max_bytes: int) -> Iterator[bytes | None]:
    """Each physical line without its newline; None for one over ``limit``
    bytes (the rest of it read and dropped). A raw stream (werkzeug's
    LimitedStream, the body with a Content-Length) is read through a buffer:
    its own ``readline`` reads one byte a call, half a 10,000-line batch's time."""
    if isinstance(stream, io.RawIOBase):
        stream = io.BufferedReader(stream, READ_BUFFER_BYTES)
    while True:
        raw = stream.readline(limit + 1)
        if not raw:
            return
        reading.bytes += len(raw)
        reading.digest.update(raw)
        if reading.bytes > max_bytes:
            raise TooLarge(f"the batch is larger than MAX_BATCH_BYTES, {max_bytes} bytes; nothing was queued")
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # the rest of the long line, read and dropped
                raw = stream.readline(65_536)
                reading.bytes += len(raw)
                reading.digest.update(raw)
                if reading.bytes > max_bytes:
                    raise TooLarge(f"the batch is larger than MAX_BATCH_BYTES, {max_bytes} bytes; nothing was queued")
            yield None
            continue
        yield raw.rstrip(b"\r\n")


def read(call: BatchCall, stream: IO[bytes], reading: Reading, chunk_lines: int = 500) -> Iterator[Chunk]:
    """The batch's lines, checked, in chunks (the caller stages each); the
    totals accumulate in ``reading``."""
    settings = call.services.settings
    checker = _LineChecker(call)
    limit = settings.max_body_bytes + LINE_OVERHEAD_BYTES
    chunk, blanks = Chunk(), 0
    for raw in _raw_lines(stream, limit, reading, settings.max_batch_bytes):
        if raw is not None and not raw.strip():
            blanks += 1  # a line only if another follows
            continue
        for _ in range(blanks):
            _add(chunk, reading, settings.max_batch_lines, None, "this line is empty; each line is one JSON object")
        blanks = 0
        if raw is None:
            _add(chunk, reading, settings.max_batch_lines, None,
                 f"this line is longer than {limit} bytes (MAX_BODY_BYTES and {LINE_OVERHEAD_BYTES} more); "
                 "it was not read")
        else:
            _add(chunk, reading, settings.max_batch_lines, checker, raw)
        if len(chunk.lines) >= chunk_lines:
            yield chunk
            chunk = Chunk()
    if chunk.lines:
        yield chunk


def _add(chunk: Chunk, reading: Reading, max_lines: int, checker: "_LineChecker | None", raw: bytes | str) -> None:
    reading.lines += 1
    number = reading.lines
    if number > max_lines:
        raise TooLarge(f"the batch has more than MAX_BATCH_LINES, {max_lines} lines (line {number}); "
                       "nothing was queued")
    if checker is None:
        chunk.lines.append("")
        chunk.outcomes[number] = error_outcome("invalid_input", str(raw))
        reading.refused += 1
        return
    try:
        chunk.lines.append(checker.check(number, raw))  # type: ignore[arg-type]
    except RouterError as refused:
        chunk.lines.append("")
        detail = refused.detail if isinstance(refused.detail, str) else json.dumps(refused.detail)
        chunk.outcomes[number] = error_outcome(refused.error_type or "invalid_input", detail)
        reading.refused += 1


class _LineChecker:
    """One line's checks, with what the batch's lines share cached (catalog
    entries, webhook URLs already looked up)."""

    def __init__(self, call: BatchCall):
        self.call = call
        self.entries: dict[str, ModelEntry] = {}
        self.hooks: dict[str, str] = {}

    def check(self, number: int, raw: bytes) -> str:
        """The line ready to admit (JSON), or its refusal raised."""
        line = admission.parse_body(raw)
        unknown = sorted(set(line) - LINE_FIELDS)
        if unknown:
            raise admission.InvalidInput(f"unknown field(s) {', '.join(unknown)[:200]}; a line has "
                                         f"{', '.join(sorted(LINE_FIELDS))}")
        entry = self._entry(line.get("model"))
        body = line.get("body")
        if not isinstance(body, dict):
            raise admission.InvalidInput("body must be a JSON object: the model's native body")
        raw_body = json.dumps(body, separators=(",", ":")).encode()
        settings = self.call.services.settings
        if len(raw_body) > settings.max_body_bytes:
            raise admission.InvalidInput(f"body is {len(raw_body)} bytes, over MAX_BODY_BYTES "
                                         f"({settings.max_body_bytes})")
        admission.validate_body(entry, body)  # the line's parse bounded its items (parse_body)
        key = self._key(number, line.get("idempotency_key"))
        rank = admission.priority(_text_or_none(line.get("priority"), "priority") or DEFAULT_PRIORITY)
        hook = self._hook(_text_or_none(line.get("webhook_url"), "webhook_url"))
        metadata = _metadata(line.get("metadata"))
        fallback = _fallback_models(line.get("fallback_models"), entry, self.call.services)
        services = self.call.services
        request_id = services.ids.mint(self.call.workspace, entry.id)
        pointer = stashed.stash(services, request_id, raw_body)
        hold, model_price = held_price(entry, fallback, services.catalog)
        return json.dumps({
            "id": request_id, "m": entry.id, "p": entry.provider, "c": hold,
            "b": pointer.text() if pointer else raw_body.decode(),
            "f": admission.fingerprint(f"{entry.id} or {fallback}" if fallback else entry.id, body),
            "k": hashlib.sha256(key.encode()).hexdigest(),
            "q": rank, "w": hook, "md": metadata, "u": response_url(self.call.base_url, entry.id, request_id),
            **({"fb": fallback} if fallback else {}), **({"mp": model_price} if model_price is not None else {}),
            **({"ki": self.call.key_id} if self.call.key_id else {}),
        }, separators=(",", ":"))

    def _entry(self, model: Any) -> ModelEntry:
        if not isinstance(model, str) or model.count("/") != 1:
            raise admission.InvalidInput('model must be a model id, "provider/model"')
        entry = self.entries.get(model)
        if entry is None:
            catalog = self.call.services.catalog
            found = catalog.get(*model.split("/"))
            if found is None:
                close = catalog.suggest(model)
                raise ModelNotFound(f"{model[:100]} is not a model" + (f"; did you mean {', '.join(close)}?"
                                                                      if close else ""))
            if not found.queueable:
                raise NotEnabled(f"{found.id} cannot be queued, so it cannot be a batch's line")
            entry = self.entries[model] = found
        return entry

    def _key(self, number: int, raw: Any) -> str:
        """The line's Idempotency-Key: its own, else "{batch key}:{line}",
        else one of our own, so a drain run twice admits it once."""
        if raw is not None:
            key = admission.idempotency_key(_text_or_none(raw, "idempotency_key"))
            assert key is not None
            return key
        if self.call.key:
            return f"{self.call.key}:{number}"
        return f"batch:{self.call.batch_id}:{number}"

    def _hook(self, raw: str | None) -> str:
        if raw is None:
            return ""
        if raw not in self.hooks:
            settings = self.call.services.settings
            self.hooks[raw] = admission.webhook_url(
                raw, allow_loopback_http=settings.webhook_allow_loopback_http,
                resolve_timeout_s=settings.webhook_resolve_timeout_s, workspace=self.call.workspace)
        return self.hooks[raw]


def _text_or_none(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise admission.InvalidInput(f"{name} must be a string")


def _fallback_models(value: Any, entry: ModelEntry, services: Services) -> str:
    """A line's ``fallback_models``: a list of model ids, checked as X-Comfy-Fallback-Models is; "" when absent."""
    if value is None:
        return ""
    if not isinstance(value, list) or not all(isinstance(item, str) and "," not in item for item in value):
        raise admission.InvalidInput("fallback_models must be a list of model ids, \"provider/model\"")
    return fallback_models(",".join(value), entry, services.catalog) if value else ""


def _metadata(value: Any) -> dict[str, str] | None:
    """A line's ``metadata``: a flat map of text, bounded; None when absent or empty."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise admission.InvalidInput("metadata must be a flat JSON object of strings")
    if len(value) > MAX_METADATA_KEYS:
        raise admission.InvalidInput(f"metadata has {len(value)} keys; at most {MAX_METADATA_KEYS}")
    if any(not k or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items()):
        raise admission.InvalidInput(f"metadata keys are 1 to {MAX_METADATA_KEY} characters, values at most "
                                     f"{MAX_METADATA_VALUE}")
    return value or None
