-- batch_finish.lua: mark a batch COMPLETED once every line has ended
-- (store/batches.py, BatchStore.finish), once: the caller that gets
-- "FINISHED" owes its batch.completed webhook. Its keys are then kept for
-- the retention, as its last line's request is.
--
-- KEYS[1] W:batch:{id}  KEYS[2] W:batch:{id}:lines  KEYS[3] W:batch:{id}:results
-- KEYS[4] W:batches:open
-- ARGV by name (batches.py, FINISH_ARGS):
--   id          the batch id
--   now         Unix seconds
--   counts      the final counts (JSON), kept so reads need not count again
--   retention   seconds the batch is kept from now
--   webhook     "owed" when its batch.completed webhook is to be sent (the sweeper sends it), else ""
-- returns {"FINISHED"} | {"ALREADY"} | {"MISSING"}

local status = redis.call("HGET", KEYS[1], "status")
if not status then
  return {"MISSING"}
end
if status == "COMPLETED" then
  return {"ALREADY"}
end
redis.call("HSET", KEYS[1], "status", "COMPLETED", "completed_at", ARGV[ARG_NOW], "counts", ARGV[ARG_COUNTS])
redis.call("HDEL", KEYS[1], "drainer", "drain_until")
if ARGV[ARG_WEBHOOK] ~= "" then
  redis.call("HSET", KEYS[1], "webhook", ARGV[ARG_WEBHOOK])
end
redis.call("DEL", KEYS[2])
redis.call("EXPIRE", KEYS[1], ARGV[ARG_RETENTION])
redis.call("EXPIRE", KEYS[3], ARGV[ARG_RETENTION])
redis.call("ZREM", KEYS[4], ARGV[ARG_ID])
return {"FINISHED"}
