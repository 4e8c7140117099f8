-- claim.lua: a delivery takes a request to run it, exactly one at a time.
--
--   IN_QUEUE, past its queue timeout   -> COMPLETED queue_timeout, never run
--   IN_QUEUE, provider at its cap      -> stays IN_QUEUE (the task retries later)
--   IN_QUEUE                           -> IN_PROGRESS under a lease held by token
--   IN_PROGRESS, resume key matches    -> resumed: the retry its holder scheduled
--                                         (the holder kept the lease for it)
--   IN_PROGRESS, live lease            -> left alone: someone alive runs it (a
--                                         duplicate or a broker redelivery)
--   IN_PROGRESS, handed back           -> resumed: a worker stopping warm gave
--                                         it up; not a takeover
--   IN_PROGRESS, lease expired         -> taken over (its worker died), unless
--                                         it was taken over too often already
--   COMPLETED / missing                -> nothing
--
-- KEYS[1] rq:req:{id}  KEYS[2] rq:queue:{provider}  KEYS[3] rq:due
-- KEYS[4] rq:running:{provider}  KEYS[5] rq:ws:{workspace}  KEYS[6] rq:ledger:{workspace}
-- ARGV[1] id  ARGV[2] now (s)  ARGV[3] lease (s)  ARGV[4] provider's cap on
-- requests in flight  ARGV[5] queue timeout (s)  ARGV[6] retention (s)
-- ARGV[7] token: unique to this execution   ARGV[8] most takeovers allowed
-- ARGV[9] resume key: "{task id}:{retry number}" of this execution, which
--         matches the record's "successor" only for the retry a holder left
-- returns "CLAIMED" | "RESUMED" | "NO_SLOT" | "LEASED" | "QUEUE_TIMEOUT"
--       | "EXHAUSTED" | "COMPLETED" | "MISSING"

local now = tonumber(ARGV[2])
local rec = redis.call("HMGET", KEYS[1], "status", "created_at", "successor", "lease_until", "takeovers",
  "handed_back")
local status = rec[1]
if not status then
  return "MISSING"
end
if status == "COMPLETED" then
  return "COMPLETED"
end

-- Ends the request unrun (queue timeout) or given up (workers kept dying):
-- the provider billed nothing we know of, so the hold is released.
local function finish(error_type, detail)
  finish_unbilled({req = KEYS[1], queue = KEYS[2], due = KEYS[3], running = KEYS[4], ws = KEYS[5], ledger = KEYS[6]},
    ARGV[1], ARGV[2], ARGV[6], status == "IN_QUEUE", error_type, detail)
end

local function lease()
  local until_ = now + tonumber(ARGV[3])
  redis.call("HSET", KEYS[1], "token", ARGV[7], "holder", ARGV[9], "lease_until", tostring(until_))
  redis.call("HDEL", KEYS[1], "successor", "handed_back")
  redis.call("ZADD", KEYS[4], until_, ARGV[1])
end

if status == "IN_QUEUE" then
  if now - tonumber(rec[2]) > tonumber(ARGV[5]) then
    finish("queue_timeout", "waited in the queue longer than the model's queue timeout; never run, never billed")
    return "QUEUE_TIMEOUT"
  end
  if redis.call("ZCARD", KEYS[4]) >= tonumber(ARGV[4]) then
    return "NO_SLOT"
  end
  redis.call("HSET", KEYS[1], "status", "IN_PROGRESS", "started_at", ARGV[2])
  left_queue(KEYS[5])
  redis.call("ZREM", KEYS[2], ARGV[1])
  redis.call("ZREM", KEYS[3], ARGV[1])
  lease()
  return "CLAIMED"
end

-- IN_PROGRESS
if rec[3] and rec[3] == ARGV[9] then
  lease()
  return "RESUMED"
end
if tonumber(rec[4] or "0") > now then
  return "LEASED"
end
if rec[6] == "1" then
  lease()
  return "RESUMED"
end
local takeovers = tonumber(rec[5] or "0") + 1
if takeovers > tonumber(ARGV[8]) then
  finish("provider_error", "the request's worker was lost " .. (takeovers - 1) .. " times; giving up")
  return "EXHAUSTED"
end
redis.call("HSET", KEYS[1], "takeovers", takeovers)
lease()
return "RESUMED"
