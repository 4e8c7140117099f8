-- cancel.lua: a caller asks to cancel. A queued request is cancelled at once
-- (COMPLETED with error_type "cancelled"); a running one is flagged for its
-- worker, which stops between steps; a finished one is left alone.
-- Ownership is checked here too, so another workspace's id changes nothing.
--
-- KEYS[1] rq:req:{id}   KEYS[2] rq:queue:{provider}   KEYS[3] rq:due
-- KEYS[4] rq:ws:{workspace}   KEYS[5] rq:ledger:{workspace}
-- ARGV[1] id  ARGV[2] workspace  ARGV[3] model  ARGV[4] now  ARGV[5] retention (s)
-- returns "CANCELLED" | "REQUESTED" | "ALREADY_COMPLETED" | "MISSING"

local rec = redis.call("HMGET", KEYS[1], "status", "workspace", "model")
if not rec[1] or rec[2] ~= ARGV[2] or rec[3] ~= ARGV[3] then
  return "MISSING"
end
if rec[1] == "COMPLETED" then
  return "ALREADY_COMPLETED"
end
if rec[1] == "IN_PROGRESS" then
  redis.call("HSET", KEYS[1], "cancel_requested", ARGV[4])
  return "REQUESTED"
end
finish_unbilled({req = KEYS[1], queue = KEYS[2], due = KEYS[3], ws = KEYS[4], ledger = KEYS[5]},
  ARGV[1], ARGV[4], ARGV[5], true, "cancelled", "cancelled by the caller while queued")
return "CANCELLED"
