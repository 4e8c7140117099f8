-- batch_take.lua: take (or renew) a batch's drain lease, so one drain at a
-- time admits its lines (store/batches.py, BatchStore.take). Two drains
-- would admit nothing twice anyway (each line has its Idempotency-Key), but
-- would spend a round of admission each on every line.
--
-- KEYS[1] W:batch:{id}
-- ARGV by name (batches.py, TAKE_ARGS):
--   token       the drain's own
--   now         Unix seconds
--   lease_s     seconds the lease holds without a renewal
-- returns {"TAKEN", cursor, total, cancelled} | {"BUSY"} | {"DONE"} (drained, cancelled or finished) | {"MISSING"}

local state = redis.call("HMGET", KEYS[1], "status", "cursor", "total", "cancelled", "drainer", "drain_until")
if not state[1] then
  return {"MISSING"}
end
local cursor, total = tonumber(state[2]), tonumber(state[3])
if state[1] == "COMPLETED" or state[4] == "1" or cursor >= total then
  return {"DONE"}
end
local now = tonumber(ARGV[ARG_NOW])
if state[5] and state[5] ~= ARGV[ARG_TOKEN] and tonumber(state[6] or "0") > now then
  return {"BUSY"}
end
redis.call("HSET", KEYS[1], "drainer", ARGV[ARG_TOKEN], "drain_until", tostring(now + tonumber(ARGV[ARG_LEASE_S])))
return {"TAKEN", cursor, total, state[4] or "0"}
