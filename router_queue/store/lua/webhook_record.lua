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
-- time, no connection, an HTTP error; ARGV[12] "1"): one more failure in a
-- row, and at ARGV[13] in a row its circuit opens for ARGV[14] seconds (each
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
-- KEYS[1] rq:webhook:{id}  KEYS[2] rq:webhooks:due  KEYS[3] rq:webhooks:log:{ws}
-- KEYS[4] rq:webhooks:failing-origins  KEYS[5] rq:webhooks:circuit:{ws}|{origin}
-- KEYS[6] rq:webhooks:inflight:{ws}  KEYS[7] rq:webhooks:inflight
-- KEYS[8] rq:ws:{ws} (its pending events count)
-- ARGV[1] request id  ARGV[2] token of the attempt  ARGV[3] now (s)
-- ARGV[4] outcome: "delivered" | "gone" | "failed"  ARGV[5] HTTP status or ""
-- ARGV[6] the error, "" for none  ARGV[7] next attempt at (s), "" to give up
-- ARGV[8] seconds an ended event is kept  ARGV[9] the log entry (JSON)
-- ARGV[10] attempts kept in the log  ARGV[11] the endpoint, "{ws}|{origin}"
-- ARGV[12] "1" when the endpoint failed  ARGV[13] failures in a row that open
-- its circuit (0: none)  ARGV[14] seconds it stays open
-- ARGV[15] failing endpoints kept (the most recent)  ARGV[16] seconds one is kept
-- ARGV[17] the event's webhook-id: an attempt at an event that already ended
--          (the request's next one holds the head now) only logs
-- returns {"DELIVERED"} | {"GONE"} | {"GAVE_UP"} | {"RETRY"} | {"STALE"} | {"DONE"} | {"MISSING"}

local now = tonumber(ARGV[3])
redis.call("ZREM", KEYS[6], ARGV[2])
redis.call("ZREM", KEYS[7], ARGV[2])

local outcome = ARGV[4]
if outcome == "delivered" or outcome == "gone" then
  redis.call("DEL", KEYS[5])
  redis.call("ZREM", KEYS[4], ARGV[11])
elseif ARGV[12] == "1" then
  local failures = redis.call("HINCRBY", KEYS[5], "failures", 1)
  redis.call("HSET", KEYS[5], "probe_until", 0, "last_failure_at", ARGV[3])
  local threshold = tonumber(ARGV[13])
  if threshold > 0 and failures >= threshold then
    redis.call("HSET", KEYS[5], "open_until", tostring(now + tonumber(ARGV[14])))
  end
  redis.call("EXPIRE", KEYS[5], ARGV[16])
  redis.call("ZADD", KEYS[4], ARGV[3], ARGV[11])
  -- bounded: none older than the window, at most ARGV[15] of them
  redis.call("ZREMRANGEBYSCORE", KEYS[4], "-inf", tostring(now - tonumber(ARGV[16])))
  redis.call("ZREMRANGEBYRANK", KEYS[4], 0, -(tonumber(ARGV[15]) + 1))
elseif redis.call("EXISTS", KEYS[5]) == 1 then
  redis.call("HSET", KEYS[5], "probe_until", 0)
end

local e = redis.call("HMGET", KEYS[1], "state", "token", "msg_id")
if not e[1] then
  return {"MISSING"}
end
redis.call("LPUSH", KEYS[3], ARGV[9])
redis.call("LTRIM", KEYS[3], 0, tonumber(ARGV[10]) - 1)
if e[1] ~= "pending" or (e[3] or ("msg_" .. ARGV[1])) ~= ARGV[17] then
  return {"DONE"}
end
if e[2] ~= ARGV[2] and outcome ~= "delivered" then
  return {"STALE"}
end
redis.call("HSET", KEYS[1], "last_status", ARGV[5], "last_error", ARGV[6], "lease_until", 0)

-- the event ends; the request's next event, if one is owed, takes its place
local function finish(state, code)
  webhook_ended(KEYS[1], KEYS[8], ARGV[1], state, ARGV[3], ARGV[8])
  return {code}
end

if outcome == "delivered" then
  return finish("delivered", "DELIVERED")
end
if outcome == "gone" then
  return finish("gone", "GONE")
end
if ARGV[7] == "" then
  return finish("given_up", "GAVE_UP")
end
redis.call("HSET", KEYS[1], "next_at", ARGV[7])
redis.call("ZADD", KEYS[2], ARGV[7], ARGV[1])
return {"RETRY"}
