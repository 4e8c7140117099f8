-- webhook_turn.lua: the workspace's part of an attempt taking a webhook
-- event, with the workspace's keys alone: its endpoint's circuit, then the
-- workspace's turn. The event's part comes next (webhook_take.lua, given
-- this answer). A turn held is a slot in the workspace's in-flight set for
-- the attempt's lease, so the slot of a worker killed mid-delivery frees
-- itself at the lease's end, as does one whose caller died before the
-- event's part, or before giving back a turn the event was not taken in
-- (webhook_turn_end.lua).
--
--   its endpoint's circuit open     -> "OPEN", until: when its cooling ends
--   cooled, and another attempt probes the endpoint -> "PROBING"
--   its workspace at its cap        -> "WAIT"
--   else                            -> "HELD": the slot is this attempt's; "PROBE"
--     when the circuit was open and its cooling is over: this attempt probes
--     the endpoint (its probe mark set for the lease, so no other does)
--
-- KEYS[1] W:webhooks:inflight ({ws:<id>})  KEYS[2] W:webhooks:circuit:{origin}
-- ARGV by name (ARGV[ARG_NOW] and so on; store/webhooks.py, TURN_ARGS):
--   now (s)  lease_s  token (of this attempt)
--   max_in_flight: attempts in flight per workspace (0: no cap)
--   circuit_failures: failures in a row that open a circuit (0: no circuit)
-- returns {"HELD"} | {"PROBE"} | {"OPEN", until} | {"PROBING"} | {"WAIT"}

local now = tonumber(ARGV[ARG_NOW])
local lease_until = now + tonumber(ARGV[ARG_LEASE_S])

-- The endpoint's circuit: open once its failures in a row reach the threshold.
local probe = false
if tonumber(ARGV[ARG_CIRCUIT_FAILURES]) > 0 then
  local c = redis.call("HMGET", KEYS[2], "failures", "open_until", "probe_until")
  if tonumber(c[1] or "0") >= tonumber(ARGV[ARG_CIRCUIT_FAILURES]) then
    if tonumber(c[2] or "0") > now then
      return {"OPEN", c[2]}
    end
    if tonumber(c[3] or "0") > now then
      return {"PROBING"}
    end
    probe = true
  end
end

-- The workspace's turn: at most max_in_flight attempts in flight; a dead worker's
-- slot leaves at its lease's end.
local cap = tonumber(ARGV[ARG_MAX_IN_FLIGHT])
if cap > 0 then
  redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", ARGV[ARG_NOW])
  if redis.call("ZCARD", KEYS[1]) >= cap then
    return {"WAIT"}
  end
end
redis.call("ZADD", KEYS[1], lease_until, ARGV[ARG_TOKEN])
redis.call("EXPIRE", KEYS[1], math.ceil(tonumber(ARGV[ARG_LEASE_S])) + 1)
if probe then
  redis.call("HSET", KEYS[2], "probe_until", tostring(lease_until))
  return {"PROBE"}
end
return {"HELD"}
