-- lib.lua: what the scripts share, each written once. load_script
-- (store/scripts.py) puts what a script uses of it (lib_for: the top-level
-- locals it names, and theirs, in this file's order; so define a name before
-- its users) in front of the script, after what it uses of the key layout
-- (key_request, key_webhook, ..., KEY_*: store/keys.py, lua_layout) and the
-- script's argument positions (ARG_*, generated from its names in Python,
-- lua_arg_names). In order:
--   * the workspace's side of a request's start and end (ws_effects,
--     ws_apply, keep_stored) and the record's (give_back_body, drop_body, settle);
--   * the caller's deadlines (forget_deadlines, passed, past_deadline);
--   * pub/sub: telling event streams and held calls what changed (announce*);
--   * rate counting (spend_rate);
--   * the fair schedule behind each provider's cap (enqueue, grant, grant_directly,
--     position);
--   * webhook events, owed in the step that makes the change they report
--     (owe_started, owe_progress, owe_webhook, webhook_ended);
--   * endings several scripts share (finish_unbilled, with_granted);
--   * the history's streams (history_add).
-- Callers pass the workspace hash and its ledger among their KEYS; a key a
-- script only learns by reading (the request the schedule names next, a
-- request's webhook event) is built by the key layout's functions, in the
-- slot of the key it was read from (a request's keys share its provider's).
-- Key names in the scripts' headers are docs/KEYS.md's: P: a provider's
-- family (a request's keys too), W: a workspace's, rq: the global one.

-- Appends its further arguments to the list `fields` (a hash's field-value
-- pairs, collected to be written in one HSET).
local function append(fields, ...)
  for i = 1, select("#", ...) do
    fields[#fields + 1] = (select(i, ...))
  end
end

-- The hash's fields `names` (and `more`, if given) in one HMGET, as a table
-- by name (false for a field the hash lacks).
local function read_fields(key, names, more)
  local all = {unpack(names)}
  for _, name in ipairs(more or {}) do
    all[#all + 1] = name
  end
  local values = redis.call("HMGET", key, unpack(all))
  local byname = {}
  for i, name in ipairs(all) do
    byname[name] = values[i]
  end
  return byname
end

--: The record's fields a request's ending reads (settle, give_back_body,
--: forget_deadlines, owe_webhook), read once by whatever ends it.
local ENDING_FIELDS = {"hold", "cost_state", "price", "body_bytes", "start_deadline_at", "deadline_at",
  "webhook_url", "webhook_events", "webhook_counted", "webhook_final", "body_of", "provider"}

-- ---------------------------------------------------------------------------
-- What a request gives back to its workspace when it starts (it no longer
-- waits) and when it ends (its hold settled, its body's bytes, its pending
-- webhook): its workspace effects, a table collected by the step that makes
-- the change and applied by ws_apply in one read and one write of the
-- workspace's hash (and the ledger's entry). The request's own side of each
-- (hold and body_bytes zeroed, the event's "counted" dropped) is written in
-- the same step by that step, so each effect is owed once however many
-- endings race. The two sides are apart so that they can live in different
-- Redis Cluster slots, the workspace's effects applied by a step of their own.
--   queued     its requests that left the queue (1)
--   bytes      body bytes given back to its queued_bytes quota
--   hold, how  credits held for the request, settled: "charge" | "release"
--   webhooks   its requests whose last webhook event ended (1)
--   kept       a body kept past its request's end, counted in its stored
--              bytes until it expires (drop_body, keep_stored)
--   result     a success's result (its bytes, Redis's or the object
--              store's), counted in its stored bytes until its record
--              expires (complete.lua, keep_result)
--   request_id, at   the ledger entry's request and time
-- ---------------------------------------------------------------------------

local function ws_effects(request_id, now)
  return {request_id = request_id, at = now}
end

--: The workspace's counts an effect gives back (never below 0), by effect.
local WS_COUNTS = {{"queued", "queued"}, {"bytes", "queued_bytes"}, {"webhooks", "webhooks_pending"}}

-- A kept body (kept: {ws, id: the body's request, bytes, untl: when it
-- expires}) in its workspace's stored bytes (W:stored, the hash's
-- stored_bytes): counted once however many requests share it, its expiry
-- moved to the latest (a body is one member, "{id}|{bytes}").
local function keep_stored(ws_key, kept)
  if redis.call("ZADD", key_stored(kept.ws), kept.untl, kept.id .. "|" .. kept.bytes) == 1 then
    redis.call("HINCRBY", ws_key, "stored_bytes", kept.bytes)
  end
end

--: Seconds of expiry one W:stored member of results spans: a workspace's
--: results counted per minute ("r:{minute's end}|{bytes}"), not one member
--: each, so W:stored holds at most a day's minutes of them. A result's bytes
--: are released at the end of the minute its record expires in (late, never early).
local RESULT_BUCKET_S = 60

-- A result (result: {ws, bytes, untl: when its record expires}) in its
-- workspace's stored bytes, in its minute's member, whose bytes grow by it
-- (the member replaced: its name holds its bytes). Never refused: a result
-- may carry its workspace over its quota; the next admission then waits.
local function keep_result(ws_key, result)
  local stored = key_stored(result.ws)
  local untl = math.ceil(tonumber(result.untl) / RESULT_BUCKET_S) * RESULT_BUCKET_S
  local bytes = tonumber(result.bytes)
  local prefix = "r:" .. untl .. "|"
  for _, member in ipairs(redis.call("ZRANGEBYSCORE", stored, untl, untl)) do
    if string.sub(member, 1, #prefix) == prefix then
      bytes = bytes + tonumber(string.sub(member, #prefix + 1))
      redis.call("ZREM", stored, member)
    end
  end
  redis.call("ZADD", stored, untl, prefix .. bytes)
  redis.call("HINCRBY", ws_key, "stored_bytes", result.bytes)
end

-- The bytes of a W:stored member ("{id}|{bytes}").
local function stored_bytes_of(member)
  return tonumber(string.match(member, "|(%d+)$")) or 0
end

--: Most expired kept bodies and result minutes released from the count per admission.
local RELEASE_BATCH = 500

-- Release the kept bodies and results that have expired by `now` from the workspace's
-- stored bytes (W:stored, the hash's stored_bytes): admission's workspace
-- step does it before it reads the count, so the count it checks is exact.
local function release_stored(stored_key, ws_key, now)
  local gone = redis.call("ZRANGEBYSCORE", stored_key, "-inf", now, "LIMIT", 0, RELEASE_BATCH)
  if #gone == 0 then
    return
  end
  local bytes = 0
  for _, member in ipairs(gone) do
    bytes = bytes + stored_bytes_of(member)
  end
  redis.call("ZREM", stored_key, unpack(gone))
  if redis.call("HINCRBY", ws_key, "stored_bytes", -bytes) < 0 then
    redis.call("HSET", ws_key, "stored_bytes", 0)
  end
end

--: The longest Retry-After a full stored-bytes quota names (s).
local STORED_WAIT_MAX_S = 3600

-- Seconds until enough of the workspace's kept bodies and results expire to free `over`
-- bytes (the earliest first), at least 1, at most STORED_WAIT_MAX_S.
local function stored_wait(stored_key, over, now)
  local entries = redis.call("ZRANGE", stored_key, 0, RELEASE_BATCH - 1, "WITHSCORES")
  local freed = 0
  for i = 1, #entries, 2 do
    freed = freed + stored_bytes_of(entries[i])
    if freed >= over then
      return math.min(math.max(math.ceil(tonumber(entries[i + 1]) - now), 1), STORED_WAIT_MAX_S)
    end
  end
  return STORED_WAIT_MAX_S
end

-- Append an entry (its field-value pairs: ...) to a workspace's ledger under
-- the ms of `at` (Unix s, the step's time), or the last entry's ms when that
-- is later (a clock behind another process's): its ids read as its times
-- (``workspace ledger --since``). With `keep` (s), entries older than `keep`
-- before `at` go in the same command: MINID ~ drops whole stream nodes only,
-- so a write's trim is bounded (a node's worth of older entries may stay).
local function ledger_add(ledger, at, keep, ...)
  local ms = math.floor(tonumber(at) * 1000)
  local args = {ledger}
  if keep then
    append(args, "MINID", "~", string.format("%.0f", math.max(0, ms - tonumber(keep) * 1000)))
  end
  local at_id = #args + 1
  append(args, string.format("%.0f-*", ms), ...)
  local added = redis.pcall("XADD", unpack(args))
  if type(added) == "table" and added.err then
    local last = redis.call("XREVRANGE", ledger, "+", "-", "COUNT", 1)[1]
    args[at_id] = string.match(last[1], "^%d+") .. "-*"
    redis.call("XADD", unpack(args))
  end
end

-- Apply effects `e` to the workspace's hash (ws_key) and, for a settled
-- hold, its ledger (ledger_key): a count alone is one HINCRBY; anything more
-- one HMGET and one HSET, with the values HINCRBY would have left.
local function ws_apply(ws_key, ledger_key, e)
  if e.kept then
    keep_stored(ws_key, e.kept)
  end
  if e.result then
    keep_result(ws_key, e.result)
  end
  local names, deltas = {}, {}
  for _, pair in ipairs(WS_COUNTS) do
    local n = e[pair[1]]
    if n and n > 0 then
      names[#names + 1] = pair[2]
      deltas[#deltas + 1] = n
    end
  end
  local hold = e.hold or 0
  if hold <= 0 and #names <= 1 then
    if names[1] and redis.call("HINCRBY", ws_key, names[1], -deltas[1]) < 0 then
      redis.call("HSET", ws_key, names[1], 0)
    end
    return
  end
  local counts = #names
  if hold > 0 then
    append(names, "held", "credits")
  end
  local v = redis.call("HMGET", ws_key, unpack(names))
  local fields = {}
  for i = 1, counts do
    append(fields, names[i], math.max(tonumber(v[i] or "0") - deltas[i], 0))
  end
  if hold > 0 then
    local held = tonumber(v[counts + 1] or "0") - hold
    local credits = tonumber(v[counts + 2] or "0")
    append(fields, "held", held)
    if e.how == "charge" then
      credits = credits - hold
      append(fields, "credits", credits)
    end
    ledger_add(ledger_key, e.at, nil, "type", e.how, "request_id", e.request_id, "amount", hold,
      "balance", credits, "held", held, "at", e.at)
  end
  redis.call("HSET", ws_key, unpack(fields))
end

-- Where a step's workspace effects go (owe_ws), set in `k`, the step's keys:
-- the workspace's hash and ledger (k.ws, k.ledger), applied in the step; or,
-- on a store split into per-slot steps (split "1"), the provider's owed set
-- (k.owed: keys.py, P:owed:{provider}, given in their place), applied by
-- the workspace's own step (ws_settle.lua) once the caller has the reply, or
-- by the sweeper for a caller that died first.
local function ws_target(k, ws_key, ledger_key, split)
  if split == "1" then
    k.owed = ws_key
  else
    k.ws, k.ledger = ws_key, ledger_key
  end
  return k
end

--: The effects this step owed (JSON), returned to its caller (with_granted).
local OWED = {}

-- Give the workspace effects `e` of the request's `kind` ("start" | "end" |
-- "webhook": its last webhook event ended after it did) to its workspace
-- (k.ws_id): at once, or owed (ws_target). An owed end is owed even when it
-- gives nothing back: it closes the request's open entry.
local function owe_ws(k, e, kind)
  if not k.owed then
    ws_apply(k.ws, k.ledger, e)
    return
  end
  e.ws, e.kind = k.ws_id, kind
  local owed = cjson.encode(e)
  redis.call("ZADD", k.owed, e.at, owed)
  OWED[#OWED + 1] = owed
end

-- The request's body is no longer queued (it completed, whatever ended it):
-- its bytes go back to the workspace (e.bytes), and the record's body_bytes
-- is zeroed in the same step (appended to `fields`, the caller's one HSET),
-- as settle() zeroes the hold, so no second ending gives them back twice; a
-- request admitted before bodies were counted has none. rec: the record's
-- ENDING_FIELDS. The caller then deletes the body (drop_body).
local function give_back_body(rec, fields, e)
  local bytes = tonumber(rec.body_bytes or "0")
  if bytes > 0 then
    append(fields, "body_bytes", 0)
    e.bytes = bytes
  end
end

--: What P:body:{id} begins with when the body is in the object store
--: (blobs/pointers.py, BodyPointer): "\0obj {size} {sha256} {object key}".
--: A JSON body never begins with a NUL.
local BODY_POINTER = "\0obj "

-- The bytes a body's text stands for: a pointer's size, else its length.
local function body_size(text)
  if string.sub(text, 1, #BODY_POINTER) == BODY_POINTER then
    return tonumber(string.match(text, "^(%d+) ", #BODY_POINTER + 1))
  end
  return #text
end

-- The bytes the body under `key` stands for (0: none), and its pointer
-- text when it is in the object store (else nil).
local function stored_body(key)
  if redis.call("GETRANGE", key, 0, #BODY_POINTER - 1) == BODY_POINTER then
    local pointer = redis.call("GET", key)
    return body_size(pointer), pointer
  end
  return redis.call("STRLEN", key), nil
end

-- A body's object (pointer: its P:body text) handed to the sweeper, to be
-- deleted once the pointer is gone (store/objects.py): at `at`, when the
-- pointer expires or (now) was deleted. `id`: the body's request.
local function forget_body_object(pointer, id, provider, at)
  local object = string.match(pointer, "^%d+ %x+ (.+)$", #BODY_POINTER + 1)
  redis.call("ZADD", key_objects(id, provider), at, id .. " " .. object)
end

-- The body of a request that ended (rec: its ENDING_FIELDS): deleted when it
-- succeeded (keep false) and shares no one's, else kept `retention` seconds,
-- no longer counted as queued but in its workspace's stored bytes (e.kept:
-- keep_stored, with ws_id). A retry shares the body of the first request
-- of its chain (its record's body_of; P:body:{that id}), which lives on
-- while any retry sharing it waits or runs (its refs' "live", PERSISTed by
-- place_admission), then the retention after the last of them ends, so it
-- outlives every record naming it. A body in the object store (a pointer)
-- counts its object's bytes, and its object goes to the sweeper, due when
-- the pointer goes (forget_body_object).
local function drop_body(body_key, retention, keep, rec, e, ws_id, now)
  local owner = rec.body_of
  if owner then
    body_key = key_body(owner)
    local refs = key_body_refs(owner)
    if redis.call("HINCRBY", refs, "live", -1) > 0 then
      return  -- another retry sharing it still waits or runs
    end
    redis.call("EXPIRE", refs, retention)
  end
  local bytes, pointer = stored_body(body_key)
  local id, untl = owner or e.request_id, tonumber(now) + tonumber(retention)
  if not owner and not keep then
    redis.call("DEL", body_key)
    untl = tonumber(now)
  elseif bytes > 0 then
    redis.call("EXPIRE", body_key, retention)
    e.kept = {ws = ws_id, id = id, bytes = bytes, untl = untl}
  end
  if pointer and rec.provider then
    forget_body_object(pointer, id, rec.provider, untl)
  end
end

-- The caller's deadlines (admit.lua records them): X-Comfy-Start-Deadline
-- ends a request not started by then queue_timeout (claim.lua at once,
-- expire_queued.lua from the sweeper); X-Comfy-Deadline cancels one not
-- completed by then, as the cancel route would (cancel.lua from the sweeper,
-- claim.lua at once). Each is a member of P:deadlines:{provider} ("start|id",
-- "run|id") scored by when it falls, until the request no longer needs it.
local START_DEADLINE_DETAIL =
  "not started by its start deadline (X-Comfy-Start-Deadline); never run, never billed"
local DEADLINE_DETAIL = "cancelled: its deadline (X-Comfy-Deadline) passed before it completed"

-- rec: the record's ENDING_FIELDS; a request admitted with neither deadline
-- has no member to forget (admit.lua writes each field with its member).
local function forget_deadlines(deadlines_key, request_id, rec)
  if deadlines_key and (rec.start_deadline_at or rec.deadline_at) then
    redis.call("ZREM", deadlines_key, "start|" .. request_id, "run|" .. request_id)
  end
end

-- Whether a deadline (a record field, Unix seconds, or false) has passed by now.
local function passed(value, now)
  if not value then
    return false
  end
  local at = tonumber(value)
  return at ~= nil and tonumber(now) > at
end

-- Settle the credits held for a request at admission, once: "charge" turns
-- the hold into a charge (the provider billed us), "release" gives it back
-- (e.hold and e.how: ws_apply moves the workspace's held and credits and
-- writes the ledger's entry). The record's hold is zeroed in the same step,
-- so retries, duplicate deliveries and racing completions can never settle
-- twice. The caller's "cost" is held while the record has no cost_state
-- (nothing is written for it at admission: a waiting request costs no more
-- memory); here it becomes "charged" or "released", with the price the hold
-- was, in the same step as the ledger's entry, so the two always agree; a
-- free request (price 0) settles too, with no ledger entry. rec: the
-- record's ENDING_FIELDS; its fields to write are appended to `fields`,
-- which the caller writes in the same step (one HSET with its own).
local function settle(e, how, rec, fields)
  local hold = tonumber(rec.hold or "0")
  if rec.cost_state ~= "charged" and rec.cost_state ~= "released" then
    append(fields, "cost_state", how == "charge" and "charged" or "released")
    if not rec.price then  -- admitted before the price was kept: what it held is its price
      append(fields, "price", hold)
    end
  end
  if hold <= 0 then
    return
  end
  append(fields, "hold", 0)
  if how == "charge" then
    append(fields, "charged", hold)
  end
  e.hold, e.how = hold, how
end


-- Tell whoever follows this request (a held synchronous call, an event
-- stream) that it changed: "IN_PROGRESS", "PROGRESS" or "COMPLETED". They
-- read its status again. The channel is keys.events_channel() in keys.py.
local function announce(request_id, what)
  redis.call("PUBLISH", KEY_EVENTS .. request_id, what)
end

local function announce_completed(request_id)
  announce(request_id, "COMPLETED")
end

local function announce_changed(request_id)
  announce(request_id, "PROGRESS")
end

-- Tell the event streams of a provider's waiting requests that positions
-- moved (a slot was granted or a granted request started): they read their
-- position again, each at most once a second (router_queue/web/stream.py).
local function announce_moved(sched_base)
  redis.call("PUBLISH", KEY_PROVIDER_EVENTS .. string.match(sched_base, ":sched:(.+)$"), "MOVED")
end

-- True when a write arrives past the deadline its caller gave it (ARGV, Unix
-- seconds; "" for none), by Redis's own clock: the caller has stopped
-- waiting and told its client the write failed, so it must not happen now.
local function past_deadline(deadline)
  if deadline == nil or deadline == "" then
    return false
  end
  local t = redis.call("TIME")
  return tonumber(t[1]) + tonumber(t[2]) / 1000000 > tonumber(deadline)
end

-- Count this call in the caller's fixed rate windows (ratelimit.py): the
-- counters are KEYS[first_key] onwards, each one's (limit, window seconds) a
-- pair in ARGV from first_arg. Every window counts the call until one is
-- found spent; returns nil when allowed, else {that window's index, ms left}.
local function spend_rate(first_key, first_arg)
  local i = 0
  while KEYS[first_key + i] do
    local key = KEYS[first_key + i]
    local window = ARGV[first_arg + 2 * i + 1]
    local count = redis.call("INCR", key)
    if count == 1 then
      redis.call("EXPIRE", key, window)
    end
    if count > tonumber(ARGV[first_arg + 2 * i]) then
      local left = redis.call("PTTL", key)
      if left < 0 then  -- a counter left without its expiry: start its window now
        redis.call("EXPIRE", key, window)
        left = tonumber(window) * 1000
      end
      return {i + 1, left}
    end
    i = i + 1
  end
  return nil
end

-- ---------------------------------------------------------------------------
-- The schedule behind a provider's cap (keys.py, "P:sched:{provider}").
--
-- Waiting costs nothing: a request that cannot start has no Celery message.
-- When a slot is free, grant() moves the request the schedule names next into
-- P:running:{provider} (the slot is its from then on) and pushes one Celery
-- message for it; a worker's claim starts it. Every script that frees a slot
-- or adds a waiting request ends with grant().
--
-- The order is start-time fair queuing over workspaces. Each waiting request
-- holds a slot in the provider's order, a member of {base}:slots scored by a
-- virtual-time tag: a workspace of weight w that queues a request gets the tag
-- max(vtime, its last tag) + QUANTUM / w, where vtime is the tag of the slot
-- granted last. Slots are granted lowest tag first (ties: the older slot).
-- So workspaces take turns in proportion to their weights, a workspace alone
-- gets every slot, and a workspace that was idle starts at the current round
-- with no credit saved up. A workspace's slots go to its own requests in
-- priority order, FIFO within a priority ({base}:ws:{ws}).
--
-- grant() picks from {base}:heads, each workspace's first slot (its lowest
-- tag), so the next slot is one ZRANGE whatever the depth. A workspace at its
-- own max_in_flight is parked: its head leaves {base}:heads until one of its
-- requests ends, when it comes back with its old tag, so it takes its next
-- slot at once (max-min fair: it only ever had less than its share). Parking
-- and unparking are O(log n): the slots themselves stay where they are.
--
-- S, the scheduler's context: base ("P:sched:{provider}"), running
-- (P:running:{provider}), cap, now, grant_until (lease of a grant not yet
-- claimed: the reaper publishes it again after that), list (the broker's
-- list for the provider) and template (its Celery message with RQTPLREQ,
-- RQTPLTASK and RQTPLTAG standing for the request id, task id and delivery
-- tag), or template "" when the caller publishes the granted ids itself.
-- ---------------------------------------------------------------------------

--: Virtual time one request of a weight-1 workspace takes; divisible by 1..16.
local QUANTUM = 720720
--: Priority bands within a workspace, scored band * BAND_SPAN + admission seq.
local BANDS = {high = 0, normal = 1, low = 2}
local BAND_SPAN = 35184372088832  -- 2^45

local function num(x)
  return string.format("%.17g", x)
end

local function workspace_of_slot(member)
  return string.sub(member, 17)  -- "%015d|{ws}"
end

local function sched_ctx(base, running, list, cap, now, grant_until, template)
  return {base = base, running = running, list = list, cap = tonumber(cap), now = now,
          grant_until = grant_until, template = template, limits = {}}
end

-- A workspace's weight (>= 1) and its own cap on requests in flight per
-- provider (0: none), from its hash's "weight" and "max_in_flight" (v1, v2:
-- strings, or false when absent).
local function limits_of(v1, v2)
  return {math.max(tonumber(v1 or "1") or 1, 1), tonumber(v2 or "0") or 0}
end

-- The workspace's weight and its own cap (limits_of), read once per script.
-- A caller that read them from the workspace's hash puts them in S.limits
-- first (admit.lua); any other step reads the copy the schedule keeps while
-- the workspace has requests waiting ("lim|ws", written by enqueue from
-- admission's reading and by accounts.py when an operator changes them), so
-- granting reads nothing outside the provider's own keys. A workspace found
-- waiting with no copy queued before the schedule kept one: its own hash.
local function ws_limits(S, ws)
  local known = S.limits[ws]
  if not known then
    local copy = redis.call("HGET", S.base, "lim|" .. ws)
    if copy then
      known = limits_of(string.match(copy, "^([^:]*):(.*)$"))
    else
      local v = redis.call("HMGET", key_workspace(ws), "weight", "max_in_flight")
      known = limits_of(v[1], v[2])
    end
    S.limits[ws] = known
  end
  return known[1], known[2]
end

-- The workspace's first slot, as a {member, tag} pair, or nil when it has none.
local function first_slot(S, ws)
  local head = redis.call("ZRANGE", S.base .. ":wslots:" .. ws, 0, 0, "WITHSCORES")
  if #head == 0 then
    return nil
  end
  return head
end

local function park(S, ws)
  local head = first_slot(S, ws)
  if head then
    redis.call("ZREM", S.base .. ":heads", head[1])
  end
  redis.call("HSET", S.base, "parked|" .. ws, "1")
end

local function unpark(S, ws)
  redis.call("HDEL", S.base, "parked|" .. ws)
  local head = first_slot(S, ws)
  if head then
    redis.call("ZADD", S.base .. ":heads", head[2], head[1])
  end
end

-- A new waiting request takes the next slot of its workspace.
local function enqueue(S, ws, request_id, seq, priority)
  local base = S.base
  local weight, cap = ws_limits(S, ws)
  local v = redis.call("HMGET", base, "vtime", "f|" .. ws)
  local tag = math.max(tonumber(v[1] or "0"), tonumber(v[2] or "0")) + math.floor(QUANTUM / weight)
  local member = string.format("%015d|", redis.call("HINCRBY", base, "slotseq", 1)) .. ws
  redis.call("HSET", base, "f|" .. ws, num(tag), "lim|" .. ws, weight .. ":" .. cap)
  redis.call("ZADD", base .. ":slots", num(tag), member)
  redis.call("ZADD", base .. ":wslots:" .. ws, num(tag), member)
  if redis.call("ZCARD", base .. ":wslots:" .. ws) == 1 and redis.call("HEXISTS", base, "parked|" .. ws) == 0 then
    redis.call("ZADD", base .. ":heads", num(tag), member)
  end
  redis.call("ZADD", base .. ":ws:" .. ws, num((BANDS[priority] or 1) * BAND_SPAN + seq), request_id)
  redis.call("ZINCRBY", base .. ":depths", 1, ws)
end

-- A workspace with nothing left waiting keeps no tag; once no workspace
-- waits, no tag exists and virtual time starts again from 0 (tags are exact
-- integers in a double: this keeps them far from 2^53).
local function forget_workspace_if_idle(S, ws)
  if tonumber(redis.call("ZINCRBY", S.base .. ":depths", -1, ws)) <= 0 then
    redis.call("ZREM", S.base .. ":depths", ws)
    redis.call("HDEL", S.base, "f|" .. ws, "parked|" .. ws, "lim|" .. ws)
    if redis.call("ZCARD", S.base .. ":depths") == 0 then
      redis.call("HDEL", S.base, "vtime")
    end
  end
end

-- A waiting (not granted) request leaves the schedule: cancelled or timed out.
-- Its workspace gives back its last slot, so the requests behind it move up.
local function dequeue_waiting(S, ws, request_id)
  if redis.call("ZREM", S.base .. ":ws:" .. ws, request_id) == 0 then
    return false
  end
  local wslots = S.base .. ":wslots:" .. ws
  local last = redis.call("ZPOPMAX", wslots)
  if #last > 0 then
    redis.call("ZREM", S.base .. ":slots", last[1])
    redis.call("ZREM", S.base .. ":heads", last[1])  -- it was the head only when it was the only slot
    local now_last = redis.call("ZRANGE", wslots, -1, -1, "WITHSCORES")
    if #now_last > 0 then
      redis.call("HSET", S.base, "f|" .. ws, now_last[2])
    end
  end
  forget_workspace_if_idle(S, ws)
  return true
end

-- A request leaves P:running (it ended, or a grant ended unclaimed): its
-- workspace has one fewer in flight and may be unparked. True when it held a
-- slot. `started`: it is IN_PROGRESS, so claim.lua already took it out of
-- :granted, in the step that started it (nothing grants a started request).
local function release_slot(S, ws, request_id, started)
  if redis.call("ZREM", S.running, request_id) == 0 then
    return false
  end
  if not started then
    redis.call("ZREM", S.base .. ":granted", request_id)
  end
  local counts = redis.call("HMGET", S.base, "run|" .. ws, "parked|" .. ws)
  local left = tonumber(counts[1] or "0") - 1
  if left <= 0 then
    redis.call("HDEL", S.base, "run|" .. ws)
  else
    redis.call("HINCRBY", S.base, "run|" .. ws, -1)
  end
  if counts[2] then
    local _, limit = ws_limits(S, ws)
    if limit <= 0 or left < limit then
      unpark(S, ws)
    end
  end
  return true
end

-- A request ends while IN_QUEUE: out of the schedule, or out of its granted slot.
local function leave_schedule(S, ws, request_id)
  if not release_slot(S, ws, request_id) then
    dequeue_waiting(S, ws, request_id)
  end
end

-- The request (IN_QUEUE, out of the schedule's waiting structures) takes a
-- slot in P:running: it is granted, in grant order, counted in its
-- workspace's run|ws, and its Celery message pushed (S.template), else its
-- id added to `granted` for the caller to publish. `record`, when given, is
-- the request's fields its caller is about to write (admit.lua, one HSET):
-- granted_at goes with them instead of in a write of its own. Returns how
-- many requests it added to P:running (1; 0 if it somehow held a slot).
local function give_slot(S, ws, request_id, granted, record)
  local base = S.base
  local n = redis.call("HINCRBY", base, "grantseq", 1)
  if record then
    append(record, "granted_at", S.now)
  else
    redis.call("HSET", key_request(request_id), "granted_at", S.now)
  end
  local added = redis.call("ZADD", S.running, S.grant_until, request_id)
  redis.call("ZADD", base .. ":granted", n, request_id)
  redis.call("HINCRBY", base, "run|" .. ws, 1)
  if S.template ~= "" then
    local task = request_id .. "." .. n
    local message = string.gsub(string.gsub(string.gsub(S.template, "RQTPLREQ", request_id),
      "RQTPLTASK", task), "RQTPLTAG", task)
    redis.call("LPUSH", S.list, message)
  else
    granted[#granted + 1] = request_id
  end
  return added
end

-- Give every free slot to the request the schedule names next; returns the
-- ids granted that the caller must publish (none when S.template pushed them).
-- The provider's count in flight (ZCARD P:running) is read once: given by
-- the caller, who read it in this step with nothing changing it since
-- (S.in_flight: grant_directly's, for admit.lua's slow path), else read once
-- the schedule names a head, so that nothing waiting costs one read; then
-- counted here as give_slot adds to it (no other write in this step changes
-- it). The loop is the same: grant while a slot is free and a head exists.
local function grant(S)
  local base, heads = S.base, S.base .. ":heads"
  local granted = {}
  local in_flight = S.in_flight
  S.in_flight = nil
  while in_flight == nil or in_flight < S.cap do
    local head = redis.call("ZRANGE", heads, 0, 0, "WITHSCORES")
    if #head == 0 then
      break
    end
    if in_flight == nil then
      in_flight = redis.call("ZCARD", S.running)
      if in_flight >= S.cap then
        break
      end
    end
    local member, tag = head[1], tonumber(head[2])
    local ws = workspace_of_slot(member)
    local _, limit = ws_limits(S, ws)
    if limit > 0 and tonumber(redis.call("HGET", base, "run|" .. ws) or "0") >= limit then
      park(S, ws)
    else
      redis.call("ZREM", heads, member)
      redis.call("ZREM", base .. ":slots", member)
      redis.call("ZREM", base .. ":wslots:" .. ws, member)
      local next_head = first_slot(S, ws)
      if next_head then
        redis.call("ZADD", heads, next_head[2], next_head[1])
      end
      if tag > tonumber(redis.call("HGET", base, "vtime") or "0") then
        redis.call("HSET", base, "vtime", num(tag))
      end
      local popped = redis.call("ZPOPMIN", base .. ":ws:" .. ws)
      forget_workspace_if_idle(S, ws)
      local request_id = popped[1]
      if request_id and redis.call("HGET", key_request(request_id), "status") == "IN_QUEUE" then
        in_flight = in_flight + give_slot(S, ws, request_id, granted)
        S.moved = true
      end
    end
  end
  if S.moved then
    announce_moved(base)
  end
  return granted
end

-- admit.lua's fast path: a new request (its record just written IN_QUEUE)
-- that nobody waits ahead of takes a free slot at once. Returns the ids to
-- publish, as grant() does, or nil when the request must take the slow path
-- (enqueue, then grant). It applies when no workspace has a request waiting
-- ({base}:depths is empty: a parked workspace's waiting requests are counted
-- there too), the provider has a free slot and the workspace is under its
-- own max_in_flight. There, enqueue() then grant() would give the request a
-- slot tagged max(vtime, f|ws) + QUANTUM / weight and take it straight back:
-- the request is the only head, so it is granted, and its workspace, now
-- idle, drops its f|ws and, no one waiting, vtime (both absent before: no
-- one waited). So this leaves what they leave (the same give_slot) without
-- writing and deleting the slot; only the slotseq counter, which only names
-- slots in creation order, is not advanced. `record`: as give_slot's.
-- Also returns the request's position (position(): its rank in :granted).
--
-- The announcement (announce_moved) is made only when someone else is
-- granted and not started (that rank > 0). Otherwise no follower can see a
-- change: nobody waits ({base}:depths is empty) and nobody else is granted,
-- so no other IN_QUEUE request of this provider has a position (position()
-- is false for it) and a running one has none; the new request is appended
-- at the end of :granted (the highest grantseq), and the request itself has
-- no follower yet (its id is answered by this admission). When others are
-- granted, their positions do not change either (they are ahead of it), but
-- a stream of one may still show a position from before a request ahead of
-- it ended unstarted without a grant (release_slot announces nothing then),
-- which this announcement has always woken it to read again: kept, so no
-- stream shows anything later than it did.
-- When it does not apply, S.in_flight keeps the count in flight it read (if
-- it did), for the grant() that follows in the same step.
local function grant_directly(S, ws, request_id, record)
  local in_flight = redis.call("ZCARD", S.running)
  local _, limit = ws_limits(S, ws)
  if in_flight >= S.cap or redis.call("ZCARD", S.base .. ":depths") > 0
      or (limit > 0 and tonumber(redis.call("HGET", S.base, "run|" .. ws) or "0") >= limit) then
    S.in_flight = in_flight
    return nil
  end
  local granted = {}
  give_slot(S, ws, request_id, granted, record)
  local rank = redis.call("ZRANK", S.base .. ":granted", request_id)
  if rank > 0 then
    announce_moved(S.base)
  end
  return granted, rank
end

-- queue_position: how many requests start before this one if nothing else
-- arrives. Granted requests start in grant order (their messages are FIFO on
-- the broker), every waiting one after all of them, in slot order:
--   granted, not started:  its rank among the granted
--   waiting:               granted + the slots ahead of the one its rank in
--                          its workspace gives it (rank i takes the i-th slot)
-- Exact while no workspace is held at its own max_in_flight. When one is, its
-- slots still count in tag order, as if its running request ended now: its
-- own positions are a lower bound, and those behind its slots an upper one.
-- Each step is a ZRANK, ZRANGE by index or ZCARD: O(log n) at any depth.
local function position(base, ws, request_id)
  local granted_rank = redis.call("ZRANK", base .. ":granted", request_id)
  if granted_rank then
    return granted_rank
  end
  local i = redis.call("ZRANK", base .. ":ws:" .. ws, request_id)
  if not i then
    return false
  end
  local granted = redis.call("ZCARD", base .. ":granted")
  local slot = redis.call("ZRANGE", base .. ":wslots:" .. ws, i, i)
  return granted + (slot[1] and redis.call("ZRANK", base .. ":slots", slot[1]) or i)
end

-- ---------------------------------------------------------------------------
-- Webhook events (keys.py: P:webhook:{id}, P:webhook:{id}:next,
-- P:webhook:due:{provider}, or an earlier version's rq:webhooks:due).
--
-- A request whose record names a URL (admit.lua wrote it: the request's own
-- X-Comfy-Webhook-Url or its workspace's default) owes the events its
-- webhook_events names ("completed" when absent): "started" when claim.lua
-- starts it, "progress" when progress.lua records news (at most one new one
-- per interval), "completed" when it completes. Each is owed in the same
-- atomic step as the change it reports, snapshotted from the record.
--
-- A request's events are delivered one at a time, in the order owed:
-- P:webhook:{id} holds the one being delivered (the head, with its delivery
-- state) and P:webhook:due:{provider} names the request; the events owed behind it
-- wait in P:webhook:{id}:next (JSON snapshots, oldest first), each started
-- only once the one before it ended (delivered, 410 or given up:
-- webhook_ended). A progress event nobody has attempted yet takes a newer
-- value instead of another event queuing behind it.
--
-- The workspace's pending-webhook quota counts requests: admit.lua counts one
-- for a request with a webhook ("webhook_counted"), and it is given back once,
-- when the request has completed and its last owed event ended.
-- ---------------------------------------------------------------------------

--: The fields an attempt writes, cleared when a new event takes the head.
local WEBHOOK_ATTEMPT_FIELDS = {"attempts", "first_attempt_at", "last_attempt_at", "last_status", "last_error",
  "done_at", "lease_until", "token", "waits", "progress"}

-- Whether the comma-separated list of chosen events names `kind`.
local function wants_event(events, kind)
  return string.find("," .. ((events and events ~= "") and events or "completed") .. ",", "," .. kind .. ",",
    1, true) ~= nil
end

-- The snapshot of an event of `kind` ("started" | "progress" | "completed"):
-- what its body is built from, flat strings. nil when the record names no URL.
local function webhook_snapshot(req_key, request_id, kind, msg_id, now)
  local r = redis.call("HMGET", req_key, "webhook_url", "webhook_response_url", "workspace", "model",
    "status", "error_type", "created_at", "started_at", "completed_at", "progress", "price", "cost_state", "hold",
    "provider", unpack(WEBHOOK_LISTED))
  if not r[1] or r[1] == "" then
    return nil
  end
  local event = {request_id = request_id, url = r[1], response_url = r[2] or "", workspace = r[3] or "",
    model = r[4] or "", type = kind, msg_id = msg_id, status = r[5] or "", error_type = r[6] or "",
    created_at = r[7] or now, started_at = r[8] or "", completed_at = r[9] or "",
    progress = kind == "progress" and (r[10] or "") or "", owed_at = now,
    -- the cost as it stands at this step: held (no state yet: its hold), or
    -- as settle() left it (it runs before the completion's event)
    cost_credits = r[12] and (r[11] or "0") or (r[13] or "0"), cost_state = r[12] or "held",
    provider = r[14] or ""}
  -- the fields record.py lists on webhook events (generated), those the record has
  for i, name in ipairs(WEBHOOK_LISTED) do
    if r[14 + i] then
      event[SNAPSHOT_PREFIX .. name] = r[14 + i]
    end
  end
  return event
end

-- The head becomes `event` (a snapshot), due now, in its provider's due set
-- (keys.py, webhooks_due); its workspace's count ("counted") stays where it is.
local function webhook_start(event_key, event, now)
  redis.call("HDEL", event_key, unpack(WEBHOOK_ATTEMPT_FIELDS))
  for _, name in ipairs(WEBHOOK_LISTED) do
    redis.call("HDEL", event_key, SNAPSHOT_PREFIX .. name)  -- the event before's, which this one may lack
  end
  redis.call("PERSIST", event_key)
  local fields = {"state", "pending", "attempts", 0, "next_at", now}
  for name, value in pairs(event) do
    fields[#fields + 1] = name
    fields[#fields + 1] = value
  end
  redis.call("HSET", event_key, unpack(fields))
  redis.call("ZADD", key_webhooks_due(event.request_id, event.provider), now, event.request_id)
end

-- Owe `event`: it becomes the head when none is pending ("DUE": publish it),
-- else it queues behind ("QUEUED"); a progress event takes the place of a
-- progress event not yet attempted instead ("COALESCED").
local function owe_event(event, now)
  local event_key = key_webhook(event.request_id)
  local next_key = event_key .. KEY_WEBHOOK_NEXT
  local head = redis.call("HMGET", event_key, "state", "type", "attempts")
  if head[1] ~= "pending" then
    webhook_start(event_key, event, now)
    return "DUE"
  end
  if event.type == "progress" then
    local tail = redis.call("LINDEX", next_key, -1)
    if tail then
      local queued = cjson.decode(tail)
      if queued.type == "progress" then
        queued.progress = event.progress
        redis.call("LSET", next_key, -1, cjson.encode(queued))
        return "COALESCED"
      end
    elseif head[2] == "progress" and tonumber(head[3] or "0") == 0 then
      redis.call("HSET", event_key, "progress", event.progress)
      return "COALESCED"
    end
  end
  redis.call("RPUSH", next_key, cjson.encode(event))
  return "QUEUED"
end

-- Give back the workspace's pending-webhook count the request holds, once
-- (e.webhooks: ws_apply). Returns whether it held one (owe_webhook's "counted").
local function webhook_uncount(event_key, e)
  local counted = redis.call("HGET", event_key, "counted")
  if counted then
    redis.call("HDEL", event_key, "counted")
    e.webhooks = 1
  end
  return counted
end

-- The head ended as `state` (delivered, gone, given_up): the next event owed
-- behind it takes its place, due now (the caller publishes it); with none,
-- the head is kept `keep` seconds and, the request completed, its count given
-- back to its workspace (k: ws_target's, with ws_id): at once, or owed
-- ("webhook": ws_settle.lua gives it through the request's open entry's "w").
-- due_key: the due set the head was published from (keys.py, webhooks_due).
local function webhook_ended(event_key, k, due_key, request_id, state, now, keep)
  redis.call("HSET", event_key, "state", state, "done_at", now)
  redis.call("ZREM", due_key, request_id)
  local raw = redis.call("LPOP", event_key .. KEY_WEBHOOK_NEXT)
  if raw then
    webhook_start(event_key, cjson.decode(raw), now)
    return true
  end
  redis.call("EXPIRE", event_key, keep)
  local e = ws_effects(request_id, now)
  local counted = webhook_uncount(event_key, e)
  if counted then
    owe_ws(k, e, "webhook")
  end
  return false
end

-- A request that just completed: it owes its "completed" event when it
-- chose it, and its workspace's count moves to its events, given back when
-- the last ends (at once when none is pending). Once per request
-- ("webhook_final"), whichever script completes it. rec: the record's
-- ENDING_FIELDS as they were before this step; e: the ending's workspace
-- effects (ws_effects), which the caller applies after.
local function owe_webhook(req_key, e, request_id, now, rec)
  if not rec.webhook_url or rec.webhook_url == "" or rec.webhook_final then
    return
  end
  redis.call("HSET", req_key, "webhook_final", 1)
  local event_key = key_webhook(request_id)
  if wants_event(rec.webhook_events, "completed") then
    owe_event(webhook_snapshot(req_key, request_id, "completed", webhook_id(request_id), now), now)
  end
  if rec.webhook_counted == "1" then
    -- on a split store its count goes back through its open entry's "w"
    redis.call("HSET", event_key, "counted", 1)
    if redis.call("HGET", event_key, "state") ~= "pending" then
      webhook_uncount(event_key, e)
    end
  end
end

-- A request just started (claim.lua): its "started" event, when chosen.
-- Returns true when it is due now (publish it). url, events: the record's
-- webhook_url and webhook_events (claim.lua read them with the rest).
local function owe_started(req_key, request_id, now, url, events)
  if not url or url == "" or not wants_event(events, "started") then
    return false
  end
  local event = webhook_snapshot(req_key, request_id, "started", webhook_id(request_id, "started"), now)
  return owe_event(event, now) == "DUE"
end

-- A running request's progress grew (progress.lua): its "progress" event,
-- when chosen. A progress event not yet attempted takes the new value; else
-- a new one is owed, unless one was less than `every` seconds ago. Returns
-- true when an event is due now (publish it).
local function owe_progress(req_key, request_id, now, every)
  local r = redis.call("HMGET", req_key, "webhook_url", "webhook_events", "webhook_progress_at",
    "webhook_progress_n")
  if not r[1] or r[1] == "" or not wants_event(r[2], "progress") then
    return false
  end
  local n = tonumber(r[4] or "0") + 1
  local event = webhook_snapshot(req_key, request_id, "progress", webhook_id(request_id, "progress", n), now)
  local recent = r[3] and tonumber(now) - tonumber(r[3]) < tonumber(every)
  if recent then
    -- only a coalesce: never a new event within the interval
    local event_key = key_webhook(request_id)
    local head = redis.call("HMGET", event_key, "state", "type", "attempts")
    local tail = redis.call("LINDEX", event_key .. KEY_WEBHOOK_NEXT, -1)
    local pending_progress = (tail and cjson.decode(tail).type == "progress")
      or (not tail and head[1] == "pending" and head[2] == "progress" and tonumber(head[3] or "0") == 0)
    if not pending_progress then
      return false
    end
  end
  local owed = owe_event(event, now)
  if owed ~= "COALESCED" then
    redis.call("HSET", req_key, "webhook_progress_at", now, "webhook_progress_n", n)
  end
  return owed == "DUE"
end

-- End a request that produced no output the provider billed (cancelled while
-- queued, timed out in the queue, given up after its workers kept dying):
-- COMPLETED with its bucket, out of the queue, the schedule and its slot, its
-- hold released, kept (its body too: it may be retried) for the retention
-- window, announced. k holds the keys
-- req, body (P:body:{id}), queue, deadlines (P:deadlines:{provider}, or nil), the
-- workspace id ws_id and where its effects go (ws_target); S the provider's
-- scheduler context (the caller runs grant(S) after, for the freed slot).
local function finish_unbilled(k, S, request_id, now, retention, was_queued, error_type, detail)
  local rec = read_fields(k.req, ENDING_FIELDS)
  local e = ws_effects(request_id, now)
  -- The record first: its write can grow memory, so a full Redis refuses the
  -- whole step (Redis refuses such a write only as a script's first).
  local fields = {"status", "COMPLETED", "completed_at", now, "error_type", error_type, "detail", detail}
  settle(e, "release", rec, fields)
  give_back_body(rec, fields, e)
  redis.call("HSET", k.req, unpack(fields))
  redis.call("EXPIRE", k.req, retention)
  if was_queued then
    e.queued = 1
    leave_schedule(S, k.ws_id, request_id)
    redis.call("ZREM", k.queue, request_id)  -- a started one left it when it started (claim.lua)
  else
    release_slot(S, k.ws_id, request_id, true)
  end
  drop_body(k.body, retention, true, rec, e, k.ws_id, now)
  forget_deadlines(k.deadlines, request_id, rec)
  owe_webhook(k.req, e, request_id, now, rec)
  owe_ws(k, e, "end")
  announce_completed(request_id)
end

-- ---------------------------------------------------------------------------
-- The history (GET /v2/requests; keys.py, "W:history").
--
-- Two streams per workspace, written by admit.lua with the record: its own,
-- whose entries hold each request's id (16 bytes, the UUID packed), and one
-- per model, whose entries are empty and share the workspace entry's stream
-- id (the model's list points into the workspace's). An entry's stream id is
-- its admission time in ms (never below the last one's: ids only grow) and a
-- sequence. Streams, not sorted sets: an entry costs Redis about 35 bytes and
-- a model's about 7, where a sorted set's costs 176 (bench/run, waiting_memory).
-- ---------------------------------------------------------------------------

-- "0c57a2b5-9a3d-9f1e-8b2a-012345678901" as its 16 bytes, and back.
local function pack_id(request_id)
  return (string.gsub(string.gsub(request_id, "-", ""), "%x%x", function(h)
    return string.char(tonumber(h, 16))
  end))
end

local function unpack_id(packed)
  return string.format("%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
    string.byte(packed, 1, 16))
end

-- The stream's last entry's ms, or 0.
local function last_ms(stream)
  local last = redis.call("XREVRANGE", stream, "+", "-", "COUNT", 1)[1]
  return last and tonumber(string.match(last[1], "^%d+")) or 0
end

-- XADD the entry under `id` and trim what is older than `oldest` (ms) in
-- the same command (exact MINID, as XTRIM would); nil, nothing changed, when
-- XADD refuses the id because the stream's last entry is not below it.
local function xadd_trimmed(stream, oldest, id, field, value)
  local added = redis.pcall("XADD", stream, "MINID", oldest, id, field, value)
  if type(added) == "table" and added.err then
    return nil
  end
  return added
end

--: Seconds between renewals of a history stream's expiry (history_add).
local HISTORY_RENEW_S = 60

-- Whether a history stream whose expiry was last renewed to last at least
-- until `until_` (Unix seconds, the workspace hash's field history_add
-- names; false: never renewed) still lasts `keep` seconds past `now`. It
-- must not last more than one renewal longer (a shorter retention, or a
-- renewal stamped by a clock ahead of this one): renewed then too.
local function history_lasts(until_, now, keep)
  local u = tonumber(until_)
  return u ~= nil and now + keep <= u and u <= now + keep + HISTORY_RENEW_S
end

-- The history's expiry, renewed at most once a minute per stream: the
-- workspace hash's fields a renewal writes (admit.lua writes them with its
-- counts), appended to `fields`, and whether each stream is due. A stream is
-- renewed to keep + HISTORY_RENEW_S seconds, and its field says until when
-- (at most that), so that until the next renewal, at most a minute later,
-- every admission's entry is kept at least `keep` seconds, as when each
-- admission renewed it to `keep`. ws_until, model_until: the fields' values.
local function history_renewals(model, now, keep, ws_until, model_until, fields)
  now, keep = tonumber(now), tonumber(keep)
  local until_ = math.floor(now) + keep + HISTORY_RENEW_S
  local renew = {ws = not history_lasts(ws_until, now, keep), model = not history_lasts(model_until, now, keep)}
  if renew.ws then
    append(fields, "history_until", until_)
  end
  if renew.model then
    append(fields, "history_until|" .. model, until_)
  end
  return renew
end

-- List a request just admitted (now: Unix seconds) in its workspace's and
-- its model's history; trim what is older than `keep` seconds, and let a
-- history nobody admits to any more expire after its newest entry (renew:
-- history_renewals, which streams' expiry to renew now). An entry's
-- ms is its admission's, or the stream's last one's when that is later (the
-- clock of another front door ahead of this one's): ids only grow. That is
-- rare, so it is read only when XADD refuses the admission's own ms. Never an
-- error (a script that failed here would leave the admission half done): a
-- model's stream that is somehow ahead of its workspace's (one was deleted
-- by hand) just misses the entry, and is trimmed all the same.
local function history_add(ws_stream, model_stream, request_id, now, keep, renew)
  local keep_ms = tonumber(keep) * 1000
  local function oldest(ms)  -- the trim's MINID for an entry at ms
    return string.format("%.0f", math.max(0, ms - keep_ms))
  end
  local ms = math.floor(tonumber(now) * 1000)
  local packed = pack_id(request_id)
  local id = xadd_trimmed(ws_stream, oldest(ms), string.format("%.0f-*", ms), "i", packed)
  if not id then
    ms = math.max(ms, last_ms(ws_stream))
    id = redis.call("XADD", ws_stream, "MINID", oldest(ms), string.format("%.0f-*", ms), "i", packed)
  end
  if not xadd_trimmed(model_stream, oldest(ms), id, "i", "") then
    redis.call("XTRIM", model_stream, "MINID", oldest(ms))
  end
  if renew.ws then
    redis.call("EXPIRE", ws_stream, tonumber(keep) + HISTORY_RENEW_S)
  end
  if renew.model then
    redis.call("EXPIRE", model_stream, tonumber(keep) + HISTORY_RENEW_S)
  end
end

-- {code, ids..., owed...}: a script's answer with the granted ids its caller
-- publishes and the workspace effects it owed (JSON objects, owe_ws), which
-- its caller applies.
local function with_granted(code, granted)
  local reply = {code}
  for _, request_id in ipairs(granted) do
    reply[#reply + 1] = request_id
  end
  for _, owed in ipairs(OWED) do
    reply[#reply + 1] = owed
  end
  return reply
end

-- ---------------------------------------------------------------------------
-- Admission: admit.lua in one step; on a store split into per-slot steps,
-- admit_ws.lua (the workspace's part) then admit_place.lua (the provider's),
-- a refusal or a crash between them undone by admit_undo.lua
-- (store/admission.py). The workspace's part: the caller's rate windows and
-- the idempotency key (admission_opening), its quotas and credits
-- (admission_checks), then its counts, hold, ledger entry, history entries,
-- idempotency reservation and, split, the request's open entry
-- (reserve_admission). The provider's part: the request a retry submits again
-- and whether the provider admits (admission_source), then the record, its
-- body, deadlines and place in the schedule (place_admission). Every check
-- comes before any write, so a refusal writes nothing but the rate count,
-- and the Idempotency-Key stays free. Each part takes its keys in a table
-- (K), so that it can run with its own slot's keys alone; ARGV is the
-- script's (admission.py, ADMIT_ARGS).
-- ---------------------------------------------------------------------------

-- The caller's rate windows (counted first: K.rate is the first of its keys)
-- and the idempotency key (K.idem): the reply that ends the admission, or nil.
local function admission_opening(K)
  local spent = spend_rate(K.rate, ARG_REST)
  if spent then
    return {"RATE_LIMITED", spent[1], spent[2]}
  end
  if ARGV[ARG_FINGERPRINT] ~= "" then
    local held = redis.call("GET", K.idem)
    if held then
      local sep = string.find(held, "|", 1, true)
      if string.sub(held, 1, sep - 1) ~= ARGV[ARG_FINGERPRINT] then
        return {"IDEM_CONFLICT"}
      end
      return {"REPLAY", string.sub(held, sep + 1)}
    end
  end
  return nil
end

-- The body and whether the provider admits (its schedule's "draining",
-- K.sched): the source {body: the text to store, or owner: the request whose
-- kept body it shares; bytes}, or nil and the reply that ends the admission.
-- A retry shares the kept body (drop_body) of a request of this caller and
-- model that failed (COMPLETED with an error_type: K.original,
-- K.original_body), the first of its chain's (body_of), whose retries are
-- capped at ARG_RETRY_MAX all told. A body an earlier version kept in its
-- record is copied, as it was.
local function admission_source(K)
  local src = {body = ARGV[ARG_BODY], bytes = body_size(ARGV[ARG_BODY])}
  if ARGV[ARG_RETRY_OF] ~= "" then
    local original = redis.call("HMGET", K.original, "status", "workspace", "model", "error_type", "body_of")
    if not original[1] or original[2] ~= ARGV[ARG_WORKSPACE] or original[3] ~= ARGV[ARG_MODEL] then
      return nil, {"RETRY_MISSING"}
    end
    if original[1] ~= "COMPLETED" or not original[4] or original[4] == "" then
      return nil, {"NOT_RETRYABLE", original[1] == "COMPLETED" and "SUCCEEDED" or original[1]}
    end
    local owner = original[5] or ARGV[ARG_RETRY_OF]
    if tonumber(redis.call("HGET", key_body_refs(owner), "retries") or "0") >= tonumber(ARGV[ARG_RETRY_MAX]) then
      return nil, {"RETRY_LIMIT"}
    end
    local bytes = stored_body(original[5] and key_body(owner) or K.original_body)
    if bytes > 0 then
      src = {owner = owner, bytes = bytes}
    else
      local body = redis.call("HGET", K.original, "body")
      if not body then
        return nil, {"RETRY_BODY_GONE"}
      end
      src = {body = body, bytes = #body}
    end
  end
  if redis.call("HGET", K.sched, "draining") then
    return nil, {"DRAINING"}
  end
  return src
end

-- The workspace's hash (K.ws) once: what admission checks, the counts it adds
-- to (written back in one HSET by reserve_admission: nothing in between
-- writes them), the schedule's weight and max_in_flight (ws_limits) and until
-- when the history's streams last (history_renewals). Returns those values,
-- or nil and the refusal. bytes: the body's. The kept bodies expired by now
-- are released from its stored bytes first (release_stored, K.stored).
local function admission_checks(K, bytes)
  release_stored(K.stored, K.ws, ARGV[ARG_NOW])
  local ws = redis.call("HMGET", K.ws, "queue_enabled", "queued", "max_queued", "credits", "held", "webhook_url",
    "webhook_secret", "queued_bytes", "max_queued_bytes", "webhooks_pending", "max_pending_webhooks",
    "webhook_events", "weight", "max_in_flight", "history_until", "history_until|" .. ARGV[ARG_MODEL],
    "stored_bytes", "max_stored_bytes")
  if ARGV[ARG_REQUIRE_ENABLED] == "1" and ws[1] ~= "1" then
    return nil, {"NOT_ENABLED"}
  end
  -- A webhook (the request's own, else the workspace's default) needs the
  -- workspace's signing secret: without one every attempt would fail for a
  -- day and the caller never learn why, so the submit is refused instead.
  local webhook = ARGV[ARG_WEBHOOK_URL] ~= "" and ARGV[ARG_WEBHOOK_URL] or ws[6]
  -- Events chosen for no webhook at all would be dropped without a word.
  if ARGV[ARG_WEBHOOK_EVENTS] ~= "" and (not webhook or webhook == "") then
    return nil, {"NO_WEBHOOK"}
  end
  if webhook and webhook ~= "" and not ws[7] then
    return nil, {"NO_WEBHOOK_SECRET", ARGV[ARG_WEBHOOK_URL] ~= "" and "header" or "default"}
  end
  if tonumber(ws[2] or "0") >= tonumber(ws[3] or ARGV[ARG_MAX_QUEUED]) then
    return nil, {"BACKLOG_FULL"}
  end
  -- The body's bytes count against the workspace's quota until it is
  -- deleted (give_back_body: its completion, whatever ends it).
  if tonumber(ws[8] or "0") + bytes > tonumber(ws[9] or ARGV[ARG_MAX_QUEUED_BYTES]) then
    return nil, {"QUEUED_BYTES_FULL"}
  end
  -- Its kept bodies (drop_body) and results (keep_result) under its stored bytes: room for this body
  -- too, which is kept if the request ends unbilled; else how long until
  -- enough of them expire.
  local over = tonumber(ws[17] or "0") + bytes - tonumber(ws[18] or ARGV[ARG_MAX_STORED_BYTES])
  if over > 0 then
    return nil, {"STORED_BYTES_FULL", stored_wait(K.stored, over, tonumber(ARGV[ARG_NOW]))}
  end
  -- A request with a webhook holds one of the workspace's pending events
  -- from now until its last event is delivered or given up (webhook_ended),
  -- however many events it chose, so a submit-and-cancel flood is bounded
  -- however fast its requests end.
  if webhook and webhook ~= "" and tonumber(ws[10] or "0") >= tonumber(ws[11] or ARGV[ARG_MAX_PENDING_WEBHOOKS]) then
    return nil, {"PENDING_WEBHOOKS_FULL"}
  end
  local available = tonumber(ws[4] or "0") - tonumber(ws[5] or "0")
  if tonumber(ARGV[ARG_PRICE]) > 0 and available < tonumber(ARGV[ARG_PRICE]) then
    return nil, {"INSUFFICIENT_CREDITS", tostring(available)}
  end
  return ws
end

-- Write the workspace's part (K.ws, K.ledger, K.idem, K.history,
-- K.model_history; K.open when split): its counts as HINCRBY would leave them
-- (from admission_checks' values: one fewer write per count), the hold and
-- its ledger entry, the history's entries, the idempotency reservation. Returns
-- what the provider's part records (R): webhook (the URL, or false), events
-- (the events chosen, if not only "completed"), idem (the key's hash), open,
-- limits (the workspace's weight and max_in_flight, limits_of).
local function reserve_admission(K, ws, bytes)
  local price = tonumber(ARGV[ARG_PRICE])
  local webhook = ARGV[ARG_WEBHOOK_URL] ~= "" and ARGV[ARG_WEBHOOK_URL] or ws[6]
  if webhook == "" then
    webhook = false
  end
  local R = {webhook = webhook, limits = limits_of(ws[13], ws[14])}
  local counts = {"queued", tonumber(ws[2] or "0") + 1, "queued_bytes", tonumber(ws[8] or "0") + bytes}
  if price > 0 then
    local held = tonumber(ws[5] or "0") + price
    append(counts, "held", held)
    -- trimmed here only, as the history is: a ledger grows by priced
    -- admissions (a hold each, settled once later), each of which trims it
    ledger_add(K.ledger, ARGV[ARG_NOW], ARGV[ARG_LEDGER_KEEP], "type", "hold", "request_id", ARGV[ARG_ID],
      "amount", price, "balance", tonumber(ws[4] or "0"), "held", held, "at", ARGV[ARG_NOW])
  end
  if webhook then
    append(counts, "webhooks_pending", tonumber(ws[10] or "0") + 1)
    local events = ARGV[ARG_WEBHOOK_EVENTS] ~= "" and ARGV[ARG_WEBHOOK_EVENTS] or ws[12]
    if events and events ~= "" and events ~= "completed" then
      R.events = events  -- absent: "completed"
    end
  end
  local renew = history_renewals(ARGV[ARG_MODEL], ARGV[ARG_NOW], ARGV[ARG_RETENTION], ws[15], ws[16], counts)
  redis.call("HSET", K.ws, unpack(counts))
  if ARGV[ARG_FINGERPRINT] ~= "" then
    -- the key's hash alone (64 characters): the whole key name would push the
    -- record out of its compact encoding
    R.idem = string.match(K.idem, "[^:]+$")
    redis.call("SET", K.idem, ARGV[ARG_FINGERPRINT] .. "|" .. ARGV[ARG_ID], "EX", ARGV[ARG_IDEM_TTL])
  end
  history_add(K.history, K.model_history, ARGV[ARG_ID], ARGV[ARG_NOW], ARGV[ARG_RETENTION], renew)
  if K.open then
    -- its start ("q") and end ("e") owed to the workspace (ws_settle.lua);
    -- "w": it counts a pending webhook (admit_undo.lua gives it back)
    redis.call("HSET", K.open, ARGV[ARG_ID], webhook and "qew" or "qe")
    R.open = true
  end
  return R
end

-- Write the provider's part (K.req, K.body, K.seq, K.queue, K.deadlines and
-- the schedule's K.sched, K.running, K.list): the record (what this step
-- computes, then the submission's ADMITTED_FIELDS, generated), collected and
-- written in one HSET once the schedule has decided whether it is granted at
-- once (with its granted_at), its body apart (every other field is short, so
-- the record stays a compact listpack while it waits: keys.py, body()), its
-- deadlines, its place in the queue and the schedule. src: admission_source's;
-- R: reserve_admission's.
-- Returns {"ADMITTED", id, position, granted ids to publish...}.
local function place_admission(K, src, R)
  local seq = redis.call("INCR", K.seq)
  local record = {"status", "IN_QUEUE", "seq", seq, "created_at", ARGV[ARG_NOW], "hold", tonumber(ARGV[ARG_PRICE]),
    "body_bytes", src.bytes}
  -- the fields carried from the submission (record.py declares them): ARGV[1..]
  for i, name in ipairs(ADMITTED_FIELDS) do
    if ARGV[i] ~= "" then
      append(record, name, ARGV[i])
    end
  end
  if src.owner then
    -- a retry shares its chain's kept body, which lives while it waits or runs
    local refs = key_body_refs(src.owner)
    redis.call("HINCRBY", refs, "retries", 1)
    redis.call("HINCRBY", refs, "live", 1)
    redis.call("PERSIST", refs)
    redis.call("PERSIST", key_body(src.owner))
    append(record, "body_of", src.owner)
  else
    redis.call("SET", K.body, src.body)
  end
  if ARGV[ARG_START_DEADLINE_AT] ~= "" then
    redis.call("ZADD", K.deadlines, ARGV[ARG_START_DEADLINE_AT], "start|" .. ARGV[ARG_ID])
  end
  if ARGV[ARG_DEADLINE_AT] ~= "" then
    redis.call("ZADD", K.deadlines, ARGV[ARG_DEADLINE_AT], "run|" .. ARGV[ARG_ID])
  end
  redis.call("ZADD", K.queue, seq, ARGV[ARG_ID])
  if R.webhook then
    append(record, "webhook_url", R.webhook, "webhook_response_url", ARGV[ARG_RESPONSE_URL], "webhook_counted", 1)
    if R.events then
      append(record, "webhook_events", R.events)
    end
  end
  if R.idem then
    append(record, "idem", R.idem)
  end
  if R.open then
    append(record, "open", 1)  -- its workspace effects are owed through its open entry (owe_ws)
  end
  local S = sched_ctx(K.sched, K.running, K.list, ARGV[ARG_CAP], ARGV[ARG_NOW], ARGV[ARG_GRANT_UNTIL],
    ARGV[ARG_TEMPLATE])
  S.limits[ARGV[ARG_WORKSPACE]] = R.limits
  -- Nobody waiting ahead and a slot free: granted at once (grant_directly),
  -- its granted_at written with the record.
  local granted, rank = grant_directly(S, ARGV[ARG_WORKSPACE], ARGV[ARG_ID], record)
  -- The record before grant(): it reads the status of the request it grants.
  redis.call("HSET", K.req, unpack(record))
  if not granted then
    enqueue(S, ARGV[ARG_WORKSPACE], ARGV[ARG_ID], seq, ARGV[ARG_PRIORITY])
    granted = grant(S)
    rank = position(S.base, ARGV[ARG_WORKSPACE], ARGV[ARG_ID])
  end
  local reply = with_granted("ADMITTED", granted)
  table.insert(reply, 2, ARGV[ARG_ID])
  table.insert(reply, 3, rank)
  return reply
end
