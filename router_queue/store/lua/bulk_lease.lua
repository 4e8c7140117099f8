-- bulk_lease.lua: take or give back the lease one bulk action's step runs
-- under, so two workers never run its steps at once (store/bulk.py).
-- KEYS[1] W:bulk:{bulk id}:lease
-- ARGV[1] "take" | "give"   ARGV[2] this step's token   ARGV[3] seconds ("take")
-- returns 1 when taken (or given back), 0 when another step holds it
if ARGV[1] == "take" then
  if redis.call("SET", KEYS[1], ARGV[2], "NX", "EX", ARGV[3]) then
    return 1
  end
  return 0
end
if redis.call("GET", KEYS[1]) == ARGV[2] then
  redis.call("DEL", KEYS[1])
  return 1
end
return 0
