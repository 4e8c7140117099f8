-- positions.lua: the queue positions of one workspace's waiting requests of
-- one provider (lib/schedule.lua, position), for a history page. Reads only.
-- KEYS[1] P:sched:{provider}
-- ARGV[1] the workspace  ARGV[2..] the request ids
-- returns each request's position, or false when it no longer waits

local ranks = {}
for i = 2, #ARGV do
  ranks[#ranks + 1] = position(KEYS[1], ARGV[1], ARGV[i])
end
return ranks
