-- complete.lua: finish a request with its output or its error bucket, and
-- settle its credits: charged when the provider bills (a success, or a
-- refusal the catalog says is billed), released otherwise.
-- Status only moves forward: a request already COMPLETED is left untouched,
-- so a duplicate or late worker can never overwrite the first outcome nor
-- charge a second time.
--
-- The slot it held goes to the request the schedule names next (lib.lua, grant).
--
-- KEYS[1] rq:req:{id}   KEYS[2] rq:result:{id}   KEYS[3] rq:queue:{provider}
-- KEYS[4] rq:stats:{provider}   KEYS[5] rq:sched:{provider}   KEYS[6] rq:running:{provider}
-- KEYS[7] rq:ws:{workspace}     KEYS[8] rq:ledger:{workspace}
-- KEYS[9] the broker's list for the provider  KEYS[10] rq:deadlines:{provider}
-- KEYS[11] rq:body:{id}
-- ARGV[1] id   ARGV[2] now (unix seconds)   ARGV[3] retention (s)
-- ARGV[4] error_type ("" on success)        ARGV[5] detail (a cancel's own
--         reason, cancel.lua's cancel_detail, wins over it for "cancelled")
-- ARGV[6] content type                      ARGV[7] output bytes
-- ARGV[8] "1" when the provider bills this outcome
-- ARGV[9] the provider's cap  ARGV[10] grant lease end (s)  ARGV[11] message template or ""
-- returns {"COMPLETED", granted ids to publish...} | {"ALREADY_COMPLETED"} | {"MISSING"}

local rec = redis.call("HMGET", KEYS[1], "status", "workspace")
local status = rec[1]
if not status then
  return {"MISSING"}
end
if status == "COMPLETED" then
  return {"ALREADY_COMPLETED"}
end

local now = tonumber(ARGV[2])
local S = sched_ctx(KEYS[5], KEYS[6], KEYS[9], ARGV[9], ARGV[2], ARGV[10], ARGV[11])
if status == "IN_QUEUE" then
  left_queue(KEYS[7])
  leave_schedule(S, rec[2], ARGV[1])
else
  release_slot(S, rec[2], ARGV[1])
end
redis.call("HSET", KEYS[1], "status", "COMPLETED", "completed_at", ARGV[2])
settle(KEYS[1], KEYS[7], KEYS[8], ARGV[1], ARGV[8] == "1" and "charge" or "release", ARGV[2])
if ARGV[4] == "" then
  redis.call("HSET", KEYS[1], "content_type", ARGV[6])
  redis.call("SET", KEYS[2], ARGV[7], "EX", ARGV[3])
else
  local detail = ARGV[5]
  if ARGV[4] == "cancelled" then
    detail = redis.call("HGET", KEYS[1], "cancel_detail") or detail
  end
  redis.call("HSET", KEYS[1], "error_type", ARGV[4], "detail", detail)
end
redis.call("EXPIRE", KEYS[1], ARGV[3])
-- a failed request's body is kept for its retention: it may be retried
drop_body(KEYS[1], KEYS[11], KEYS[7], ARGV[4] ~= "" and ARGV[3] or nil)
forget_deadlines(KEYS[10], ARGV[1])
owe_webhook(KEYS[1], KEYS[7], ARGV[1], ARGV[2])
announce_completed(ARGV[1])
redis.call("ZREM", KEYS[3], ARGV[1])

-- Pace estimates for Retry-After: moving averages (weight 0.2) of run time
-- and of the interval between completions, the latter capped at the run time
-- so an idle hour does not read as a slow queue.
local started = tonumber(redis.call("HGET", KEYS[1], "started_at"))
if started then
  local run = math.max(now - started, 0)
  local avg_run = tonumber(redis.call("HGET", KEYS[4], "avg_run_s")) or run
  avg_run = avg_run * 0.8 + run * 0.2
  local last = tonumber(redis.call("HGET", KEYS[4], "last_completed_at"))
  local gap = avg_run
  if last then
    gap = math.min(math.max(now - last, 0), avg_run)
  end
  local avg_gap = tonumber(redis.call("HGET", KEYS[4], "avg_gap_s")) or gap
  avg_gap = avg_gap * 0.8 + gap * 0.2
  redis.call("HSET", KEYS[4], "avg_run_s", tostring(avg_run), "avg_gap_s", tostring(avg_gap),
    "last_completed_at", ARGV[2])
end
return with_granted("COMPLETED", grant(S))
