-- claim.lua: a worker takes a request: IN_QUEUE -> IN_PROGRESS, exactly once.
-- Duplicate deliveries (sweeper re-publish, broker redelivery) find the
-- request already claimed or finished and do nothing.
--
-- KEYS[1] rq:req:{id}   KEYS[2] rq:queue:{provider}   KEYS[3] rq:unpublished
-- ARGV[1] id            ARGV[2] now (unix seconds)
-- returns "CLAIMED" | "IN_PROGRESS" | "COMPLETED" | "MISSING"

local status = redis.call("HGET", KEYS[1], "status")
if not status then
  return "MISSING"
end
if status ~= "IN_QUEUE" then
  return status
end
redis.call("HSET", KEYS[1], "status", "IN_PROGRESS", "started_at", ARGV[2])
redis.call("ZREM", KEYS[2], ARGV[1])
redis.call("ZREM", KEYS[3], ARGV[1])
return "CLAIMED"
