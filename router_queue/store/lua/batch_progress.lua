-- batch_progress.lua: record a drain's step (store/batches.py,
-- BatchStore.progress): its lines' outcomes and the cursor past them. Lines
-- are admitted in input order; the cursor is the count of lines with an
-- outcome (a line waiting for room stops it). Written again by a drain that
-- re-runs after a crash: each line's Idempotency-Key replays the same request
-- id, so writing it twice writes the same value.
--
-- KEYS[1] W:batch:{id}  KEYS[2] W:batch:{id}:results  KEYS[3] W:batch:{id}:lines
-- ARGV by name (batches.py, PROGRESS_ARGS):
--   upto     the cursor after this step
--   then line, outcome pairs
-- returns {cancelled ("1" or "0"), drained ("1" when every line has its outcome)}

local state = redis.call("HMGET", KEYS[1], "status", "cursor", "total", "cancelled")
if not state[1] then
  return {"1", "1"}
end
if #ARGV >= ARG_REST then
  local pairs_ = {}
  for i = ARG_REST, #ARGV do
    pairs_[#pairs_ + 1] = ARGV[i]
  end
  redis.call("HSET", KEYS[2], unpack(pairs_))
end
local cursor = math.max(tonumber(state[2]), tonumber(ARGV[ARG_UPTO]))
redis.call("HSET", KEYS[1], "cursor", cursor)
local drained = cursor >= tonumber(state[3])
if drained then
  redis.call("DEL", KEYS[3])  -- the bodies are in their requests now
end
return {state[4] or "0", drained and "1" or "0"}
