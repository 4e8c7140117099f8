-- status.lua: what a status or result read shows, in one round trip, with the
-- call counted in the caller's rate windows first (ratelimit.py).
-- KEYS[1] P:req:{id}  KEYS[2] P:sched:{provider}  KEYS[3] P:stats:{provider}
-- KEYS[4..] the caller's rate-window counters
-- ARGV by name (requests_front.py, STATUS_ARGS): id  at_workspace, at_status (where
-- "workspace" and "status" are among the fields)  nfields (how many record
-- fields follow); from ARGV[ARG_REST] the fields (requests_base.py, _FIELDS), then a (limit, window
-- seconds) pair per rate-window counter
-- returns {"RATE_LIMITED", window index, ms left}
--       | {"OK", field values, ttl or false, position or false, {avg_run_s, avg_gap_s} or false,
--          {{count, ms left} per rate-window counter}: where the caller's windows
--          stand once counted (the RateLimit header field: ratelimit.py)}
-- The position (lib/schedule.lua, position) is read only while the request waits;
-- the record's TTL only once it is COMPLETED (a record expires only from
-- the step that completes it: complete.lua, lib/ending.lua's finish_unbilled; before
-- that its TTL is -1, which reads as none); the provider's pace only while
-- it is not COMPLETED (it is for Retry-After, which a finished request is
-- not sent: web/pacing.py). A missing record reads neither.

local at_ws, at_status, at_pin = tonumber(ARGV[ARG_AT_WORKSPACE]), tonumber(ARGV[ARG_AT_STATUS]),
  tonumber(ARGV[ARG_AT_PIN_GROUP])
local nfields = tonumber(ARGV[ARG_NFIELDS])
local spent = spend_rate(4, ARG_REST + nfields)
if spent then
  return {"RATE_LIMITED", spent[1], spent[2]}
end
local values = redis.call("HMGET", KEYS[1], unpack(ARGV, ARG_REST, ARG_REST - 1 + nfields))
local status = values[at_status]
local rank, ttl, pace = false, false, false
if status == "COMPLETED" then
  ttl = redis.call("TTL", KEYS[1])
elseif status then
  if status == "IN_QUEUE" then
    rank = position(KEYS[2], values[at_ws], ARGV[ARG_ID], values[at_pin])
  end
  pace = redis.call("HMGET", KEYS[3], "avg_run_s", "avg_gap_s")
end
return {"OK", values, ttl, rank, pace, rate_windows(4)}
