-- cancel.lua: a caller asks to cancel. A queued request is cancelled at once
-- (COMPLETED with error_type "cancelled"; a slot granted to it goes to the
-- next in the schedule); a running one is flagged for its worker, which stops
-- between steps; a finished one is left alone.
-- Ownership is checked here too, so another workspace's id changes nothing.
-- The sweeper cancels through here too when a request's deadline passes
-- (X-Comfy-Deadline, ARGV[10] "deadline"): the same path, its own detail,
-- and its member of the deadline index gone whatever it found.
--
-- KEYS[1] rq:req:{id}   KEYS[2] rq:queue:{provider}   KEYS[3] rq:sched:{provider}
-- KEYS[4] rq:ws:{workspace}   KEYS[5] rq:ledger:{workspace}
-- KEYS[6] rq:running:{provider}   KEYS[7] the broker's list for the provider
-- KEYS[8] rq:deadlines:{provider}  KEYS[9] rq:body:{id}
-- ARGV[1] id  ARGV[2] workspace  ARGV[3] model  ARGV[4] now  ARGV[5] retention (s)
-- ARGV[6] the provider's cap  ARGV[7] grant lease end (s)  ARGV[8] message template or ""
-- ARGV[9] deadline (Unix seconds, Redis's clock) past which nothing changes; "" for none
-- ARGV[10] who cancels: "" the caller, "deadline" the caller's X-Comfy-Deadline
-- returns {"CANCELLED", granted ids to publish...} | {"REQUESTED"}
--       | {"ALREADY_COMPLETED"} | {"MISSING"} | {"EXPIRED"}

if past_deadline(ARGV[9]) then
  return {"EXPIRED"}
end

local by_deadline = ARGV[10] == "deadline"
if by_deadline then
  redis.call("ZREM", KEYS[8], "run|" .. ARGV[1])
end
local rec = redis.call("HMGET", KEYS[1], "status", "workspace", "model")
if not rec[1] or rec[2] ~= ARGV[2] or rec[3] ~= ARGV[3] then
  return {"MISSING"}
end
if rec[1] == "COMPLETED" then
  return {"ALREADY_COMPLETED"}
end
if rec[1] == "IN_PROGRESS" then
  redis.call("HSET", KEYS[1], "cancel_requested", ARGV[4])
  -- what its completion as cancelled will say: the first cancel's reason
  redis.call("HSETNX", KEYS[1], "cancel_detail",
    by_deadline and DEADLINE_DETAIL or "cancelled by the caller while running")
  return {"REQUESTED"}
end
local S = sched_ctx(KEYS[3], KEYS[6], KEYS[7], ARGV[6], ARGV[4], ARGV[7], ARGV[8])
finish_unbilled({req = KEYS[1], body = KEYS[9], queue = KEYS[2], ws = KEYS[4], ledger = KEYS[5], deadlines = KEYS[8],
  ws_id = ARGV[2]}, S, ARGV[1], ARGV[4], ARGV[5], true, "cancelled",
  by_deadline and DEADLINE_DETAIL or "cancelled by the caller while queued")
return with_granted("CANCELLED", grant(S))
