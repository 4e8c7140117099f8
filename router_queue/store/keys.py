"""The Redis key layout, in one place: every key is built by a function here.

Every key starts with the hash tag of its family, so that each script's keys
share one Redis Cluster slot: a provider's, ``{rq-<code>}``
(:func:`provider_code`), which its requests' keys share (an id ends in its
provider's code); a workspace's, ``{ws:<id>}``; the global one, ``{rq}``
(:data:`PREFIX`). Scripts build the keys they only learn by reading
with the Lua :func:`lua_layout` generates from the same rules. Every key, its
type, what it holds, its TTL and who writes it, and every hash's fields:
``docs/KEYS.md``.
"""

from __future__ import annotations

import zlib

#: The global family's prefix: a Redis Cluster hash tag, so that on a cluster
#: the keys every workspace and provider share (API keys, configuration, the
#: fleet) sit in one slot. On one Redis the braces are plain characters.
#: Stores from before the hash tag hold ``rq:…`` keys: ``router-queue ops
#: migrate-keys`` renames them (``store/migrate.py``).
PREFIX = "{rq}"
#: The prefix of the keys written before the hash tag.
UNTAGGED_PREFIX = "rq"
#: The store's key layout: 3, a hash tag per family (the provider's, the
#: workspace's, the global one) and nothing only an earlier version read (its
#: shared webhook due set and draining set, records and events from before
#: costs were kept). Stores written with one tag for everything have no
#: marker, stores of layout 2 may hold those: ``migrate.py`` moves both.
LAYOUT = "3"

#: The catalog's providers' codes, chosen so that a cluster of three
#: primaries with the slots split evenly (as ``redis-cli --cluster create``
#: does) serves one provider each. Never change one: its requests' ids carry it.
PROVIDER_CODES = {"bfl": "01", "vertexai": "00", "openai": "02"}


def provider_code(provider: str) -> str:
    """A provider's code: the hash tag of its keys (``{rq-<code>}``) and the
    last byte of each request id minted for it (``ids.py``), so a request's
    keys share its provider's Redis Cluster slot. A provider not in
    :data:`PROVIDER_CODES` takes its name's CRC-32, mod 256. Any other split
    of a cluster's slots wants each provider's slot moved to the primary it
    should load (``deploy/README.md``, "Redis Cluster"); two providers whose
    codes meet share a slot."""
    return PROVIDER_CODES.get(provider) or f"{zlib.crc32(provider.encode()) & 0xFF:02x}"


def code_tag(code: str) -> str:
    """The hash tag of the provider whose code is ``code``."""
    return f"{{rq-{code}}}"


def provider_prefix(provider: str) -> str:
    """The prefix of a provider's keys: its schedule, queues, stats, its
    requests' records (ids minted for it end in its code)."""
    return code_tag(provider_code(provider))


def request_prefix(request_id: str) -> str:
    """The prefix of a request's keys: its provider's (the id's last byte is
    the provider's code, ``ids.py``)."""
    return code_tag(request_id[-2:])


def workspace_prefix(workspace_id: str) -> str:
    """The prefix of a workspace's keys: its hash, ledger, idempotency keys,
    history, rate windows, held slots and webhook turn."""
    return f"{{ws:{workspace_id}}}"


def request(request_id: str) -> str:
    return f"{request_prefix(request_id)}:req:{request_id}"


def result(request_id: str) -> str:
    return f"{request_prefix(request_id)}:result:{request_id}"


def body(request_id: str) -> str:
    """A request's native body, apart from its record so the record stays a
    compact listpack."""
    return f"{request_prefix(request_id)}:body:{request_id}"


def body_refs(request_id: str) -> str:
    """Who shares a kept body (the request's own, first of its retry chain):
    its retries ever admitted ("retries", capped) and those still waiting or
    running ("live", which keep it from expiring)."""
    return f"{body(request_id)}:refs"


def webhook_event(request_id: str) -> str:
    """The webhook event being delivered for a request."""
    return f"{request_prefix(request_id)}:webhook:{request_id}"


def webhook_next(request_id: str) -> str:
    """The request's events owed behind the one being delivered."""
    return f"{webhook_event(request_id)}:next"


def queue(provider: str) -> str:
    return f"{provider_prefix(provider)}:queue:{provider}"


def sequence(provider: str) -> str:
    return f"{provider_prefix(provider)}:seq:{provider}"


def schedule(provider: str) -> str:
    return f"{provider_prefix(provider)}:sched:{provider}"


def schedule_workspaces(provider: str) -> str:
    """How many requests each workspace has waiting on ``provider``."""
    return f"{schedule(provider)}:depths"


def running(provider: str) -> str:
    return f"{provider_prefix(provider)}:running:{provider}"


def deadlines(provider: str) -> str:
    """The caller deadlines of a provider's requests ("start|{id}", "run|{id}")
    by when each falls (lua/lib/ending.lua)."""
    return f"{provider_prefix(provider)}:deadlines:{provider}"


def member_state(provider: str) -> str:
    """A provider's pool: each member's slots held, learned cap, pauses and
    their counts (``members.py``), one hash."""
    return f"{provider_prefix(provider)}:members:{provider}"


def member_leases(provider: str) -> str:
    """The slots held on a provider's members ("{member}|{id}"), by when each
    is given back if its worker never does (``members.py``)."""
    return f"{member_state(provider)}:leases"


def result_objects(provider: str, request_id: str | None = None) -> str:
    """The objects holding its requests' results and bodies (``"{id} {object
    key}"``), by when their record (a result's) or pointer (a body's,
    ``P:body:{id}``) expires: the sweeper deletes them from here. With
    ``request_id``: the one its scripts name (its provider's)."""
    prefix = provider_prefix(provider) if request_id is None else request_prefix(request_id)
    return f"{prefix}:objects:{provider}"


def fallback_results(provider: str) -> str:
    """Its requests' big results kept in Redis while the object store was away
    (id scored by its bytes): the sweeper moves them to the store."""
    return f"{provider_prefix(provider)}:fallback:{provider}"


def fallback_bytes(provider: str) -> str:
    """The bytes :func:`fallback_results` holds: its share of the fallback budget."""
    return f"{provider_prefix(provider)}:fallback-bytes:{provider}"


def fallback_pause(provider: str) -> str:
    """Set for a while after the store failed a move: sweeps skip the move pass meanwhile."""
    return f"{provider_prefix(provider)}:fallback-pause:{provider}"


def stats(provider: str) -> str:
    return f"{provider_prefix(provider)}:stats:{provider}"


def owed(provider: str) -> str:
    """A split store's workspace effects owed by the provider's steps, not yet
    applied (JSON, by when owed; ``lua/lib/ledger.lua``, ``owe_ws``)."""
    return f"{provider_prefix(provider)}:owed:{provider}"


def admitting(provider: str) -> str:
    """A split store's admissions between their workspace's step and their
    provider's (JSON, by write deadline; ``admission.py``)."""
    return f"{provider_prefix(provider)}:admitting:{provider}"


def webhooks_due(provider: str, request_id: str | None = None) -> str:
    """The pending webhook events of a provider's requests, by when to publish
    them (beside its requests: the steps that owe an event write it). With
    ``request_id``: the one its scripts name (its provider's)."""
    prefix = provider_prefix(provider) if request_id is None else request_prefix(request_id)
    return f"{prefix}:webhook:due:{provider}"


def workspace(workspace_id: str) -> str:
    return f"{workspace_prefix(workspace_id)}:ws"


def stored(workspace_id: str) -> str:
    """The workspace's kept bodies (its stored bytes, ``quotas.py``):
    "{id}|{bytes}" scored by when each expires."""
    return f"{workspace_prefix(workspace_id)}:stored"


def idempotency(workspace_id: str, key_hash: str) -> str:
    return f"{workspace_prefix(workspace_id)}:idem:{key_hash}"


def ledger(workspace_id: str) -> str:
    return f"{workspace_prefix(workspace_id)}:ledger"


def open_requests(workspace_id: str) -> str:
    """The workspace's requests whose start, end or pending webhook it has not
    yet been given (a split store's, ``ws_settle.lua``): id -> what is still
    owed, "q", "e" and "w"."""
    return f"{workspace_prefix(workspace_id)}:open"


def history(workspace_id: str) -> str:
    """The workspace's requests by admission time (``GET /v2/requests``)."""
    return f"{workspace_prefix(workspace_id)}:history"


def model_history(workspace_id: str, model_id: str) -> str:
    """The workspace's requests of one model by admission time."""
    return f"{history(workspace_id)}:{model_id}"


def held(workspace_id: str) -> str:
    """The workspace's slots for synchronous calls and event streams held open."""
    return f"{workspace_prefix(workspace_id)}:held"


def rate_window(name: str, workspace_id: str | None = None) -> str:
    """A caller's request-rate counter for one window (``web/ratelimit.py``:
    ``name`` is the ``limits`` item's own key): a workspace's beside its
    other keys (admission counts it in the workspace's step), any other
    caller's in the global family."""
    return f"{workspace_prefix(workspace_id) if workspace_id else PREFIX}:rate:{name}"


def webhook_log(workspace_id: str) -> str:
    return f"{workspace_prefix(workspace_id)}:webhooks:log"


def webhook_circuit(workspace_id: str, origin: str) -> str:
    """One workspace's circuit on one URL origin."""
    return f"{workspace_prefix(workspace_id)}:webhooks:circuit:{origin}"


def webhook_in_flight(workspace_id: str) -> str:
    """The workspace's webhook attempts running now (its fair share's slots)."""
    return f"{workspace_prefix(workspace_id)}:webhooks:inflight"


def workspaces() -> str:
    return f"{PREFIX}:workspaces"


def api_key(key_hash: str) -> str:
    return f"{PREFIX}:apikey:{key_hash}"


def key_record(key_id: str) -> str:
    return f"{PREFIX}:key:{key_id}"


def workspace_keys(workspace_id: str) -> str:
    """A workspace's key ids by when each stops working (+inf: no end)."""
    return f"{PREFIX}:keys:{workspace_id}"


def key_audit(workspace_id: str) -> str:
    """A workspace's last key changes (mint, revoke, rotate), newest first."""
    return f"{PREFIX}:keyaudit:{workspace_id}"


def budgeted() -> str:
    """The workspaces with a budget (theirs or a key's): whose crossings the sweeper sends (``budgets.py``)."""
    return f"{PREFIX}:budgets"


def keys_indexed() -> str:
    """Set once every key minted before the key index was indexed."""
    return f"{PREFIX}:config:keys-indexed"


def id_secret() -> str:
    return f"{PREFIX}:config:id-secret"


def epoch() -> str:
    """The token that says this store still holds the data it was set up with."""
    return f"{PREFIX}:config:epoch"


def secrets_sealed() -> str:
    """Written before the first webhook secret sealed with ``WEBHOOK_SECRETS_KEY``
    (``secret_box.py``): from then on no process starts without the key."""
    return f"{PREFIX}:config:secrets_sealed"


def layout() -> str:
    """The store's key layout (:data:`LAYOUT`), written with its first workspace."""
    return f"{PREFIX}:config:layout"


def split_steps() -> str:
    """Set once every request of a store split into per-slot steps has its
    open entry (:func:`open_requests`): with the first workspace of a store
    served split, or by ``ops migrate-keys`` on one served by one Redis until then."""
    return f"{PREFIX}:config:split-steps"


# -- bulk actions (store/bulk.py) and recent failures (store/failures.py) --
def bulk(workspace_id: str, bulk_id: str) -> str:
    """A bulk action's progress (``POST /v2/requests/bulk``): a hash, expiring with it."""
    return f"{workspace_prefix(workspace_id)}:bulk:{bulk_id}"


def bulk_idempotency(workspace_id: str, key_hash: str) -> str:
    """A bulk action's Idempotency-Key: "{bulk id}|{fingerprint}"."""
    return f"{workspace_prefix(workspace_id)}:bulk-idem:{key_hash}"


def workspace_bulks(workspace_id: str) -> str:
    """The workspace's unfinished bulk actions by when each began (its cap on them)."""
    return f"{workspace_prefix(workspace_id)}:bulks"


def bulk_lease(workspace_id: str, bulk_id: str) -> str:
    """Held by the worker running a bulk action's step, so one step runs at a time."""
    return f"{bulk(workspace_id, bulk_id)}:lease"


def bulks_running() -> str:
    """Unfinished bulk actions ("{workspace}|{bulk id}") by when their next step is due: the sweeper resumes them."""
    return f"{PREFIX}:bulks"


def failures(provider: str, bucket: int) -> str:
    """A provider's failures in one time bucket: "{model}|{error_type}" -> count."""
    return f"{provider_prefix(provider)}:failures:{provider}:{bucket}"


#: Every request's and provider's event channel: one subscription per process.
EVENTS_PATTERN = f"{PREFIX}:events:*"
#: What follows the prefix on a provider's channel (request ids are UUIDs).
PROVIDER_EVENTS = f"{PREFIX}:events:provider:"


#: What follows the prefix on an API key's channel: its key id (``key_…``).
KEY_EVENTS = f"{PREFIX}:events:key:"


def key_events_channel(key_id: str) -> str:
    """Pub/sub channel announcing an API key was revoked or rotated, so held
    connections opened with it check it again (``web/stream.py``)."""
    return KEY_EVENTS + key_id


def events_channel(request_id: str) -> str:
    """Pub/sub channel announcing a request changed: started, progressed,
    COMPLETED."""
    return f"{PREFIX}:events:{request_id}"


def orphan_pass() -> str:
    """Held while one sweeper lists the object store for orphaned results
    (an hour's lock: one pass an hour, fleet-wide)."""
    return f"{PREFIX}:objects:orphan-pass"


def fleet() -> str:
    """The workers heard from, by their last heartbeat."""
    return f"{PREFIX}:fleet:workers"


def fleet_worker(name: str) -> str:
    """What one worker consumes, as its last heartbeat said."""
    return f"{PREFIX}:fleet:worker:{name}"


def webhooks_failing() -> str:
    """Failing endpoints, "{ws}|{origin}" by their last failure (trimmed)."""
    return f"{PREFIX}:webhooks:failing-origins"


def webhooks_in_flight() -> str:
    """Every webhook attempt running now."""
    return f"{PREFIX}:webhooks:inflight"


# -- batches (issue 35: store/batches.py) ------------------------------------
def batch(workspace_id: str, batch_id: str) -> str:
    """A batch: its state, counts and settings (hash)."""
    return f"{workspace_prefix(workspace_id)}:batch:{batch_id}"


def batch_lines(workspace_id: str, batch_id: str) -> str:
    """A batch's lines ready to admit, in input order (list of JSON)."""
    return f"{batch(workspace_id, batch_id)}:lines"


def batch_results(workspace_id: str, batch_id: str) -> str:
    """A batch's lines' outcomes so far: line number → request id, or an error."""
    return f"{batch(workspace_id, batch_id)}:results"


def batch_webhook_lease(workspace_id: str, batch_id: str) -> str:
    """The token of the one attempt at a batch's batch.completed webhook under way (string, its lease's TTL)."""
    return f"{batch(workspace_id, batch_id)}:webhook-lease"


def batches(workspace_id: str) -> str:
    """A workspace's batches, scored by creation (the list route)."""
    return f"{workspace_prefix(workspace_id)}:batches"


def batches_open(workspace_id: str) -> str:
    """A workspace's batches not yet COMPLETED, scored by creation (its cap)."""
    return f"{workspace_prefix(workspace_id)}:batches:open"


def batch_idempotency(workspace_id: str, key_hash: str) -> str:
    """A batch call's Idempotency-Key: "{fingerprint}|{batch id}"."""
    return f"{workspace_prefix(workspace_id)}:batchidem:{key_hash}"


def batches_unfinished() -> str:
    """Every workspace's open batches, "{workspace}|{batch id}", for the sweeper to drain and finish."""
    return f"{PREFIX}:batches:unfinished"


def lua_layout() -> str:
    """The Lua definitions ``load_script`` offers every script beside
    ``lua/lib/``'s (each script takes those it names): functions building
    the keys a script builds from an id it read (the request the schedule
    names next, an index's members) by the rules above (``docs/KEYS.md``).
    ``tests/unit/test_keys.py`` holds the Lua to the Python."""
    return f"""local function request_prefix(id)
  return "{{rq-" .. string.sub(id, -2) .. "}}"
end
local function key_request(id)
  return request_prefix(id) .. ":req:" .. id
end
local function key_webhook(id)
  return request_prefix(id) .. ":webhook:" .. id
end
local function key_webhooks_due(id, provider)
  return request_prefix(id) .. ":webhook:due:" .. provider
end
local function key_body(id)
  return request_prefix(id) .. ":body:" .. id
end
local function key_body_refs(id)
  return key_body(id) .. ":refs"
end
local function key_objects(id, provider)
  return request_prefix(id) .. ":objects:" .. provider
end
local function key_workspace(ws)
  return "{{ws:" .. ws .. "}}:ws"
end
local function key_stored(ws)
  return "{{ws:" .. ws .. "}}:stored"
end
local KEY_EVENTS = "{PREFIX}:events:"
local KEY_PROVIDER_EVENTS = "{PROVIDER_EVENTS}"
local KEY_APIKEY_EVENTS = "{KEY_EVENTS}"
local KEY_WEBHOOK_NEXT = ":next"
"""
