-- lib/ledger.lua: the workspace's side of a request's start and end (ws_effects,
-- ws_apply, owe_ws; where they go, ws_target, is lua/effects/'s), its kept
-- bytes (keep_stored, keep_result, release_stored), its ledger (ledger_add),
-- the settling of a hold (settle) and a script's answer with what it owed
-- (with_granted).
-- requires: util, budget

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
--   charged    what a charge takes of the hold (its model's price; the rest
--              is released with it)
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
    local amount = e.how == "charge" and (e.charged or hold) or hold
    if e.how == "charge" then
      credits = credits - amount
      append(fields, "credits", credits)
    end
    ledger_add(ledger_key, e.at, nil, "type", e.how, "request_id", e.request_id, "amount", amount,
      "balance", credits, "held", held, "at", e.at, "model", e.model or "", "key", e.key or "")
  end
  redis.call("HSET", ws_key, unpack(fields))
  if hold > 0 then
    -- what the hold did not charge leaves the spend of its admission's periods
    budget_refund(ws_key, e.how == "charge" and hold - (e.charged or hold) or hold, e.since, e.key)
  end
end

--: The effects this step owed (JSON), returned to its caller (with_granted).
local OWED = {}

-- Give the workspace effects `e` of the request's `kind` ("start" | "end" |
-- "webhook": its last webhook event ended after it did) to its workspace
-- (k.ws_id): at once, or owed (ws_target, lua/effects/). An owed end is owed
-- even when it gives nothing back: it closes the request's open entry.
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

-- Settle the credits held for a request at admission, once: "charge" turns
-- the hold into a charge (the provider billed us), "release" gives it back
-- (e.hold and e.how: ws_apply moves the workspace's held and credits and
-- writes the ledger's entry). The record's hold is zeroed in the same step,
-- so retries, duplicate deliveries and racing completions can never settle
-- twice. The caller's "cost" is held while the record has no cost_state
-- (nothing is written for it at admission: a waiting request costs no more
-- memory); here it becomes "charged" or "released", with its price (the
-- hold's, or its model's when less: a dearer fallback named, or one it fell
-- back to; a charge takes that and releases the rest of the hold), in the
-- same step as the ledger's entry, so the two always agree; a
-- free request (price 0) settles too, with no ledger entry. rec: the
-- record's ENDING_FIELDS; its fields to write are appended to `fields`,
-- which the caller writes in the same step (one HSET with its own).
local function settle(e, how, rec, fields)
  local hold = tonumber(rec.hold or "0")
  -- its model's price: the hold's, unless it named a dearer fallback than the model it ran
  local price = math.min(tonumber(rec.model_price or "") or hold, hold)
  if rec.cost_state ~= "charged" and rec.cost_state ~= "released" then
    append(fields, "cost_state", how == "charge" and "charged" or "released")
    if not rec.price then
      append(fields, "price", price)
    end
  end
  if hold <= 0 then
    return
  end
  append(fields, "hold", 0)
  if how == "charge" then
    append(fields, "charged", price)
    e.charged = price  -- the rest of the hold goes back (ws_apply)
  end
  e.hold, e.how = hold, how
  -- its model (the one it fell back to, if it did: model_ran), key and admission for the
  -- ledger's entry and its budgets (budget_refund)
  e.model, e.key, e.since = rec.model_ran or rec.model or nil, rec.key_id or nil, tonumber(rec.created_at or "")
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
