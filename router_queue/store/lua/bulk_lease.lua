-- bulk_lease.lua: take or give back the lease one bulk action's step runs
-- under, so two workers never run its steps at once (store/bulk.py).
-- KEYS[1] W:bulk:{bulk id}:lease
-- ARGV (named, store/bulk.py LEASE_ARGS): act, "take" | "give"; token (this step's); seconds ("take")
-- returns 1 when taken (or given back), 0 when another step holds it
if ARGV[ARG_ACT] == "take" then
  if redis.call("SET", KEYS[1], ARGV[ARG_TOKEN], "NX", "EX", ARGV[ARG_SECONDS]) then
    return 1
  end
  return 0
end
if redis.call("GET", KEYS[1]) == ARGV[ARG_TOKEN] then
  redis.call("DEL", KEYS[1])
  return 1
end
return 0
