-- webhook_record.lua: what one webhook attempt came to, in one step: the
-- event's state, its place in the due set, the workspace's attempt log and
-- the failing endpoints.
--
--   delivered (2xx)      -> state delivered, out of the due set
--   gone (410)           -> state gone: the receiver asked for no more
--   failed, next_at ""   -> state given_up: the retry window is over
--   failed               -> due again at next_at (the schedule's next delay)
--
-- An attempt whose lease ran out and was taken by another ("STALE") only
-- logs, unless it delivered: a 2xx ends the event whoever got it. An event
-- already ended ("DONE") only logs. An event that ends gives back the
-- workspace's pending event it held since its request's admission (admit.lua),
-- once: its "counted" mark goes in the same step.
--
-- KEYS[1] rq:webhook:{id}  KEYS[2] rq:webhooks:due  KEYS[3] rq:webhooks:log:{ws}
-- KEYS[4] rq:webhooks:failing  KEYS[5] rq:ws:{ws} (its pending events count)
-- ARGV[1] request id  ARGV[2] token of the attempt  ARGV[3] now (s)
-- ARGV[4] outcome: "delivered" | "gone" | "failed"  ARGV[5] HTTP status or ""
-- ARGV[6] the error, "" for none  ARGV[7] next attempt at (s), "" to give up
-- ARGV[8] seconds an ended event is kept  ARGV[9] the log entry (JSON)
-- ARGV[10] attempts kept in the log
-- returns {"DELIVERED"} | {"GONE"} | {"RETRY"} | {"GAVE_UP"} | {"STALE"} | {"DONE"} | {"MISSING"}

local e = redis.call("HMGET", KEYS[1], "state", "token", "url", "workspace", "counted")
if not e[1] then
  return {"MISSING"}
end
redis.call("LPUSH", KEYS[3], ARGV[9])
redis.call("LTRIM", KEYS[3], 0, tonumber(ARGV[10]) - 1)
if e[1] ~= "pending" then
  return {"DONE"}
end
local outcome = ARGV[4]
if e[2] ~= ARGV[2] and outcome ~= "delivered" then
  return {"STALE"}
end
local endpoint = e[4] .. "|" .. e[3]
redis.call("HSET", KEYS[1], "last_status", ARGV[5], "last_error", ARGV[6], "lease_until", 0)

local function finish(state)
  redis.call("HSET", KEYS[1], "state", state, "done_at", ARGV[3])
  redis.call("ZREM", KEYS[2], ARGV[1])
  redis.call("EXPIRE", KEYS[1], ARGV[8])
  if e[5] == "1" then
    redis.call("HDEL", KEYS[1], "counted")
    if redis.call("HINCRBY", KEYS[5], "webhooks_pending", -1) < 0 then
      redis.call("HSET", KEYS[5], "webhooks_pending", 0)
    end
  end
end

if outcome == "delivered" then
  finish("delivered")
  redis.call("HDEL", KEYS[4], endpoint)
  return {"DELIVERED"}
end
redis.call("HINCRBY", KEYS[4], endpoint, 1)
if outcome == "gone" then
  finish("gone")
  return {"GONE"}
end
if ARGV[7] == "" then
  finish("given_up")
  return {"GAVE_UP"}
end
redis.call("HSET", KEYS[1], "next_at", ARGV[7])
redis.call("ZADD", KEYS[2], ARGV[7], ARGV[1])
return {"RETRY"}
