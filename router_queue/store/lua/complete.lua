-- complete.lua: finish a request with its output or its error bucket, and
-- settle its credits: charged when the provider bills (a success, or a
-- refusal the catalog says is billed), released otherwise.
-- Status only moves forward: a request already COMPLETED is left untouched,
-- so a duplicate or late worker can never overwrite the first outcome nor
-- charge a second time.
--
-- The slot it held goes to the request the schedule names next (lib/schedule.lua, grant).
--
-- KEYS[1] P:req:{id}   KEYS[2] P:result:{id}   KEYS[3] P:queue:{provider}
-- KEYS[4] P:stats:{provider}   KEYS[5] P:sched:{provider}   KEYS[6] P:running:{provider}
-- KEYS[7] W:ws     KEYS[8] W:ledger (or P:owed:{provider} in both places: ws_target,
--         which the store's consistency model links in, lua/effects/)
-- KEYS[9] the broker's list for the provider  KEYS[10] P:deadlines:{provider}
-- KEYS[11] P:body:{id}  KEYS[12] P:objects:{provider}
-- KEYS[13] P:fallback:{provider}  KEYS[14] P:fallback-bytes:{provider}
-- ARGV by name (ARGV[ARG_ID] and so on; requests_delivery.py, COMPLETE_ARGS):
--   id  now (unix seconds)  retention (s)
--   error_type ("" on success)  detail (a cancel's own reason, cancel.lua's
--                               cancel_detail, wins over it for "cancelled")
--   content_type  output (bytes)  billable ("1" when the provider bills this outcome)
--   cap (the provider's)  grant_until (a grant's lease end, s)  template (the message template, or "")
--   low_headroom_pct (the cap's share kept from low priority: grant.lua's)
--   blob_key blob_size blob_sha256: the output is that object-store object, already
--     written (blob_key "" : the output is ARGV output, kept in KEYS[2]); its record
--     points at it, and KEYS[12] names it for deletion when the record expires
--   fallback_max: "" , or the bytes the provider's share of the Redis fallback
--     may hold: the output belongs in the object store, which did not take it.
--     It is kept in KEYS[2] if KEYS[14] + its size fits, and KEYS[13] names it
--     for the sweeper to move; else nothing is written (FALLBACK_FULL).
-- A success's result counts in its workspace's stored bytes (W:stored, by
-- way of its effects: lib/ledger.lua, keep_result) until its record expires.
-- returns {"COMPLETED", granted ids to publish..., effects owed...} | {"ALREADY_COMPLETED"} | {"MISSING"}
--   | {"FALLBACK_FULL"}

-- The record once: what this step reads of it, and what its ending reads (lib/ending.lua).
local rec = read_fields(KEYS[1], ENDING_FIELDS, {"status", "workspace", "started_at", "created_at", "cancel_detail"})
local status = rec.status
if not status then
  return {"MISSING"}
end
if status == "COMPLETED" then
  return {"ALREADY_COMPLETED"}
end
local fallback = ARGV[ARG_FALLBACK_MAX] ~= "" and ARGV[ARG_ERROR_TYPE] == ""
if fallback then
  local size = string.len(ARGV[ARG_OUTPUT])
  if (tonumber(redis.call("GET", KEYS[14])) or 0) + size > tonumber(ARGV[ARG_FALLBACK_MAX]) then
    return {"FALLBACK_FULL"}
  end
  redis.call("INCRBY", KEYS[14], size)
  redis.call("ZADD", KEYS[13], size, ARGV[ARG_ID])
end

local now = tonumber(ARGV[ARG_NOW])
local S = sched_ctx(KEYS[5], KEYS[6], KEYS[9], ARGV[ARG_CAP], ARGV[ARG_NOW], ARGV[ARG_GRANT_UNTIL], ARGV[ARG_TEMPLATE],
  ARGV[ARG_LOW_HEADROOM_PCT])
local e = ws_effects(ARGV[ARG_ID], ARGV[ARG_NOW])  -- what the workspace gets back (lib/ledger.lua, ws_apply)
if status == "IN_QUEUE" then
  e.queued = 1
  leave_schedule(S, rec.workspace, ARGV[ARG_ID])
  redis.call("ZREM", KEYS[3], ARGV[ARG_ID])  -- a started one left it when it started (claim.lua)
else
  release_slot(S, rec.workspace, ARGV[ARG_ID], true)
end
-- The record's changes, written in one HSET: its outcome, its cost (settle)
-- and its body's bytes given back (give_back_body).
local fields = {"status", "COMPLETED", "completed_at", ARGV[ARG_NOW]}
settle(e, ARGV[ARG_BILLABLE] == "1" and "charge" or "release", rec, fields)
if ARGV[ARG_ERROR_TYPE] == "" then
  append(fields, "content_type", ARGV[ARG_CONTENT_TYPE])
  -- its bytes, wherever kept, in its workspace's stored bytes until it expires
  e.result = {ws = rec.workspace, untl = now + tonumber(ARGV[ARG_RETENTION]),
    bytes = ARGV[ARG_BLOB_KEY] == "" and #ARGV[ARG_OUTPUT] or tonumber(ARGV[ARG_BLOB_SIZE])}
  if ARGV[ARG_BLOB_KEY] == "" then
    redis.call("SET", KEYS[2], ARGV[ARG_OUTPUT], "EX", ARGV[ARG_RETENTION])
  else
    append(fields, "blob_key", ARGV[ARG_BLOB_KEY], "blob_size", ARGV[ARG_BLOB_SIZE],
      "blob_sha256", ARGV[ARG_BLOB_SHA256])
    redis.call("ZADD", KEYS[12], now + tonumber(ARGV[ARG_RETENTION]), ARGV[ARG_ID] .. " " .. ARGV[ARG_BLOB_KEY])
  end
else
  local detail = ARGV[ARG_DETAIL]
  if ARGV[ARG_ERROR_TYPE] == "cancelled" then
    detail = rec.cancel_detail or detail
  end
  append(fields, "error_type", ARGV[ARG_ERROR_TYPE], "detail", detail)
end
-- a failed request's body is kept for its retention: it may be retried
give_back_body(rec, fields, e)
redis.call("HSET", KEYS[1], unpack(fields))
redis.call("EXPIRE", KEYS[1], ARGV[ARG_RETENTION])
drop_body(KEYS[11], ARGV[ARG_RETENTION], ARGV[ARG_ERROR_TYPE] ~= "", rec, e, rec.workspace, ARGV[ARG_NOW])
forget_deadlines(KEYS[10], ARGV[ARG_ID], rec)
owe_webhook(KEYS[1], e, ARGV[ARG_ID], ARGV[ARG_NOW], rec)
owe_ws(ws_target({ws_id = rec.workspace}, KEYS[7], KEYS[8]), e, "end")
announce_completed(ARGV[ARG_ID])

-- Pace estimates for Retry-After: moving averages (weight 0.2) of run time
-- and of the interval between completions, the latter capped at the run time
-- so an idle hour does not read as a slow queue. In the same read and write,
-- the operations page's totals (RequestStore.delivery_totals): completions,
-- those that ran and the seconds they waited, and completions per 10 s
-- window in a ring of 6 fields "done|<window mod 6>" = "<window>:<count>"
-- (requests_maintenance.py, COMPLETIONS_WINDOW_S and COMPLETIONS_RING).
local window = math.floor(now / 10)
local ring = "done|" .. (window % 6)
local stats = redis.call("HMGET", KEYS[4], "avg_run_s", "last_completed_at", "avg_gap_s", "completed", "ran",
  "waited_s", ring)
local done = stats[7]
local in_window = 1
if done then
  local at, count = string.match(done, "^(%d+):(%d+)$")
  if tonumber(at) == window then
    in_window = tonumber(count) + 1
  end
end
local update = {"completed", (tonumber(stats[4]) or 0) + 1, ring, window .. ":" .. in_window}
local started = tonumber(rec.started_at)
if started then
  local run = math.max(now - started, 0)
  local avg_run = tonumber(stats[1]) or run
  avg_run = avg_run * 0.8 + run * 0.2
  local gap = avg_run
  if stats[2] then
    gap = math.min(math.max(now - tonumber(stats[2]), 0), avg_run)
  end
  local avg_gap = tonumber(stats[3]) or gap
  avg_gap = avg_gap * 0.8 + gap * 0.2
  local waited = math.max(started - (tonumber(rec.created_at) or started), 0)
  for _, pair in ipairs({{"avg_run_s", tostring(avg_run)}, {"avg_gap_s", tostring(avg_gap)},
      {"last_completed_at", ARGV[ARG_NOW]},
      {"ran", (tonumber(stats[5]) or 0) + 1}, {"waited_s", tostring((tonumber(stats[6]) or 0) + waited)}}) do
    table.insert(update, pair[1])
    table.insert(update, pair[2])
  end
end
redis.call("HSET", KEYS[4], unpack(update))
return with_granted("COMPLETED", grant(S))
