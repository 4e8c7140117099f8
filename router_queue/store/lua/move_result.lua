-- move_result.lua: a result kept in Redis while the object store was away
-- (complete.lua's fallback) now has its object: point the record at it and
-- drop the inline copy, or forget a result that expired before it moved.
-- Checked here, in the same step: the record still holds the inline result
-- (a collect reads either the bytes or the pointer, never neither), and the
-- fallback budget is given back once.
--
-- KEYS[1] P:req:{id}   KEYS[2] P:result:{id}   KEYS[3] P:fallback:{provider}
-- KEYS[4] P:fallback-bytes:{provider}   KEYS[5] P:objects:{provider}
-- ARGV by name (fallback.py, MOVE_ARGS):
--   id  now (unix seconds)  blob_key ("": only forget an expired result)  blob_size  blob_sha256
-- returns "MOVED" | "GONE" (the result expired: forgotten, its bytes given back)
--   | "HELD" (blob_key "" and the result still lives) | "NOT_WAITING" (moved or forgotten before)
--   | "CHANGED" (the inline result is not blob_size bytes: left as it is)

local bytes = redis.call("ZSCORE", KEYS[3], ARGV[ARG_ID])
if not bytes then
  return "NOT_WAITING"
end
local function give_back()
  redis.call("ZREM", KEYS[3], ARGV[ARG_ID])
  if redis.call("DECRBY", KEYS[4], bytes) <= 0 then
    redis.call("DEL", KEYS[4])
  end
end
local held = redis.call("STRLEN", KEYS[2])
if held == 0 or redis.call("HEXISTS", KEYS[1], "blob_key") == 1 then
  give_back()
  return "GONE"
end
if ARGV[ARG_BLOB_KEY] == "" then
  return "HELD"
end
if held ~= tonumber(ARGV[ARG_BLOB_SIZE]) then
  return "CHANGED"
end
local ttl = redis.call("PTTL", KEYS[1])
redis.call("HSET", KEYS[1], "blob_key", ARGV[ARG_BLOB_KEY], "blob_size", ARGV[ARG_BLOB_SIZE],
  "blob_sha256", ARGV[ARG_BLOB_SHA256])
redis.call("DEL", KEYS[2])
local expires = tonumber(ARGV[ARG_NOW]) + (ttl > 0 and ttl / 1000 or 0)
redis.call("ZADD", KEYS[5], expires, ARGV[ARG_ID] .. " " .. ARGV[ARG_BLOB_KEY])
give_back()
return "MOVED"
