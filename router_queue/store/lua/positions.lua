-- positions.lua: the queue positions of one workspace's waiting requests of
-- one provider (lib/schedule.lua, position), for a history page. Reads only.
-- KEYS[1] P:sched:{provider}
-- ARGV by name (requests_front.py, POSITIONS_ARGS): workspace; then, from
--   ARGV[ARG_REST], the request ids
-- returns each request's position, or false when it no longer waits

local ranks = {}
for i = ARG_REST, #ARGV do
  ranks[#ranks + 1] = position(KEYS[1], ARGV[ARG_WORKSPACE], ARGV[i])
end
return ranks
