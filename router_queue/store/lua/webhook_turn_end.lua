-- webhook_turn_end.lua: the workspace's part of what one webhook attempt
-- came to, with the workspace's keys alone (the event's part is
-- webhook_record.lua, before it): its in-flight slot freed, its endpoint's
-- circuit, and its line in the workspace's attempt log. Also a turn held
-- (webhook_turn.lua) for an event its part did not take (outcome ""), given
-- back at once: its slot freed, and its probe mark if it was to probe.
--
-- The endpoint (a workspace's URL origin) answered (delivered, gone): its
-- circuit closes. It failed (no answer in time, no connection, an HTTP
-- error; endpoint_failed "1"): one more failure in a row, and at
-- circuit_failures in a row its circuit opens for circuit_cooling_s seconds
-- (each failed probe opens it again). A failure that is not the endpoint's
-- (its URL refused, no secret) only ends a probe. (The failing endpoints
-- every workspace shares are written apart: store/webhooks.py, record.)
--
-- KEYS[1] W:webhooks:inflight ({ws:<id>})  KEYS[2] W:webhooks:circuit:{origin}
-- KEYS[3] W:webhooks:log
-- ARGV by name (ARGV[ARG_TOKEN] and so on; store/webhooks.py, TURN_END_ARGS):
--   token (the attempt's)  now (s)
--   outcome            "delivered" | "gone" | "failed" | "" (a turn given back unused)
--   endpoint_failed    "1" when it failed
--   circuit_failures   failures in a row that open its circuit (0: none)
--   circuit_cooling_s  seconds it stays open
--   failing_window_s   seconds a circuit is kept after its last failure
--   entry              the log entry (JSON), "" for none   log_length  attempts kept in the log
--   probe              "1": the turn given back was to probe the endpoint
-- returns 1

local now = tonumber(ARGV[ARG_NOW])
redis.call("ZREM", KEYS[1], ARGV[ARG_TOKEN])

local outcome = ARGV[ARG_OUTCOME]
if outcome == "delivered" or outcome == "gone" then
  redis.call("DEL", KEYS[2])
elseif outcome == "failed" and ARGV[ARG_ENDPOINT_FAILED] == "1" then
  local failures = redis.call("HINCRBY", KEYS[2], "failures", 1)
  redis.call("HSET", KEYS[2], "probe_until", 0, "last_failure_at", ARGV[ARG_NOW])
  local threshold = tonumber(ARGV[ARG_CIRCUIT_FAILURES])
  if threshold > 0 and failures >= threshold then
    redis.call("HSET", KEYS[2], "open_until", tostring(now + tonumber(ARGV[ARG_CIRCUIT_COOLING_S])))
  end
  redis.call("EXPIRE", KEYS[2], ARGV[ARG_FAILING_WINDOW_S])
elseif (outcome ~= "" or ARGV[ARG_PROBE] == "1") and redis.call("EXISTS", KEYS[2]) == 1 then
  redis.call("HSET", KEYS[2], "probe_until", 0)
end

if ARGV[ARG_ENTRY] ~= "" then
  redis.call("LPUSH", KEYS[3], ARGV[ARG_ENTRY])
  redis.call("LTRIM", KEYS[3], 0, tonumber(ARGV[ARG_LOG_LENGTH]) - 1)
end
return 1
