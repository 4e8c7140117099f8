-- webhook_take.lua: an attempt takes a pending webhook event to deliver it,
-- one attempt at a time. The attempt holds it for a lease: the event's due
-- score moves to the lease's end, so if the worker dies mid-delivery the
-- sweeper publishes the event again then (at least once, same webhook-id).
--
--   missing                     -> "MISSING" (and out of the due set)
--   delivered / gone / given up -> "DONE" (and out of the due set)
--   an attempt's lease is alive -> "BUSY": a duplicate message; nothing changes
--   before its next attempt     -> "NOT_DUE": an early message; nothing changes
--   else                        -> "TAKEN" with the event's fields
--
-- KEYS[1] rq:webhook:{id}   KEYS[2] rq:webhooks:due
-- ARGV[1] request id  ARGV[2] now (s)  ARGV[3] lease (s)  ARGV[4] token of this attempt
-- returns {"TAKEN", field, value, ...} | {"BUSY"} | {"NOT_DUE"} | {"DONE"} | {"MISSING"}

local now = tonumber(ARGV[2])
local e = redis.call("HMGET", KEYS[1], "state", "next_at", "lease_until", "first_attempt_at")
if not e[1] then
  redis.call("ZREM", KEYS[2], ARGV[1])
  return {"MISSING"}
end
if e[1] ~= "pending" then
  redis.call("ZREM", KEYS[2], ARGV[1])
  return {"DONE"}
end
if tonumber(e[3] or "0") > now then
  return {"BUSY"}
end
if tonumber(e[2] or "0") > now then
  redis.call("ZADD", KEYS[2], e[2], ARGV[1])  -- the sweeper publishes it at its time
  return {"NOT_DUE"}
end
local until_ = now + tonumber(ARGV[3])
redis.call("HINCRBY", KEYS[1], "attempts", 1)
redis.call("HSET", KEYS[1], "token", ARGV[4], "lease_until", tostring(until_), "last_attempt_at", ARGV[2])
if not e[4] then
  redis.call("HSET", KEYS[1], "first_attempt_at", ARGV[2])
end
redis.call("ZADD", KEYS[2], until_, ARGV[1])
local reply = redis.call("HGETALL", KEYS[1])
table.insert(reply, 1, "TAKEN")
return reply
