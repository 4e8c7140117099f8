-- grant_unsent.lua: grants whose message could not be published (the broker
-- apart from the store was away), made due at once: the sweeper's next run
-- publishes them again, instead of once their grant lease ends
-- (REPUBLISH_AFTER_SECONDS). Only a grant still waiting for its delivery
-- (IN_QUEUE) is touched, and only brought forward (LT), so a claimed
-- request's lease is never shortened.
--
-- KEYS[1] P:running:{provider}  KEYS[2..] P:req:{id} of each grant
-- ARGV by name (requests_base.py, GRANT_UNSENT_ARGS): due_at (s); then, from
--   ARGV[ARG_REST], the ids, in the order of KEYS[2..]
-- returns how many were made due

local due = 0
for i = 2, #KEYS do
  if redis.call("HGET", KEYS[i], "status") == "IN_QUEUE" then
    due = due + redis.call("ZADD", KEYS[1], "XX", "LT", "CH", ARGV[ARG_DUE_AT], ARGV[ARG_REST + i - 2])
  end
end
return due
