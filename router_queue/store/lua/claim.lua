-- claim.lua: a delivery takes a request to run it, exactly one at a time.
--
--   IN_QUEUE, not granted a slot       -> left waiting: a stale message; the
--                                         schedule grants it in its turn (one
--                                         admitted before the schedule existed
--                                         is put in it now)
--   IN_QUEUE, granted, past its queue  -> COMPLETED queue_timeout, never run;
--   timeout                               its slot goes to the next
--   IN_QUEUE, granted, past the        -> COMPLETED queue_timeout, never run
--   caller's start deadline
--   IN_QUEUE, granted, past the        -> COMPLETED cancelled, never run (as
--   caller's deadline                     the sweeper's cancel would have)
--   IN_QUEUE, granted                  -> IN_PROGRESS under a lease held by token
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
-- KEYS[1] rq:req:{id}  KEYS[2] rq:queue:{provider}  KEYS[3] rq:sched:{provider}
-- KEYS[4] rq:running:{provider}  KEYS[5] rq:ws:{workspace}  KEYS[6] rq:ledger:{workspace}
-- KEYS[7] the broker's list for the provider  KEYS[8] rq:deadlines:{provider}
-- KEYS[9] rq:body:{id}
-- ARGV[1] id  ARGV[2] now (s)  ARGV[3] lease (s)  ARGV[4] provider's cap on
-- requests in flight  ARGV[5] queue timeout (s)  ARGV[6] retention (s)
-- ARGV[7] token: unique to this execution   ARGV[8] most takeovers allowed
-- ARGV[9] resume key: "{task id}:{retry number}" of this execution, which
--         matches the record's "successor" only for the retry a holder left
-- ARGV[10] grant lease end (s)  ARGV[11] message template or ""
-- returns {code, granted ids to publish...}, code one of "CLAIMED" | "RESUMED"
--       | "WAITING" | "LEASED" | "QUEUE_TIMEOUT" | "DEADLINE" | "EXHAUSTED" | "COMPLETED" | "MISSING"

local now = tonumber(ARGV[2])
local rec = redis.call("HMGET", KEYS[1], "status", "created_at", "successor", "lease_until", "takeovers",
  "handed_back", "workspace", "seq", "priority", "start_deadline_at", "deadline_at")
local status = rec[1]
if not status then
  return {"MISSING"}
end
if status == "COMPLETED" then
  return {"COMPLETED"}
end
local S = sched_ctx(KEYS[3], KEYS[4], KEYS[7], ARGV[4], ARGV[2], ARGV[10], ARGV[11])

-- Ends the request unrun (queue timeout) or given up (workers kept dying):
-- the provider billed nothing we know of, so the hold is released, and its
-- slot goes to the next in the schedule.
local function finish(code, error_type, detail)
  finish_unbilled({req = KEYS[1], body = KEYS[9], queue = KEYS[2], ws = KEYS[5], ledger = KEYS[6],
    deadlines = KEYS[8], ws_id = rec[7]}, S,
    ARGV[1], ARGV[2], ARGV[6], status == "IN_QUEUE", error_type, detail)
  return with_granted(code, grant(S))
end

local function lease()
  local until_ = now + tonumber(ARGV[3])
  redis.call("HSET", KEYS[1], "token", ARGV[7], "holder", ARGV[9], "lease_until", tostring(until_))
  redis.call("HDEL", KEYS[1], "successor", "handed_back")
  redis.call("ZADD", KEYS[4], until_, ARGV[1])
end

if status == "IN_QUEUE" then
  if not redis.call("ZSCORE", KEYS[4], ARGV[1]) then
    if not redis.call("ZSCORE", S.base .. ":ws:" .. rec[7], ARGV[1]) then
      enqueue(S, rec[7], ARGV[1], tonumber(rec[8] or "0"), rec[9] or "normal")
      return with_granted("WAITING", grant(S))
    end
    return {"WAITING"}
  end
  if now - tonumber(rec[2]) > tonumber(ARGV[5]) then
    return finish("QUEUE_TIMEOUT", "queue_timeout",
      "waited in the queue longer than the model's queue timeout; never run, never billed")
  end
  if passed(rec[10], now) then
    return finish("QUEUE_TIMEOUT", "queue_timeout", START_DEADLINE_DETAIL)
  end
  if passed(rec[11], now) then
    return finish("DEADLINE", "cancelled", DEADLINE_DETAIL)
  end
  redis.call("HSET", KEYS[1], "status", "IN_PROGRESS", "started_at", ARGV[2])
  redis.call("ZREM", KEYS[8], "start|" .. ARGV[1])
  left_queue(KEYS[5])
  redis.call("ZREM", KEYS[2], ARGV[1])
  redis.call("ZREM", S.base .. ":granted", ARGV[1])
  lease()
  owe_started(KEYS[1], ARGV[1], ARGV[2])  -- its webhook's "started" event, if chosen (lib.lua)
  announce(ARGV[1], "IN_PROGRESS")
  announce_moved(KEYS[3])
  return {"CLAIMED"}
end

-- IN_PROGRESS
if rec[3] and rec[3] == ARGV[9] then
  lease()
  return {"RESUMED"}
end
if tonumber(rec[4] or "0") > now then
  return {"LEASED"}
end
if rec[6] == "1" then
  lease()
  return {"RESUMED"}
end
local takeovers = tonumber(rec[5] or "0") + 1
if takeovers > tonumber(ARGV[8]) then
  return finish("EXHAUSTED", "provider_error", "the request's worker was lost " .. (takeovers - 1) .. " times; giving up")
end
redis.call("HSET", KEYS[1], "takeovers", takeovers)
lease()
return {"RESUMED"}
