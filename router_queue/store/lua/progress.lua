-- progress.lua: how far the provider says a running generation is, kept
-- only while it grows, only from the execution holding the lease, and only
-- while the request runs; a change is announced on the request's event channel.
--
-- KEYS[1] rq:req:{id}
-- ARGV[1] request id  ARGV[2] the execution's lease token  ARGV[3] progress, 0..1
-- returns 1 when recorded, 0 when not (not running, not the holder, not more)

local status, token, current = unpack(redis.call("HMGET", KEYS[1], "status", "token", "progress"))
local progress = tonumber(ARGV[3])
if status ~= "IN_PROGRESS" or token ~= ARGV[2] or not progress or progress < 0 or progress > 1 then
  return 0
end
if current and tonumber(current) >= progress then
  return 0
end
redis.call("HSET", KEYS[1], "progress", ARGV[3])
announce_changed(ARGV[1])
return 1
