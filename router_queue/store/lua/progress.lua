-- progress.lua: how far the provider says a running generation is, kept
-- only while it grows, only from the execution holding the lease, and only
-- while the request runs; a change is announced on the request's event
-- channel, and owes the request's webhook a "progress" event when it chose
-- one (lib/webhooks.lua, owe_progress: a new one at most every every_s seconds).
--
-- KEYS[1] P:req:{id}
-- ARGV by name (requests_delivery.py, PROGRESS_ARGS): id (the request's)  token (the
--   execution's lease token)  progress (0..1)  now (s)
--   every_s (seconds between a request's progress events)
-- returns 0 when not recorded (not running, not the holder, not more), 1 when
-- recorded, 2 when recorded and a webhook event of the request is due now

local status, token, current = unpack(redis.call("HMGET", KEYS[1], "status", "token", "progress"))
local progress = tonumber(ARGV[ARG_PROGRESS])
if status ~= "IN_PROGRESS" or token ~= ARGV[ARG_TOKEN] or not progress or progress < 0 or progress > 1 then
  return 0
end
if current and tonumber(current) >= progress then
  return 0
end
redis.call("HSET", KEYS[1], "progress", ARGV[ARG_PROGRESS])
announce_changed(ARGV[ARG_ID])
if ARGV[ARG_NOW] and ARGV[ARG_NOW] ~= "" and owe_progress(KEYS[1], ARGV[ARG_ID], ARGV[ARG_NOW], ARGV[ARG_EVERY_S]) then
  return 2
end
return 1
