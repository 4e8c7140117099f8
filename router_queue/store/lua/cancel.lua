-- cancel.lua: a caller asks to cancel. A queued request is cancelled at once
-- (COMPLETED with error_type "cancelled"; a slot granted to it goes to the
-- next in the schedule); a running one is flagged for its worker, which stops
-- between steps; a finished one is left alone.
-- Ownership is checked here too, so another workspace's id changes nothing.
-- The sweeper cancels through here too when a request's deadline passes
-- (X-Comfy-Deadline, by "deadline"): the same path, its own detail,
-- and its member of the deadline index gone whatever it found.
--
-- KEYS[1] P:req:{id}   KEYS[2] P:queue:{provider}   KEYS[3] P:sched:{provider}
-- KEYS[4] W:ws   KEYS[5] W:ledger (or P:owed:{provider} in both places: ws_target,
--         which the store's consistency model links in, lua/effects/)
-- KEYS[6] P:running:{provider}   KEYS[7] the broker's list for the provider
-- KEYS[8] P:deadlines:{provider}  KEYS[9] P:body:{id}
-- ARGV by name (ARGV[ARG_ID] and so on; requests_front.py, CANCEL_ARGS):
--   id  workspace  model  now  retention (s)
--   cap (the provider's)  grant_until (a grant's lease end, s)  template (the message template, or "")
--   low_headroom_pct (the cap's share kept from low priority: grant.lua's)
--   write_deadline (Unix seconds, Redis's clock) past which nothing changes; "" for none
--   by: who cancels, "" the caller, "deadline" the caller's X-Comfy-Deadline
-- returns {"CANCELLED", granted ids to publish..., effects owed...} | {"REQUESTED"}
--       | {"ALREADY_COMPLETED"} | {"MISSING"} | {"EXPIRED"}

if past_deadline(ARGV[ARG_WRITE_DEADLINE]) then
  return {"EXPIRED"}
end

local by_deadline = ARGV[ARG_BY] == "deadline"
if by_deadline then
  redis.call("ZREM", KEYS[8], "run|" .. ARGV[ARG_ID])
end
local status, workspace, model = unpack(redis.call("HMGET", KEYS[1], "status", "workspace", "model"))
if not status or workspace ~= ARGV[ARG_WORKSPACE] or model ~= ARGV[ARG_MODEL] then
  return {"MISSING"}
end
if status == "COMPLETED" then
  return {"ALREADY_COMPLETED"}
end
if status == "IN_PROGRESS" then
  redis.call("HSET", KEYS[1], "cancel_requested", ARGV[ARG_NOW])
  -- what its completion as cancelled will say: the first cancel's reason
  redis.call("HSETNX", KEYS[1], "cancel_detail",
    by_deadline and DEADLINE_DETAIL or "cancelled by the caller while running")
  return {"REQUESTED"}
end
local S = sched_ctx(KEYS[3], KEYS[6], KEYS[7], ARGV[ARG_CAP], ARGV[ARG_NOW], ARGV[ARG_GRANT_UNTIL], ARGV[ARG_TEMPLATE],
  ARGV[ARG_LOW_HEADROOM_PCT])
finish_unbilled(ws_target({req = KEYS[1], body = KEYS[9], queue = KEYS[2], deadlines = KEYS[8],
  ws_id = ARGV[ARG_WORKSPACE]}, KEYS[4], KEYS[5]), S, ARGV[ARG_ID], ARGV[ARG_NOW], ARGV[ARG_RETENTION], true, "cancelled",
  by_deadline and DEADLINE_DETAIL or "cancelled by the caller while queued")
return with_granted("CANCELLED", grant(S))
