-- held_take.lua: a held connection (a synchronous call, an event stream)
-- takes one of its workspace's slots, or is refused at the cap. Slots are
-- leased: the process holding one renews it (quotas.py, HeldSlots), so the
-- slots of a process that was killed lapse at their lease's end instead of
-- leaking; lapsed ones are dropped here before counting.
--
-- KEYS[1] W:held   KEYS[2] W:ws
-- ARGV[1] slot id  ARGV[2] now (s)  ARGV[3] lease end (s)
-- ARGV[4] the cap unless the workspace sets its own max_held
-- ARGV[5] seconds the set lives past its last lease (a workspace gone quiet leaves nothing)
-- returns {"TAKEN"} | {"FULL", held now}

redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", ARGV[2])
local cap = tonumber(redis.call("HGET", KEYS[2], "max_held") or ARGV[4])
local held = redis.call("ZCARD", KEYS[1])
if held >= cap then
  return {"FULL", held}
end
redis.call("ZADD", KEYS[1], ARGV[3], ARGV[1])
redis.call("EXPIRE", KEYS[1], ARGV[5])
return {"TAKEN"}
