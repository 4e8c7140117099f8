-- webhook_record.lua: what one webhook attempt came to, in one step: its
-- in-flight slot freed, its endpoint's circuit and the failing endpoints, the
-- event's state, its place in the due set, and the workspace's attempt log.
--
--   delivered (2xx)      -> state delivered, out of the due set
--   gone (410)           -> state gone: the receiver asked for no more
--   failed, next_at ""   -> state given_up: the retry window is over
--   failed               -> due again at next_at (the schedule's next delay)
--
-- The endpoint (a workspace's URL origin) answered (delivered, gone): its
-- circuit closes and it leaves the failing endpoints. It failed (no answer in
-- time, no connection, an HTTP error; endpoint_failed "1"): one more failure in a
-- row, and at circuit_failures in a row its circuit opens for circuit_cooling_s seconds (each
-- failed probe opens it again). A failure that is not the endpoint's (its URL
-- refused, no secret) only ends a probe.
--
-- An attempt whose lease ran out and was taken by another ("STALE") only
-- logs, unless it delivered: a 2xx ends the event whoever got it. An event
-- already ended ("DONE": its state, or another event of the request holds the
-- head) only logs. An event that ends makes way for the
-- request's next event owed, due at once (lib.lua, webhook_ended); the last
-- of a completed request gives back the workspace's pending count it held
-- since its admission (admit.lua), once: its "counted" mark goes in the same step.
--
-- KEYS[1] rq:webhook:{id}  KEYS[2] rq:webhook:due:{provider} (the one that holds it)
-- KEYS[3] rq:webhooks:log:{ws}
-- KEYS[4] rq:webhooks:failing-origins  KEYS[5] rq:webhooks:circuit:{ws}|{origin}
-- KEYS[6] rq:webhooks:inflight:{ws}  KEYS[7] rq:webhooks:inflight
-- KEYS[8] rq:ws:{ws}  KEYS[9] rq:ledger:{ws} (its pending events count; split "1":
--   rq:owed:{provider} in both places, lib.lua's ws_target)
-- ARGV by name (ARGV[ARG_REQUEST_ID] and so on; store/webhooks.py,
-- RECORD_ARGS, whose order the generated ARG_* constants give):
--   request_id, token (the attempt's), now (s)
--   outcome            "delivered" | "gone" | "failed"
--   status             HTTP status or ""      error   the error, "" for none
--   next_at            next attempt at (s), "" to give up
--   keep_s             seconds an ended event is kept
--   entry              the log entry (JSON)   log_length  attempts kept in the log
--   endpoint           "{ws}|{origin}"        endpoint_failed  "1" when it failed
--   circuit_failures   failures in a row that open its circuit (0: none)
--   circuit_cooling_s  seconds it stays open
--   failing_kept       failing endpoints kept (the most recent)
--   failing_window_s   seconds one is kept
--   msg_id             the event's webhook-id: an attempt at an event that
--                      already ended (the request's next one holds the head
--                      now) only logs
--   split              "1" on a store split into per-slot steps (lib.lua, ws_target)
-- returns {"DELIVERED" | "GONE" | "GAVE_UP", effects owed...} | {"RETRY"} | {"STALE"} | {"DONE"}
--   | {"MISSING"}

local now = tonumber(ARGV[ARG_NOW])
redis.call("ZREM", KEYS[6], ARGV[ARG_TOKEN])
redis.call("ZREM", KEYS[7], ARGV[ARG_TOKEN])

local outcome = ARGV[ARG_OUTCOME]
if outcome == "delivered" or outcome == "gone" then
  redis.call("DEL", KEYS[5])
  redis.call("ZREM", KEYS[4], ARGV[ARG_ENDPOINT])
elseif ARGV[ARG_ENDPOINT_FAILED] == "1" then
  local failures = redis.call("HINCRBY", KEYS[5], "failures", 1)
  redis.call("HSET", KEYS[5], "probe_until", 0, "last_failure_at", ARGV[ARG_NOW])
  local threshold = tonumber(ARGV[ARG_CIRCUIT_FAILURES])
  if threshold > 0 and failures >= threshold then
    redis.call("HSET", KEYS[5], "open_until", tostring(now + tonumber(ARGV[ARG_CIRCUIT_COOLING_S])))
  end
  redis.call("EXPIRE", KEYS[5], ARGV[ARG_FAILING_WINDOW_S])
  redis.call("ZADD", KEYS[4], ARGV[ARG_NOW], ARGV[ARG_ENDPOINT])
  -- bounded: none older than the window, at most failing_kept of them
  redis.call("ZREMRANGEBYSCORE", KEYS[4], "-inf", tostring(now - tonumber(ARGV[ARG_FAILING_WINDOW_S])))
  redis.call("ZREMRANGEBYRANK", KEYS[4], 0, -(tonumber(ARGV[ARG_FAILING_KEPT]) + 1))
elseif redis.call("EXISTS", KEYS[5]) == 1 then
  redis.call("HSET", KEYS[5], "probe_until", 0)
end

local e = redis.call("HMGET", KEYS[1], "state", "token", "msg_id", "workspace")
if not e[1] then
  return {"MISSING"}
end
redis.call("LPUSH", KEYS[3], ARGV[ARG_ENTRY])
redis.call("LTRIM", KEYS[3], 0, tonumber(ARGV[ARG_LOG_LENGTH]) - 1)
if e[1] ~= "pending" or (e[3] or ("msg_" .. ARGV[ARG_REQUEST_ID])) ~= ARGV[ARG_MSG_ID] then
  return {"DONE"}
end
if e[2] ~= ARGV[ARG_TOKEN] and outcome ~= "delivered" then
  return {"STALE"}
end
redis.call("HSET", KEYS[1], "last_status", ARGV[ARG_STATUS], "last_error", ARGV[ARG_ERROR], "lease_until", 0)

-- the event ends; the request's next event, if one is owed, takes its place
local function finish(state, code)
  webhook_ended(KEYS[1], ws_target({ws_id = e[4] or ""}, KEYS[8], KEYS[9], ARGV[ARG_SPLIT]), KEYS[2],
    ARGV[ARG_REQUEST_ID], state, ARGV[ARG_NOW], ARGV[ARG_KEEP_S])
  return with_granted(code, {})
end

if outcome == "delivered" then
  return finish("delivered", "DELIVERED")
end
if outcome == "gone" then
  return finish("gone", "GONE")
end
if ARGV[ARG_NEXT_AT] == "" then
  return finish("given_up", "GAVE_UP")
end
redis.call("HSET", KEYS[1], "next_at", ARGV[ARG_NEXT_AT])
redis.call("ZADD", KEYS[2], ARGV[ARG_NEXT_AT], ARGV[ARG_REQUEST_ID])
return {"RETRY"}
