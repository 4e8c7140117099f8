"""Validating a body at a cost bounded by the contract, not by the body.

:func:`too_many_items` refuses a raw body with too many strings and
separators unparsed; an input object (:class:`StrictSchema`) counts its
unknown keys in one pass and lists only the first few; a list
(:class:`BoundedList`) refuses a length over its maximum before reading an
item and stops at ``MAX_ERRORS``; the 422's ``detail`` is capped
(``MAX_ERRORS``, ``MAX_ECHO``, ``MAX_DETAIL_BYTES``, then one
``too_many_errors`` entry). The error budget is a context variable set for one
:func:`validate` call. Why (marshmallow's own cost, measured):
``docs/ARCHITECTURE.md``, "The front door's parts".
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from itertools import islice
from typing import Any, Mapping

from marshmallow import EXCLUDE, RAISE, Schema, ValidationError, fields, utils, validate as validators, validates_schema

#: Most per-field errors a 422 lists; lists stop being read once this many are found.
MAX_ERRORS = 10
#: Characters of a caller's key (or of a message) a 422 repeats; the rest is cut to "…".
MAX_ECHO, MAX_MESSAGE = 64, 200
#: Strings (keys included), and separators between members or elements, a body
#: may hold. The largest valid input is Gemini's (``schemas.py``): 256 parts in
#: 64 turns, 16 safety settings and a config, about 2,000 of each.
MAX_JSON_ITEMS = 4096
#: A 422's ``detail`` array, JSON-encoded, stays under this many bytes.
MAX_DETAIL_BYTES = 16 * 1024 - 256  # room for the envelope: {"error_type":"invalid_input","detail":…}


class _ErrorBudget:
    """What one validation has found so far: listed errors, and those only counted."""

    def __init__(self, limit: int):
        self.limit = limit
        self.found = 0
        self.unlisted = 0
        self.stopped = False  # a list stopped reading: there may be more than were counted

    @property
    def spent(self) -> bool:
        return self.found >= self.limit

    def room(self) -> int:
        return max(0, self.limit - self.found)


_budget: ContextVar[_ErrorBudget | None] = ContextVar("validation_error_budget", default=None)


def _leaves(messages: Any) -> int:
    """How many error messages a marshmallow error tree holds."""
    if isinstance(messages, dict):
        return sum(_leaves(value) for value in messages.values())
    if isinstance(messages, list):
        return sum(_leaves(value) for value in messages)
    return 1


class StrictSchema(Schema):
    """An input object: an unknown key is an error (``extra_forbidden``).

    marshmallow's ``RAISE`` walks the unknown keys one error each; here they
    are counted in one pass over the keys and only the first few named."""

    class Meta:
        unknown = RAISE  # what the OpenAPI documents say (additionalProperties: false)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._known = frozenset(field.data_key or name for name, field in self.load_fields.items())

    def _deserialize(self, data: Any, **kwargs: Any) -> Any:
        # marshmallow's own pass over unknown keys is skipped: _no_unknown_keys refuses them
        return super()._deserialize(data, **{**kwargs, "unknown": EXCLUDE})

    @validates_schema(pass_original=True, skip_on_field_errors=False)
    def _no_unknown_keys(self, _data: Any, original: Any, **_: Any) -> None:
        if not isinstance(original, Mapping):
            return
        unknown = len(original) - sum(1 for key in self._known if key in original)
        if not unknown:
            return
        budget = _budget.get()
        room = max(1, budget.room()) if budget is not None else MAX_ERRORS
        listed = list(islice((key for key in original if key not in self._known), min(unknown, room)))
        if budget is not None:
            budget.found += len(listed)
            budget.unlisted += unknown - len(listed)
        raise ValidationError({key: ["Unknown field."] for key in listed})


class BoundedList(fields.List):
    """A list with a maximum length, refused before any item is read, whose
    items are read only until the validation's error budget is spent."""

    def __init__(self, inner: fields.Field, *, max_length: int, min_length: int | None = None, **kwargs: Any):
        # the Length validator documents the bounds (OpenAPI minItems/maxItems)
        super().__init__(inner, validate=validators.Length(min=min_length, max=max_length), **kwargs)
        self.max_length = max_length

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> list[Any]:
        if not utils.is_collection(value):
            raise self.make_error("invalid")
        if len(value) > self.max_length:  # type: ignore[arg-type]  # a JSON array; is_collection says Iterable
            raise ValidationError(f"Longer than maximum length {self.max_length}.")
        budget = _budget.get()
        result: list[Any] = []
        errors: dict[int, Any] = {}
        for index, item in enumerate(value):
            if budget is not None and budget.spent:  # items left unread
                budget.stopped = True
                break
            before = budget.found if budget is not None else 0
            try:
                result.append(self.inner.deserialize(item, **kwargs))
            except ValidationError as error:
                errors[index] = error.messages
                if budget is not None:  # what the item's own lists and objects did not count yet
                    budget.found += max(0, _leaves(error.messages) - (budget.found - before))
        if errors:
            raise ValidationError(errors, valid_data=result)
        return result


def too_many_items(raw: bytes, limit: int = MAX_JSON_ITEMS) -> str | None:
    """Why ``raw`` holds more JSON items than any input may (None when it does
    not), from byte counts alone, without parsing it.

    With every escaped backslash and escaped quote removed, each quote left
    opens or closes a string, so half their count is the number of strings;
    commas outside those strings separate members and elements. (A body that
    is not JSON at all may be miscounted; it is refused either way.)"""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = unescaped.count(b'"') // 2
    if strings > limit:
        return f"the body holds {strings} strings and keys; no model's input holds more than {limit}"
    if unescaped.count(b",") <= limit:  # commas inside strings included: an upper bound
        return None
    # at most ``limit`` strings, so at most 2 * limit + 1 pieces; the even ones are outside strings
    separators = sum(piece.count(b",") for piece in unescaped.split(b'"')[::2])
    if separators > limit:
        return f"the body holds {separators + 1} members and elements; no model's input holds more than {limit}"
    return None


def validate(schema: Schema, body: Any) -> list[dict[str, Any]] | None:
    """The contract's ``detail`` array when ``schema`` refuses ``body``, else None."""
    budget = _ErrorBudget(MAX_ERRORS)
    token = _budget.set(budget)
    try:
        messages = schema.validate(body)
    finally:
        _budget.reset(token)
    if not messages:
        return None
    return validation_detail(messages, unlisted=budget.unlisted, stopped=budget.stopped)


# -- the detail array --------------------------------------------------------------

#: marshmallow's message texts -> the machine-readable ``type`` of a detail entry.
_TYPES = (
    ("Missing data for required field", "missing"),
    ("Unknown field", "extra_forbidden"),
    ("Field may not be null", "null_not_allowed"),
    ("Not a valid string", "string_type"),
    ("Not a valid integer", "int_type"),
    ("Not a valid number", "float_type"),
    ("Not a valid boolean", "bool_type"),
    ("Not a valid list", "list_type"),
    ("Invalid input type", "object_type"),
    ("Not a valid mapping", "object_type"),
    ("Must be one of", "enum"),
    ("Must be greater than", "out_of_range"),
    ("Must be less than", "out_of_range"),
    ("Shorter than minimum length", "too_short"),
    ("Longer than maximum length", "too_long"),
    ("Length must be", "length"),
    ("Must be an https URL", "url_scheme"),
)


def _type_of(message: str) -> str:
    for prefix, kind in _TYPES:
        if message.startswith(prefix):
            return kind
    return "value_error"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _walk(errors: Any, loc: list[Any], out: list[dict[str, Any]], limit: int) -> int:
    """Appends up to ``limit`` entries to ``out``; returns how many it saw in all."""
    if isinstance(errors, dict):
        seen = 0
        for key, value in errors.items():
            path = loc if key == "_schema" else loc + [_cut(key, MAX_ECHO) if isinstance(key, str) else key]
            seen += _walk(value, path, out, limit)
        return seen
    if isinstance(errors, list):
        return sum(_walk(item, loc, out, limit) for item in errors)
    if len(out) < limit:
        message = str(errors)
        out.append({"loc": loc, "msg": _cut(message, MAX_MESSAGE), "type": _type_of(message)})
    return 1


def validation_detail(messages: dict[str, Any], *, unlisted: int = 0, stopped: bool = False,
                      limit: int = MAX_ERRORS) -> list[dict[str, Any]]:
    """marshmallow's nested error dict as the contract's ``detail`` array:
    at most ``limit`` entries, then one saying what was left out."""
    detail: list[dict[str, Any]] = []
    seen = _walk(messages, ["body"], detail, limit)
    while len(detail) > 1 and len(json.dumps(detail)) > MAX_DETAIL_BYTES:
        detail.pop()
    left_out = seen - len(detail) + unlisted
    if left_out or stopped:
        if left_out:
            more = f"{'at least ' if stopped else ''}{left_out} more errors were not listed"
        else:
            more = "more errors may follow"
        if stopped:
            more += f" (validation stops after {limit})"
        detail.append({"loc": ["body"], "msg": more, "type": "too_many_errors",
                       "ctx": {"limit": limit, "not_listed": left_out, "stopped": stopped}})
    return detail
