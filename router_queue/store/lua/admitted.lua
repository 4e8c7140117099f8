-- admitted.lua: what an admission whose reply never reached the front door
-- (its wait ran out, or its connection broke, after the script was sent)
-- did. Only admit.lua (one Redis) or admit_place.lua (split) writes a
-- request's record, each in this slot and only before its write deadline by
-- Redis's clock: so a record means admitted, and no record once that clock
-- is past the deadline means never admitted, whatever is still in flight.
-- Read-only (requests.py, RequestStore._lost_reply).
--
-- KEYS[1] P:req:{id}  KEYS[2] P:sched:{provider} (its position, lib/schedule.lua)
-- ARGV by name (requests.py, ADMITTED_ARGS):
--   id                   the request id the front door minted for it
--   write_deadline       the admission's (Unix seconds, Redis's clock), or ""
-- returns {"ADMITTED", position} | {"NOT_ADMITTED"}
--       | {"UNDECIDED", seconds until the deadline, or -1 when it has none}

local workspace = redis.call("HGET", KEYS[1], "workspace")
if workspace then
  return {"ADMITTED", position(KEYS[2], workspace, ARGV[ARG_ID]) or 0}
end
local deadline = ARGV[ARG_WRITE_DEADLINE]
if deadline == "" then
  return {"UNDECIDED", "-1"}
end
if past_deadline(deadline) then
  return {"NOT_ADMITTED"}
end
local t = redis.call("TIME")
return {"UNDECIDED", tostring(tonumber(deadline) - (tonumber(t[1]) + tonumber(t[2]) / 1000000))}
