"""The Redis key layout, in one place. Every key is built by a function here.
Every key starts with the hash tag of its family, so that each script's keys
share one Redis Cluster slot and a cluster spreads the families over its
primaries: a provider's, ``{rq-<code>}`` (:func:`provider_code`), written ``P``
below, which its requests' keys share (an id ends in its provider's code); a
workspace's, ``{ws:<id>}``, written ``W``; the global one, ``{rq}``
(:data:`PREFIX`), written ``rq``. Ids minted before codes keep their keys
under ``{rq}`` (:func:`request_prefix`).

=============================  ======  ==============================  ==================
key                            type    TTL                             written by
=============================  ======  ==============================  ==================
P:req:{id}                     hash    none; retention once COMPLETED  admit/claim/cancel/
                                                                       complete.lua
P:result:{id}                  string  retention                       complete.lua
P:body:{id}                    string  none; deleted once it succeeded admit.lua (its native body)
                                       retention once it failed (a
                                       retry submits it again)
P:deadlines:{provider}         zset    none (members leave when the    admit.lua; claim/cancel/
                                       request no longer needs them)   complete/expire_queued
P:queue:{provider}             zset    none (members leave on claim,   admit/claim/cancel
                                       cancel or completion)           .lua
P:seq:{provider}               string  none (INCR counter)             admit.lua
P:running:{provider}           zset    none (members leave on          lib.lua (grant),
                                       completion)                     claim/renew/complete/
                                                                       reap/purge.lua
P:sched:{provider}             hash    none (scheduler state)          lib.lua (the schedule)
P:sched:{provider}:slots       zset    none (the fair order)           lib.lua
P:sched:{provider}:heads       zset    none (each workspace's first    lib.lua
                                       slot, unless it is parked)
P:sched:{provider}:ws:{ws}     zset    none (a workspace's waiting)    lib.lua
P:sched:{provider}:wslots:{ws} zset   none (a workspace's slots)      lib.lua
P:sched:{provider}:granted     zset    none (granted, not started)     lib.lua, claim.lua
P:sched:{provider}:depths      zset    none (waiting per workspace)    lib.lua
P:stats:{provider}             hash    none (pace, and the ops page's  complete.lua
                                       completion totals)
W:idem:{keyhash}               string  IDEMPOTENCY_TTL_SECONDS         admit.lua
W:ws                           hash    none                            cli (accounts.py)
rq:workspaces                  set     none (all workspace ids)        cli (accounts.py)
W:open                         hash    none (fields leave once owed    admit.lua, ws_settle
                                       nothing: split stores only)     .lua
P:owed:{provider}              zset    none (members leave once        lib.lua (owe_ws),
                                       applied: split stores only)     owed.py
P:admitting:{provider}         zset    none (members leave when        admission.py,
                                       placed or given up: split       admit_place.lua
                                       stores only)
W:ledger                       stream  none (append-only)              lua/lib.lua (settle),
                                                                       admit.lua (hold)
rq:apikey:{sha256(key)}        string  none; a rotated-out key's ends  key_*.lua (apikeys.py)
                                       with its overlap (value: the
                                       workspace id, "-" for a legacy key)
rq:key:{key                    id}                hash    as its rq:apikey (what an       key_*.lua; key_resolve
                                       operator sees of a key)         .lua (last_used_at)
rq:keys:{workspace}            zset    none (its key ids, scored by    key_*.lua
                                       when each stops: +inf, or its
                                       rotation's end)
rq:keyaudit:{workspace}        list    none (its last key changes,     key_*.lua
                                       JSON, newest first, capped)
rq:config:keys-indexed         string  none (keys minted before the    apikeys.py
                                       index are indexed: done)
rq:config:id-secret            string  none                            ids.py (SET NX)
rq:config:layout               string  none ("2": a tag per family)    accounts.py (with the
                                                                       first workspace),
                                                                       migrate.py
rq:config:epoch                string  none (the data's epoch marker,  accounts.py (SET NX,
                                       written with the first          with a workspace),
                                       workspace)                      epoch.py
W:rate:{limits item key}       string  a window (INCR, PEXPIRE)        rate.lua, admit.lua,
                                                                       rate_add.lua
rq:draining                    set     none (earlier versions' draining  earlier versions
                                       providers: moved by the sweeper
                                       to P:sched:{provider})
rq:fleet:workers               zset    none (worker names by their     fleet.py (heartbeats)
                                       last heartbeat; trimmed to the
                                       last hour)
rq:fleet:worker:{name}         hash    FORGET_AFTER_S from its last    fleet.py (heartbeats)
                                       heartbeat (queues, pid)
P:webhook:{id}                 hash    none while pending; retention   lua/lib.lua
                                       once its request's last event   (owe_*),
                                       is delivered or given up        webhook_*.lua
P:webhook:{id}:next            list    none (deleted once empty)       lua/lib.lua
P:webhook:due:{provider}       zset    none (events owed, scored by    lua/lib.lua,
                                       when to publish them next)      webhook_*.lua
rq:webhooks:due                zset    none (earlier versions' events   webhook_*.lua
                                       of every provider; emptied as
                                       they end)
W:webhooks:log                 list    none (its last attempts)        webhook_turn_end.lua
rq:webhooks:failing-origins    zset    none; trimmed to the 1,000      webhooks.py (record)
                                       most recent in the last 24 h
                                       ("{ws}|{origin}" by its last
                                       failure)
W:webhooks:circuit:{o}         hash    24 h from its last failure;     webhook_turn.lua,
                                       deleted at a success            webhook_turn_end.lua
W:webhooks:inflight            zset    a lease (attempts running:      webhook_turn.lua,
                                       token by lease end)             webhook_turn_end.lua
rq:webhooks:inflight           zset    none (every workspace's;        webhooks.py (take,
                                       members leave at the record     record)
                                       or their lease's end)
rq:held:{workspace}            zset    a lease (slots lapse unless     held.py (HeldSlots),
                                       renewed)                        held_take.lua
W:history                      stream  retention + 60 s, renewed by    admit.lua (lib.lua,
                                       an admission at most once a     history_add)
                                       minute (rq:ws history_until),
                                       so never less than retention
                                       after the last admission;
                                       entries older than retention
                                       trimmed on admission
W:history:{model}              stream  as W:history       admit.lua
rq:events:{id}                 pubsub  (a channel, not a key)          lua/lib.lua
                                                                       (announce): claim,
                                                                       progress, completion
rq:events:provider:{provider}  pubsub  (positions moved: a grant or a  lua/lib.lua
                                       claim)                          (announce_moved)
=============================  ======  ==============================  ==================

Key record fields (``rq:key:{key id}``; the id is ``key_`` and the first 16
hex digits of the key's SHA-256): ``workspace`` (as the rq:apikey value),
``hash`` (the SHA-256), ``label``, ``created_at``, ``last_used_at`` (written at
most once a minute), ``expires_at`` and ``rotated_to`` (a rotated-out key: when it stops, its successor),
``rotated_from`` (the key it succeeded), ``namespace`` (a legacy key's own
pseudo-workspace, ``legacy:{key id}``, kept across its rotations).
``-`` and ``legacy:{key id}`` are pseudo-workspaces: they appear where a
workspace id does (rq:keys:-, rq:idem:legacy:…, the schedule), never in rq:workspaces.

Workspace hash fields: ``name queue_enabled credits held queued max_queued
rate_limit weight max_in_flight created_at`` (``credits`` is the balance; ``held`` the sum of
open holds; ``queued`` how many of its requests wait IN_QUEUE), and its quotas
(``store/quotas.py``): ``queued_bytes`` (the bodies stored for its requests not
yet completed; admit.lua adds, lib.lua's ``give_back_body`` gives back) under
``max_queued_bytes``; ``webhooks_pending`` (requests admitted with a webhook
whose last event is not yet delivered or given up, however many events each
chose; admit.lua adds, lib.lua's ``webhook_ended`` gives back) under
``max_pending_webhooks``; ``history_until`` and ``history_until|{model}``
(until when its history streams last: admit.lua renews them when an
admission finds less than the retention left, at most once a minute); ``max_held``
(the cap on ``rq:held:{workspace}``, its synchronous calls and event streams
held open, whose members are slot ids scored by when their lease lapses).
Request hash field ``open`` (a split store's: admitted with an entry in
``W:open``, which makes each of its workspace effects count once;
``store/owed.py``). Request hash fields for them: ``body_bytes`` (counted in ``queued_bytes``,
zeroed when given back) and ``webhook_counted`` (at its completion, copied to
its event being delivered as ``counted``, dropped when its last event ends).

Request hash fields: ``id workspace model provider status body seq
created_at started_at completed_at error_type detail content_type
cancel_requested idem token holder successor handed_back lease_until takeovers
attempts upstream_ref priority granted_at start_deadline_at deadline_at
retry_of cancel_detail hold charged traceparent`` (``traceparent``: the submit's W3C trace
context, written by admit.lua only while tracing is on, read by the workers' spans;
``start_deadline_at``, ``deadline_at``: the
caller's X-Comfy-Start-Deadline and X-Comfy-Deadline as Unix seconds, each also
a member of ``P:deadlines:{provider}``, "start|{id}" or "run|{id}", scored by
it; ``retry_of``: the failed request it submits again; ``cancel_detail``: what
a running request's cancellation will say, the first cancel's reason; ``hold``:
credits held at admission, zeroed when settled; ``charged``: what was charged)
(timestamps are Unix seconds as decimal strings; ``token`` is unique to the
execution holding the lease, ``holder`` its "{Celery task id}:{retries}";
``successor`` the resume key of the retry a holder kept its lease for;
``upstream_ref`` is the provider's own handle on a submitted generation, JSON,
so a new worker resumes instead of resubmitting).
``P:queue:{provider}`` holds every IN_QUEUE request scored by the ``P:seq``
admission sequence: depth, oldest wait and queue timeouts read it.
``P:running:{provider}`` holds the requests that have a provider slot: the
running ones, scored by lease expiry, and the granted ones not yet started,
scored by when their grant must have been claimed (``REPUBLISH_AFTER_SECONDS``
after it). Its size is the provider's count in flight (the fleet-wide cap);
members past expiry are requests whose worker died or whose message was lost:
the reaper publishes them again.
Request hash fields for webhooks (admit.lua): ``webhook_url`` (the request's
own, else its workspace's default; absent: no webhook) and
``webhook_response_url``. Workspace hash fields for them (accounts.py):
``webhook_url`` (the default), ``webhook_events`` (the default events,
canonical), ``webhook_secret``, ``webhook_secret_previous`` and
``webhook_previous_until`` (when the previous secret stops signing).
Request hash fields for the events (admit.lua, lua/lib.lua): ``webhook_events`` (the
events chosen, canonical "started,progress,completed" or a subset; absent:
"completed"), ``webhook_progress_n`` and ``webhook_progress_at`` (progress events
owed so far, and when the last was: the throttle), ``webhook_final`` (it
completed: no more events will be owed).
``P:webhook:{id}`` is the request's event being delivered (a request's events go
one at a time), snapshotted when it was owed:
``request_id url response_url workspace model type msg_id status error_type
created_at started_at completed_at progress owed_at`` (what the body is built
from; ``type`` started, progress or completed, absent on events owed before there
were others: completed; ``msg_id`` its webhook-id), ``counted`` (the request
completed and holds its workspace's pending count until this event, its last,
ends), and the
delivery's state: ``state`` (pending, delivered, gone: the receiver answered
410, given_up), ``attempts``, ``first_attempt_at``, ``next_at`` (no attempt
before it), ``lease_until`` and ``token`` (the attempt running now),
``last_status``, ``last_error``, ``done_at``, ``waits`` (times in a row it waited its
workspace's turn or an open circuit; its next wait doubles). ``P:webhook:due:{provider}`` holds every
pending event's request id scored by when beat's sweeper publishes it: its
next attempt, or the end of a running attempt's lease (a killed worker's
event comes back then). ``P:webhook:{id}:next`` holds the request's events owed
behind the one being delivered, oldest first, each the JSON object of those
same snapshot fields; the first takes the hash's place when its event ends.
Webhook endpoints are a workspace's URL origins (``scheme://host[:port]``: never a
path or query, which often carry a receiver's token). ``W:webhooks:circuit:{o}``
(``{o}`` the origin) fields: ``failures`` (in a row), ``open_until`` (no attempt
before it once ``failures`` reached ``WEBHOOK_CIRCUIT_FAILURES``), ``probe_until`` (the lease of the one attempt let
through to probe it), ``last_failure_at``. ``W:webhooks:inflight`` holds the tokens
of the workspace's attempts running now, at most ``WEBHOOK_MAX_IN_FLIGHT_PER_WORKSPACE``;
``rq:webhooks:inflight`` the same tokens for every workspace (the in-flight gauge). The
hash ``rq:webhooks:failing`` of earlier versions (whole URLs) is no longer written.
``W:history`` is a stream of the workspace's requests admitted
within the retention window, for ``GET /v2/requests``: each entry's stream id
is its admission time in ms (and a sequence), its one field ``i`` the
request id packed into 16 bytes. ``W:history:{model}`` (for
``GET /v2/models/{model}/requests``) has an empty entry under the same stream
id for each of that model's. admit.lua writes both with the record, so
nothing admitted is missing from the list.
Request hash fields for the cost (lib.lua's ``settle``, in the step that
writes the ledger's entry): ``cost_state`` (``charged`` or ``released``;
absent while held) and ``price`` (what the hold was).
``P:sched:{provider}`` and the keys under it are the fair schedule of the
requests waiting for a slot (the policy is written down in ``lua/lib.lua``).
Its hash fields: ``vtime`` (the tag granted last), ``slotseq`` and ``grantseq``
(counters), and per workspace ``f|{ws}`` (its last slot's tag), ``run|{ws}``
(its requests holding a slot), ``parked|{ws}`` (at its own max_in_flight) and
``lim|{ws}`` ("{weight}:{max_in_flight}", the workspace's limits copied from its
hash while it has requests waiting, so a grant reads only the provider's keys), and
``draining`` ("1" while the provider admits nothing new: ``ops drain``).
``:slots`` members are "{slot seq, 15 digits}|{ws}", scored by virtual-time
tag; ``:wslots:{ws}`` the same members of one workspace; ``:ws:{ws}`` its
waiting request ids scored by priority band * 2^45 + admission sequence;
``:heads`` each workspace's first slot (same member and tag), unless the
workspace is at its own max_in_flight; ``:granted`` ids granted and not started, in grant order; ``:depths``
workspaces scored by how many requests they have waiting.
``lua/lib.lua`` builds the per-workspace keys from the ``P:sched:{provider}``
key it is given, and the keys of the workspaces and requests the schedule names
(the schedule picks them, so no caller can pass them) from ``KEY_*``, the prefixes
:data:`LUA_LAYOUT` generates from the functions below.
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
#: The store's key layout: 2, a hash tag per family (the provider's, the
#: workspace's, the global one); stores written with one tag for everything
#: have none (``migrate.py`` moves them).
LAYOUT = "2"

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
    the provider's code: a version-9 id, ``ids.py``); an id minted before
    (version 8) keeps the global tag its keys were written under."""
    return code_tag(request_id[-2:]) if request_id[14:15] == "9" else PREFIX


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
    by when each falls (lua/lib.lua)."""
    return f"{provider_prefix(provider)}:deadlines:{provider}"


def stats(provider: str) -> str:
    return f"{provider_prefix(provider)}:stats:{provider}"


def owed(provider: str) -> str:
    """A split store's workspace effects owed by the provider's steps, not yet
    applied (JSON, by when owed; ``lua/lib.lua``, ``owe_ws``)."""
    return f"{provider_prefix(provider)}:owed:{provider}"


def admitting(provider: str) -> str:
    """A split store's admissions between their workspace's step and their
    provider's (JSON, by write deadline; ``admission.py``)."""
    return f"{provider_prefix(provider)}:admitting:{provider}"


def webhooks_due(provider: str, request_id: str | None = None) -> str:
    """The pending webhook events of a provider's requests, by when to publish
    them (beside its requests: the steps that owe an event write it). With
    ``request_id``: the one that holds the request's event, its provider's,
    or for an id minted before codes the one of the global tag (read by the
    sweeper beside the provider's own until it is empty)."""
    prefix = provider_prefix(provider) if request_id is None else request_prefix(request_id)
    return f"{prefix}:webhook:due:{provider}"


def workspace(workspace_id: str) -> str:
    return f"{workspace_prefix(workspace_id)}:ws"


def idempotency(workspace_id: str, key_hash: str) -> str:
    return f"{workspace_prefix(workspace_id)}:idem:{key_hash}"


def ledger(workspace_id: str) -> str:
    return f"{workspace_prefix(workspace_id)}:ledger"


def open_requests(workspace_id: str) -> str:
    """The workspace's requests whose start, end or pending webhook it has not
    yet been given (a split store's, ``ws_settle.lua``): id -> what is still
    owed, "q", "e" and "w" ("W": a webhook given to a request admitted before
    the store was split)."""
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


def keys_indexed() -> str:
    """Set once every key minted before the key index was indexed."""
    return f"{PREFIX}:config:keys-indexed"


def id_secret() -> str:
    return f"{PREFIX}:config:id-secret"


def epoch() -> str:
    """The token that says this store still holds the data it was set up with."""
    return f"{PREFIX}:config:epoch"


def layout() -> str:
    """The store's key layout (:data:`LAYOUT`), written with its first workspace."""
    return f"{PREFIX}:config:layout"


#: Every request's and provider's event channel: one subscription per process.
EVENTS_PATTERN = f"{PREFIX}:events:*"
#: What follows the prefix on a provider's channel (request ids are UUIDs).
PROVIDER_EVENTS = f"{PREFIX}:events:provider:"


def events_channel(request_id: str) -> str:
    """Pub/sub channel announcing a request changed: started, progressed,
    COMPLETED."""
    return f"{PREFIX}:events:{request_id}"


def legacy_draining() -> str:
    """The set of draining providers earlier versions kept; a provider's mark is
    its schedule's "draining" now (the sweeper moves these there)."""
    return f"{PREFIX}:draining"


def fleet() -> str:
    """The workers heard from, by their last heartbeat."""
    return f"{PREFIX}:fleet:workers"


def fleet_worker(name: str) -> str:
    """What one worker consumes, as its last heartbeat said."""
    return f"{PREFIX}:fleet:worker:{name}"


def one_tag_webhooks_due(provider: str) -> str:
    """Where the events of a provider's requests minted before codes wait
    (their ids keep the global tag): read beside the provider's own until empty."""
    return f"{PREFIX}:webhook:due:{provider}"


def legacy_webhooks_due() -> str:
    """Every provider's pending webhook events, as earlier versions kept them:
    read (and emptied) beside the providers' own until none is left."""
    return f"{PREFIX}:webhooks:due"


def webhooks_failing() -> str:
    """Failing endpoints, "{ws}|{origin}" by their last failure (trimmed)."""
    return f"{PREFIX}:webhooks:failing-origins"


def webhooks_in_flight() -> str:
    """Every webhook attempt running now."""
    return f"{PREFIX}:webhooks:inflight"


def lua_layout() -> str:
    """The Lua definitions ``load_script`` offers every script beside
    ``lua/lib.lua``'s (each script takes those it names): functions building
    the keys a script builds from an id it read (the request the schedule
    names next, an index's members) by the rules written above.
    ``tests/unit/test_keys.py`` holds the Lua to the Python for every kind of id."""
    return f"""local function request_prefix(id)
  if string.sub(id, 15, 15) == "9" then
    return "{{rq-" .. string.sub(id, -2) .. "}}"
  end
  return "{PREFIX}"
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
local function key_workspace(ws)
  return "{{ws:" .. ws .. "}}:ws"
end
local KEY_EVENTS = "{PREFIX}:events:"
local KEY_PROVIDER_EVENTS = "{PROVIDER_EVENTS}"
local KEY_WEBHOOK_NEXT = ":next"
"""
