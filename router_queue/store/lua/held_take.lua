-- held_take.lua: a held connection (a synchronous call, an event stream)
-- takes one of its workspace's slots, or is refused at the cap. Slots are
-- leased: the process holding one renews it (quotas.py, HeldSlots), so the
-- slots of a process that was killed lapse at their lease's end instead of
-- leaking; lapsed ones are dropped here before counting.
--
-- KEYS[1] W:held   KEYS[2] W:ws
-- ARGV by name (held.py, TAKE_ARGS): slot (its id)  now (s)  lease_until (s)
--   default_max (the cap unless the workspace sets its own max_held)
--   keep_s (seconds the set lives past its last lease: a workspace gone quiet leaves nothing)
-- returns {"TAKEN"} | {"FULL", held now}

redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", ARGV[ARG_NOW])
local cap = tonumber(redis.call("HGET", KEYS[2], "max_held") or ARGV[ARG_DEFAULT_MAX])
local held = redis.call("ZCARD", KEYS[1])
if held >= cap then
  return {"FULL", held}
end
redis.call("ZADD", KEYS[1], ARGV[ARG_LEASE_UNTIL], ARGV[ARG_SLOT])
redis.call("EXPIRE", KEYS[1], ARGV[ARG_KEEP_S])
return {"TAKEN"}
