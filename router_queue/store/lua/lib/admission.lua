-- lib/admission.lua: admission's parts (admission_opening, admission_source,
-- admission_checks, reserve_admission, place_admission), which admit.lua,
-- admit_ws.lua and admit_place.lua put together.
-- requires: util, ledger, body, schedule, pins, history, budget

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
  -- A batch's line is admitted only while its batch is not cancelled
  -- (batch_cancel.lua): a drain's step landing after the cancel answered
  -- admits nothing, so the cancel's answer covers every line.
  if ARGV[ARG_BATCH_ID] ~= "" and redis.call("HGET", K.batch, "cancelled") == "1" then
    return nil, {"BATCH_CANCELLED"}
  end
  release_stored(K.stored, K.ws, ARGV[ARG_NOW])
  local names = {"queue_enabled", "queued", "max_queued", "credits", "held", "webhook_url",
    "webhook_secret", "queued_bytes", "max_queued_bytes", "webhooks_pending", "max_pending_webhooks",
    "webhook_events", "weight", "max_in_flight", "history_until", "history_until|" .. ARGV[ARG_MODEL],
    "stored_bytes", "max_stored_bytes", "regions"}
  local price = tonumber(ARGV[ARG_PRICE])
  -- a priced request's budgets (lib/budget.lua), in the same read
  local scopes = price > 0 and budget_names(names, ARGV[ARG_KEY_ID]) or nil
  local ws = redis.call("HMGET", K.ws, unpack(names))
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
  if price > 0 and available < price then
    return nil, {"INSUFFICIENT_CREDITS", tostring(available)}
  end
  if scopes then
    -- its hold within every budget of the workspace and of the caller's key
    -- for the period now, else refused (a full budget's 100 % alert owed)
    local plan, refusal, spent = budget_check(scopes, ws, 20, price, ARGV[ARG_NOW])
    if not plan then
      budget_refused(K.ws, spent)
      return nil, refusal
    end
    ws.budget = plan
  end
  return ws
end

-- Write the workspace's part (K.ws, K.ledger, K.idem, K.history,
-- K.model_history; K.open when split): its counts as HINCRBY would leave them
-- (from admission_checks' values: one fewer write per count), the hold and
-- its ledger entry, the history's entries, the idempotency reservation. Returns
-- what the provider's part records (R): webhook (the URL, or false), events
-- (the events chosen, if not only "completed"), idem (the key's hash), open,
-- limits (the workspace's weight and max_in_flight, limits_of), regions (its pin, if any).
local function reserve_admission(K, ws, bytes)
  local price = tonumber(ARGV[ARG_PRICE])
  local webhook = ARGV[ARG_WEBHOOK_URL] ~= "" and ARGV[ARG_WEBHOOK_URL] or ws[6]
  if webhook == "" then
    webhook = false
  end
  local R = {webhook = webhook, limits = limits_of(ws[13], ws[14]), regions = ws[19] or nil}
  local counts = {"queued", tonumber(ws[2] or "0") + 1, "queued_bytes", tonumber(ws[8] or "0") + bytes}
  if price > 0 then
    local held = tonumber(ws[5] or "0") + price
    append(counts, "held", held)
    -- trimmed here only, as the history is: a ledger grows by priced
    -- admissions (a hold each, settled once later), each of which trims it
    ledger_add(K.ledger, ARGV[ARG_NOW], ARGV[ARG_LEDGER_KEEP], "type", "hold", "request_id", ARGV[ARG_ID],
      "amount", price, "balance", tonumber(ws[4] or "0"), "held", held, "at", ARGV[ARG_NOW],
      "model", ARGV[ARG_MODEL], "key", ARGV[ARG_KEY_ID])
    budget_spend(K.ws, ws.budget, price, counts)
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
  -- the fields carried from the submission (requests/record.py declares them): ARGV[1..]
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
    ARGV[ARG_TEMPLATE], ARGV[ARG_LOW_HEADROOM_PCT])
  local group = pin_group(S, R.regions)
  S.limits[ARGV[ARG_WORKSPACE]] = {R.limits[1], R.limits[2], group}
  if group ~= "" then
    append(record, "pin_group", group)  -- its position's competitors (status.lua)
  end
  S.admitting = ARGV[ARG_ID]  -- (enqueue sets the record right when its workspace waits in another group)
  -- Nobody waiting ahead and a slot free: granted at once (grant_directly),
  -- its granted_at written with the record.
  local granted, rank = grant_directly(S, ARGV[ARG_WORKSPACE], ARGV[ARG_ID], record, ARGV[ARG_PRIORITY])
  -- The record before grant(): it reads the status of the request it grants.
  redis.call("HSET", K.req, unpack(record))
  if not granted then
    enqueue(S, ARGV[ARG_WORKSPACE], ARGV[ARG_ID], seq, ARGV[ARG_PRIORITY])
    granted = grant(S)
    local waiting_in = S.limits[ARGV[ARG_WORKSPACE]][3]
    rank = position(S.base, ARGV[ARG_WORKSPACE], ARGV[ARG_ID], waiting_in ~= "" and waiting_in)
  end
  local reply = with_granted("ADMITTED", granted)
  table.insert(reply, 2, ARGV[ARG_ID])
  table.insert(reply, 3, rank)
  return reply
end
