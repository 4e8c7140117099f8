-- key_resolve.lua: who an API key is, for the front door when its in-process
-- cache has no live answer, and that it was used: last_used_at is written at
-- most once per interval, in this same round trip, so a call costs no write.
--
-- KEYS[1] rq:apikey:{sha256(key)}  KEYS[2] rq:key:{key id}
-- ARGV by name (apikeys.py, RESOLVE_ARGS): now (s)
--   last_used_every_s (seconds between two writes of last_used_at)
-- returns {} for an unknown key, else {what it resolves to (the workspace id,
--         or "-"), ms until it stops (-1: no end), a legacy key's namespace or ""}

local owner = redis.call("GET", KEYS[1])
if not owner then
  return {}
end
local left = redis.call("PTTL", KEYS[1])
local record = redis.call("HMGET", KEYS[2], "workspace", "last_used_at", "namespace")
if record[1] and (not record[2] or tonumber(ARGV[ARG_NOW]) - tonumber(record[2]) >= tonumber(ARGV[ARG_LAST_USED_EVERY_S])) then
  redis.call("HSET", KEYS[2], "last_used_at", ARGV[ARG_NOW])
end
return {owner, left, record[3] or ""}
