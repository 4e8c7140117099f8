-- member_release.lua: give back the slot a generation held on a member of its
-- provider's pool (store/members.py); once only, however often it is called.
-- KEYS: the pool's state hash, its slot leases   ARGV: named (below)
-- returns 1 when a slot was given back, 0 when none was held
local state, leases = KEYS[1], KEYS[2]
local member = ARGV[ARG_MEMBER]
if redis.call("ZREM", leases, member .. "|" .. ARGV[ARG_REQUEST_ID]) == 0 then
  return 0
end
if tonumber(redis.call("HINCRBY", state, member .. ":in_flight", -1)) < 0 then
  redis.call("HSET", state, member .. ":in_flight", 0)
end
return 1
