"""A request's record, each field declared once (:data:`FIELDS`): its name,
its codec (read from the record's hash, written into admission's ARGV, shown
on the wire), whether status and webhook events show it, and whether
admission carries it from the submission. Derived from it: the record's read
(:meth:`RequestRecord.from_values`), ``ADMIT_ARGS``, the Lua
``place_admission``'s list (``store/lua_declared.py``, via
``scripts.lib_for``), the status body's listed fields and their OpenAPI schema.

A new field shown on status: its :class:`Field` here, its attribute on
:class:`RequestRecord` (and :class:`Submission`), then where the front door
parses it (``web/admission.py``). ``docs/ARCHITECTURE.md``: "The store's parts".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable


def iso(ts: float | None) -> str | None:
    """Unix seconds as the wire's timestamps: ISO 8601, milliseconds, "Z"."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Codec:
    """How a field's value travels: ``decode`` from an ``HMGET`` element (bytes
    or None), ``encode`` into admission's ARGV ("" writes nothing), ``show``
    as its JSON value, which OpenAPI types ``json_type`` (``json_format``)."""

    decode: Callable[[Any], Any]
    encode: Callable[[Any], str] = str
    show: Callable[[Any], Any] = _same
    json_type: str = "string"
    json_format: str | None = None


#: Text that is always there ("" when missing).
TEXT = Codec(decode=lambda v: v.decode() if v else "")
#: Text or None; "" reads as None, None is written as nothing.
OPTIONAL_TEXT = Codec(decode=lambda v: v.decode() if v else None, encode=lambda v: v or "")
#: Text or None; "" is kept as "".
KEPT_TEXT = Codec(decode=lambda v: None if v is None else v.decode(), encode=lambda v: "" if v is None else v)
#: Unix seconds that are always there (0 when missing).
TIME = Codec(decode=lambda v: float(v or 0), encode=repr, show=iso, json_format="date-time")
#: Unix seconds or None, shown as an ISO 8601 date-time.
OPTIONAL_TIME = Codec(decode=lambda v: float(v) if v else None, encode=lambda v: "" if v is None else repr(v),
                      show=iso, json_format="date-time")
#: A number or None.
OPTIONAL_NUMBER = Codec(decode=lambda v: float(v) if v else None, encode=lambda v: "" if v is None else repr(v),
                        json_type="number")
#: A whole number or None (a batch line's number).
OPTIONAL_INT = Codec(decode=lambda v: int(v) if v else None, encode=lambda v: "" if v is None else str(v),
                     json_type="integer")
#: A flat map of text (JSON in the record) or None; an empty map is written as nothing.
TEXT_MAP = Codec(decode=lambda v: json.loads(v) if v else None,
                 encode=lambda v: json.dumps(v, separators=(",", ":")) if v else "", json_type="object")
#: A list of objects (JSON in the record) or None.
OBJECT_LIST = Codec(decode=lambda v: json.loads(v) if v else None,
                    encode=lambda v: json.dumps(v, separators=(",", ":")) if v else "", json_type="array")
#: Present or not.
FLAG = Codec(decode=bool, encode=lambda v: "1" if v else "", json_type="boolean")
#: A count (0 when missing).
COUNT = Codec(decode=lambda v: int(v or 0), json_type="integer")
#: As Redis answers it: read for another attribute (``Field.into``).
RAW = Codec(decode=_same)

#: Where the status body or a webhook event shows a field: not at all; in a
#: place of its own that the body's builder writes (``web/bodies.py``,
#: ``webhooks/event.py``); or LISTED, by the loop over the listed fields, in
#: this declaration's order, whenever the field is set (not None).
HIDDEN, OWN_PLACE, LISTED = "hidden", "own place", "listed"


@dataclass(frozen=True)
class Field:
    """One field of a request's record (``P:req:{id}``)."""

    name: str
    codec: Codec
    #: Where the status body (and a history entry) shows it: HIDDEN, OWN_PLACE or LISTED.
    status: str = HIDDEN
    #: Where a webhook event's body shows it (as it was when the event was owed).
    webhook: str = HIDDEN
    #: Whether admission writes it from the submission (its ARGV of the same
    #: name, "" for none: ``place_admission``). A field the script computes
    #: at admission (its status, seq, created_at ...) is written there by name.
    admitted: bool = False
    #: The :class:`Submission` attribute it is admitted from, when not its name.
    submitted_as: str = ""
    #: What :meth:`RequestRecord.from_values` builds from it: its attribute of
    #: the same name (""), or another attribute it is part of ("cost").
    into: str = ""
    #: Its OpenAPI description, where the status body lists it.
    doc: str = ""

    @property
    def attribute(self) -> str:
        return self.submitted_as or self.name


#: Every field each record read takes, in the order of the ``HMGET`` (status.lua
#: and history.lua are handed the names: the order is free).
FIELDS: tuple[Field, ...] = (
    Field("id", TEXT, admitted=True, submitted_as="request_id"),
    Field("workspace", TEXT, admitted=True),
    Field("model", TEXT, webhook=OWN_PLACE, admitted=True),
    Field("provider", TEXT, admitted=True),
    Field("status", TEXT, status=OWN_PLACE, webhook=OWN_PLACE),
    Field("created_at", TIME, status=OWN_PLACE, webhook=OWN_PLACE),
    Field("started_at", OPTIONAL_TIME, status=OWN_PLACE, webhook=OWN_PLACE),
    Field("completed_at", OPTIONAL_TIME, status=OWN_PLACE, webhook=OWN_PLACE),
    Field("error_type", OPTIONAL_TEXT, status=OWN_PLACE, webhook=OWN_PLACE),
    Field("detail", KEPT_TEXT, status=OWN_PLACE),
    Field("content_type", KEPT_TEXT),
    Field("cancel_requested", FLAG),
    Field("attempts", COUNT),
    Field("upstream_ref", KEPT_TEXT),
    Field("progress", OPTIONAL_NUMBER, status=OWN_PLACE, webhook=OWN_PLACE),
    Field("webhook_url", OPTIONAL_TEXT),
    Field("start_deadline_at", OPTIONAL_TIME, status=LISTED, admitted=True, doc=(
        "the caller's X-Comfy-Start-Deadline, when it set one: not started by then, it ends COMPLETED "
        "queue_timeout, never charged")),
    Field("deadline_at", OPTIONAL_TIME, status=LISTED, admitted=True, doc=(
        "the caller's X-Comfy-Deadline, when it set one: not completed by then, it is cancelled as the cancel "
        "route would cancel it")),
    Field("retry_of", OPTIONAL_TEXT, status=LISTED, admitted=True, doc=(
        "the failed request this one submits again (the retry route); absent otherwise")),
    # -- a batch's line (issue 35: web/batches.py, batches/) --
    Field("batch_id", OPTIONAL_TEXT, status=LISTED, admitted=True, doc=(
        "the batch (POST /v2/batches) this request is a line of; absent otherwise")),
    Field("line", OPTIONAL_INT, status=LISTED, admitted=True, doc="its line number in that batch, from 1"),
    Field("metadata", TEXT_MAP, status=LISTED, admitted=True, doc=(
        "the batch line's metadata: a flat map of text the caller set")),
    # -- bulk actions (web/bulk.py) --
    Field("bulk_id", OPTIONAL_TEXT, status=LISTED, admitted=True, doc=(
        "the bulk action that submitted this retry (POST /v2/requests/bulk); absent otherwise")),
    # -- fallback between models (issue 36: workers/fallbacks.py, docs/POOLS.md) --
    Field("fallback_models", OPTIONAL_TEXT, admitted=True),
    # the price of the model it runs on, kept only when it differs from its hold (the dearest model it
    # named): the path model's at admission, the model it turned to after (lib/ledger.lua, settle)
    Field("model_price", OPTIONAL_INT, admitted=True),
    # the group of regions its workspace's pin waits in (lib/pins.lua), while that is one: its
    # position counts only the requests competing for those members (status.lua hands it to position)
    Field("pin_group", OPTIONAL_TEXT),
    Field("model_ran", OPTIONAL_TEXT, status=LISTED, doc=(
        "the model it runs on (provider/model) once its own model's pool kept it waiting past "
        "FALLBACK_AFTER_SECONDS and it fell back to one it named in X-Comfy-Fallback-Models; absent otherwise")),
    Field("tried", OBJECT_LIST, status=LISTED, doc=(
        "the models it left, in order, each {model, member, error_type}: the member and the trouble last seen "
        "there (rate_limited, credential_refused, pool_unavailable, or a provider error type); absent "
        "until it falls back")),
    Field("price", RAW, status=OWN_PLACE, webhook=OWN_PLACE, into="cost"),
    Field("cost_state", RAW, status=OWN_PLACE, webhook=OWN_PLACE, into="cost"),
    Field("hold", RAW, status=OWN_PLACE, webhook=OWN_PLACE, into="cost"),
)
#: Fields written at admission from the submission that no read takes.
WRITTEN_ONLY: tuple[Field, ...] = (
    Field("priority", TEXT, admitted=True),
    Field("traceparent", TEXT, admitted=True),
    # the caller's API key's id: its budgets (lib/budget.lua) and the ledger's entries
    Field("key_id", TEXT, admitted=True),
)

#: The names every record read takes, in order (the ``HMGET``).
READ_NAMES = tuple(f.name for f in FIELDS)
#: The fields admission carries from the submission: admit.lua's first ARGV, in this order.
ADMITTED = tuple(f for f in (*FIELDS, *WRITTEN_ONLY) if f.admitted)
#: The fields the status body lists, in order (``web/bodies.py``).
STATUS_LISTED = tuple(f for f in FIELDS if f.status == LISTED)
#: The fields a webhook event's body lists: its snapshot carries each under
#: :data:`SNAPSHOT_PREFIX` and its name (lib/webhooks.lua, webhook_snapshot; ``webhooks.py``).
WEBHOOK_LISTED = tuple(f for f in FIELDS if f.webhook == LISTED)
SNAPSHOT_PREFIX = "field:"
_STATUS_AT = READ_NAMES.index("status")
#: Each attribute read from its field, with the field's place in the ``HMGET`` and its decoder.
_ATTRIBUTES = tuple((f.name, (i, f.codec.decode)) for i, f in enumerate(FIELDS) if not f.into)
_DECODERS = tuple(decoder for _, decoder in _ATTRIBUTES)
_COST_AT = tuple(READ_NAMES.index(name) for name in ("price", "cost_state", "hold"))


def admitted_values(submission: "Submission") -> dict[str, str]:
    """The admitted fields' ARGV from ``submission``, by name ("" for none)."""
    return {f.name: f.codec.encode(getattr(submission, f.attribute)) for f in ADMITTED}


def snapshot_listed(snapshot: dict[str, str]) -> dict[str, Any]:
    """The fields a webhook event lists, from its snapshot (flat text), each as
    its codec shows it; one the record did not have is left out."""
    listed = {}
    for f in WEBHOOK_LISTED:
        text = snapshot.get(SNAPSHOT_PREFIX + f.name)
        if text:
            listed[f.name] = f.codec.show(f.codec.decode(text.encode()))
    return listed


#: A request's cost as the caller sees it: its credits are held from its
#: admission, then charged or released with the ledger's entry (lib/ledger.lua, settle).
HELD, CHARGED, RELEASED = "held", "charged", "released"


@dataclass(frozen=True)
class Cost:
    """What a request costs: ``credits`` and whether they are held, charged or released."""

    credits: int
    state: str

    def as_json(self) -> dict[str, Any]:
        return {"credits": self.credits, "state": self.state}


def _int(value: Any) -> int:
    return int(float(value)) if value else 0


def _cost(price: Any, state: Any, hold: Any) -> Cost:
    """From the record's fields: settled, its ``cost_state`` and ``price``
    (lib/ledger.lua, settle); else held, its hold."""
    if state:
        return Cost(_int(price), state.decode())
    return Cost(_int(hold), HELD)


@dataclass(frozen=True)
class RequestRecord:
    """What the front door and workers read about one request: an attribute
    per field of :data:`FIELDS` (but those read ``into`` another), in their
    order and with their codecs' types, then ``ttl_s`` and ``cost``."""

    id: str
    workspace: str
    model: str
    provider: str
    status: str
    created_at: float
    started_at: float | None = None
    completed_at: float | None = None
    error_type: str | None = None
    detail: str | None = None
    content_type: str | None = None
    cancel_requested: bool = False
    #: Provider calls made so far that failed in a way worth retrying.
    attempts: int = 0
    #: The provider's handle on a submitted generation (JSON), for resuming.
    upstream_ref: str | None = None
    #: How far the provider said the generation was, 0..1, when it says so.
    progress: float | None = None
    #: Where its completion's event goes (its own or its workspace's default), if anywhere.
    webhook_url: str | None = None
    #: The caller's deadlines (Unix s): not started by the first, it ends
    #: queue_timeout; not completed by the second, it is cancelled.
    start_deadline_at: float | None = None
    deadline_at: float | None = None
    #: The failed request this one submits again (the retry route).
    retry_of: str | None = None
    #: A batch line's batch, its number in it (from 1) and its metadata; None otherwise.
    batch_id: str | None = None
    line: int | None = None
    metadata: dict[str, str] | None = None
    #: The bulk action whose retry this is (``web/bulk.py``).
    bulk_id: str | None = None
    #: X-Comfy-Fallback-Models, comma-separated model ids; None when not named.
    fallback_models: str | None = None
    #: Its model's price, when less than its hold (a dearer fallback named); None otherwise.
    model_price: int | None = None
    #: The group of regions its pinned workspace waits in (``lib/pins.lua``); None when not pinned.
    pin_group: str | None = None
    #: The model it fell back to, and the models it left ({model, member, error_type} each).
    model_ran: str | None = None
    tried: list[dict[str, Any]] | None = None
    #: Seconds until Redis drops the record (set once COMPLETED), else None.
    ttl_s: int | None = None
    #: Its credits, held, charged or released (agrees with the ledger).
    cost: Cost = Cost(0, HELD)

    @classmethod
    def from_values(cls, values: list[Any], ttl: int | None = None) -> "RequestRecord | None":
        """From an ``HMGET`` of :data:`READ_NAMES` (bytes or None each); None
        when the record is missing (no status). Every status poll makes one."""
        status = values[_STATUS_AT]
        if status is None:
            return None
        price, state, hold = (values[i] for i in _COST_AT)
        args = [decode(values[i]) for i, decode in _DECODERS]
        args.append(ttl if ttl is not None and ttl >= 0 else None)
        args.append(_cost(price, state, hold))
        return cls(*args)


if [a.name for a in dataclasses.fields(RequestRecord)] != [*(name for name, _ in _ATTRIBUTES), "ttl_s", "cost"]:
    raise TypeError("RequestRecord's attributes must be FIELDS' (but those read into another), in their order, "
                    "then ttl_s and cost: from_values builds it by position")


@dataclass(frozen=True)
class Submission:
    """One submit, parsed by the front door (``web/admission.py``): what
    ``RequestStore.admit`` admits. The fields :data:`ADMITTED` are carried
    into the record by their names (``submitted_as``); the rest steer the
    admission."""

    request_id: str
    workspace: str
    model: str
    provider: str
    #: The body's text (or its object's pointer); "" for a retry, whose body is the original's.
    body: str
    #: What the Idempotency-Key is bound to (``web/admission.py``, fingerprint), with the key's hash.
    fingerprint: str = ""
    idempotency_key_hash: str = ""
    #: Whether the workspace must have queued delivery on (not on the synchronous route).
    require_enabled: bool = True
    #: Credits held until the request is charged or released: the dearest model it may run on.
    price: int = 0
    #: Its model's price when that is less than ``price`` (it named a dearer fallback); None otherwise.
    model_price: int | None = None
    #: When it was submitted (Unix s): the write deadline runs from it; None: now.
    now: float | None = None
    priority: str = "normal"
    #: Where its events go (checked); "" for the workspace's default, if any.
    webhook_url: str = ""
    #: The response_url its events name.
    response_url: str = ""
    #: The failed request this one submits again, or "".
    retry_of: str = ""
    #: The caller's deadlines (Unix s), None when not asked for.
    start_deadline_at: float | None = None
    deadline_at: float | None = None
    #: The submit's W3C traceparent (``tracing.py``), kept for its deliveries and webhook attempts.
    traceparent: str = ""
    #: X-Comfy-Webhook-Events, canonical; "" for the workspace's default, else "completed".
    webhook_events: str = ""
    #: A batch line's batch, its number in it and its metadata (None when not a batch's line).
    batch_id: str | None = None
    line: int | None = None
    metadata: dict[str, str] | None = None
    #: The bulk action this retry is part of (``web/bulk.py``), or "".
    bulk_id: str = ""
    #: The models it may run on instead (X-Comfy-Fallback-Models, checked), comma-separated; "" for none.
    fallback_models: str = ""
    #: The caller's API key's id (``key_…``), or "": its budgets are checked too (``store/budgets.py``).
    key_id: str = ""
