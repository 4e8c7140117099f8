-- progress.lua: how far the provider says a running generation is, kept
-- only while it grows, only from the execution holding the lease, and only
-- while the request runs; a change is announced on the request's event
-- channel, and owes the request's webhook a "progress" event when it chose
-- one (lib/webhooks.lua, owe_progress: a new one at most every ARGV[5] seconds).
--
-- KEYS[1] P:req:{id}
-- ARGV[1] request id  ARGV[2] the execution's lease token  ARGV[3] progress, 0..1
-- ARGV[4] now (s)  ARGV[5] seconds between a request's progress events
-- returns 0 when not recorded (not running, not the holder, not more), 1 when
-- recorded, 2 when recorded and a webhook event of the request is due now

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
if ARGV[4] and ARGV[4] ~= "" and owe_progress(KEYS[1], ARGV[1], ARGV[4], ARGV[5]) then
  return 2
end
return 1
