-- expire_queued.lua: end a request that waited IN_QUEUE past its queue
-- timeout, or past its caller's start deadline (X-Comfy-Start-Deadline):
-- COMPLETED queue_timeout, never dispatched, never billed. Run by the sweeper
-- on the head of each queue and on the start deadlines due (lib/ending.lua); claim.lua
-- makes the same checks when a granted request's delivery arrives.
--
-- KEYS[1] P:req:{id}  KEYS[2] P:queue:{provider}  KEYS[3] P:sched:{provider}
-- KEYS[4] W:ws  KEYS[5] W:ledger (or P:owed:{provider} in both places: ws_target,
--         which the store's consistency model links in, lua/effects/)
-- KEYS[6] P:running:{provider}  KEYS[7] the broker's list for the provider
-- KEYS[8] P:deadlines:{provider}  KEYS[9] P:body:{id}
-- ARGV by name (ARGV[ARG_ID] and so on; requests_maintenance.py, EXPIRE_QUEUED_ARGS):
--   id  now (s)  queue_timeout_s  retention (s)  workspace
--   cap (the provider's)  grant_until (a grant's lease end, s)  template (the message template, or "")
--   low_headroom_pct (the cap's share kept from low priority: grant.lua's)
-- returns {"TIMED_OUT", granted ids to publish...} | {"KEPT"}

local status, created_at, start_deadline_at = unpack(redis.call("HMGET", KEYS[1], "status", "created_at",
  "start_deadline_at"))
if status ~= "IN_QUEUE" then
  if not status then
    redis.call("ZREM", KEYS[2], ARGV[ARG_ID])
  end
  redis.call("ZREM", KEYS[8], "start|" .. ARGV[ARG_ID])  -- started or gone: its start deadline no longer matters
  return {"KEPT"}
end
local detail = "waited in the queue longer than the model's queue timeout; never run, never billed"
if tonumber(ARGV[ARG_NOW]) - tonumber(created_at) <= tonumber(ARGV[ARG_QUEUE_TIMEOUT_S]) then
  if not passed(start_deadline_at, ARGV[ARG_NOW]) then
    return {"KEPT"}
  end
  detail = START_DEADLINE_DETAIL
end
local S = sched_ctx(KEYS[3], KEYS[6], KEYS[7], ARGV[ARG_CAP], ARGV[ARG_NOW], ARGV[ARG_GRANT_UNTIL], ARGV[ARG_TEMPLATE],
  ARGV[ARG_LOW_HEADROOM_PCT])
finish_unbilled(ws_target({req = KEYS[1], body = KEYS[9], queue = KEYS[2], deadlines = KEYS[8],
  ws_id = ARGV[ARG_WORKSPACE]}, KEYS[4], KEYS[5]), S, ARGV[ARG_ID], ARGV[ARG_NOW], ARGV[ARG_RETENTION], true, "queue_timeout", detail)
return with_granted("TIMED_OUT", grant(S))
