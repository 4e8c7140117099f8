-- lib/webhooks.lua: webhook events, owed in the step that makes the change they report
-- (owe_started, owe_progress, owe_webhook, webhook_ended).
-- requires: ledger

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
  -- the fields requests/record.py lists on webhook events (generated), those the record has
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
