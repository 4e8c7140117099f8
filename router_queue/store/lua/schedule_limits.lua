-- schedule_limits.lua: an operator changed a workspace's weight or
-- max_in_flight (accounts.py): update the copy a provider's schedule keeps
-- while the workspace has requests waiting there (lib/schedule.lua, ws_limits), so its
-- next grant follows the new limits. A workspace with nothing waiting has no
-- copy; its next admission writes one from its hash.
--
-- KEYS[1] P:sched:{provider}
-- ARGV by name (accounts.py, LIMITS_ARGS): workspace (its id)
--   limits ("{weight}:{max_in_flight}")
-- returns 1 when the schedule held a copy (now updated), else 0

local field = "lim|" .. ARGV[ARG_WORKSPACE]
local copy = redis.call("HGET", KEYS[1], field)
if not copy then
  return 0
end
-- the group its pin waits in stays while it waits (lib/pins.lua)
redis.call("HSET", KEYS[1], field, group_copy(ARGV[ARG_LIMITS], copy_group(copy)))
return 1
