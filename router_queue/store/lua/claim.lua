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
-- KEYS[1] P:req:{id}  KEYS[2] P:queue:{provider}  KEYS[3] P:sched:{provider}
-- KEYS[4] P:running:{provider}  KEYS[5] W:ws  KEYS[6] W:ledger
--         (or P:owed:{provider} in both places: ws_target, which the store's
--         consistency model links in, lua/effects/)
-- KEYS[7] the broker's list for the provider  KEYS[8] P:deadlines:{provider}
-- KEYS[9] P:body:{id}
-- ARGV by name (ARGV[ARG_ID] and so on; requests_delivery.py, CLAIM_ARGS):
--   id  now (s)  lease_s  cap (the provider's on requests in flight)
--   queue_timeout_s  retention (s)  token: unique to this execution
--   max_takeovers  resume_key: "{task id}:{retry number}" of this execution,
--                  which matches the record's "successor" only for the retry a holder left
--   grant_until (a grant's lease end, s)  template (the message template, or "")
--   low_headroom_pct (the cap's share kept from low priority: grant.lua's)
-- returns {code, granted ids to publish..., effects owed...}, code one of "CLAIMED" | "RESUMED"
--       | "WAITING" | "LEASED" | "QUEUE_TIMEOUT" | "DEADLINE" | "EXHAUSTED" | "COMPLETED" | "MISSING"

local now = tonumber(ARGV[ARG_NOW])
local rec = read_fields(KEYS[1], {"status", "created_at", "successor", "lease_until", "takeovers", "handed_back",
  "workspace", "seq", "priority", "start_deadline_at", "deadline_at", "webhook_url", "webhook_events"})
local status = rec.status
if not status then
  return {"MISSING"}
end
if status == "COMPLETED" then
  return {"COMPLETED"}
end
local S = sched_ctx(KEYS[3], KEYS[4], KEYS[7], ARGV[ARG_CAP], ARGV[ARG_NOW], ARGV[ARG_GRANT_UNTIL], ARGV[ARG_TEMPLATE],
  ARGV[ARG_LOW_HEADROOM_PCT])

-- Ends the request unrun (queue timeout) or given up (workers kept dying):
-- the provider billed nothing we know of, so the hold is released, and its
-- slot goes to the next in the schedule.
local function finish(code, error_type, detail)
  finish_unbilled(ws_target({req = KEYS[1], body = KEYS[9], queue = KEYS[2], deadlines = KEYS[8], ws_id = rec.workspace},
    KEYS[5], KEYS[6]), S,
    ARGV[ARG_ID], ARGV[ARG_NOW], ARGV[ARG_RETENTION], status == "IN_QUEUE", error_type, detail)
  return with_granted(code, grant(S))
end

-- The lease goes to this execution; `fields`, the record's other changes in
-- this step, are written with it (one HSET). successor and handed_back are
-- the previous holder's: deleted when the record has them (read above).
local function lease(fields)
  local until_ = now + tonumber(ARGV[ARG_LEASE_S])
  fields = fields or {}
  append(fields, "token", ARGV[ARG_TOKEN], "holder", ARGV[ARG_RESUME_KEY], "lease_until", tostring(until_))
  redis.call("HSET", KEYS[1], unpack(fields))
  if rec.successor or rec.handed_back then
    redis.call("HDEL", KEYS[1], "successor", "handed_back")
  end
  redis.call("ZADD", KEYS[4], until_, ARGV[ARG_ID])
end

if status == "IN_QUEUE" then
  if not redis.call("ZSCORE", KEYS[4], ARGV[ARG_ID]) then
    if not redis.call("ZSCORE", S.base .. ":ws:" .. rec.workspace, ARGV[ARG_ID]) then
      enqueue(S, rec.workspace, ARGV[ARG_ID], tonumber(rec.seq or "0"), rec.priority or "normal")
      return with_granted("WAITING", grant(S))
    end
    return {"WAITING"}
  end
  if now - tonumber(rec.created_at) > tonumber(ARGV[ARG_QUEUE_TIMEOUT_S]) then
    return finish("QUEUE_TIMEOUT", "queue_timeout",
      "waited in the queue longer than the model's queue timeout; never run, never billed")
  end
  if passed(rec.start_deadline_at, now) then
    return finish("QUEUE_TIMEOUT", "queue_timeout", START_DEADLINE_DETAIL)
  end
  if passed(rec.deadline_at, now) then
    return finish("DEADLINE", "cancelled", DEADLINE_DETAIL)
  end
  if rec.start_deadline_at then  -- admitted with a start deadline: it no longer needs it
    redis.call("ZREM", KEYS[8], "start|" .. ARGV[ARG_ID])
  end
  local e = ws_effects(ARGV[ARG_ID], ARGV[ARG_NOW])
  e.queued = 1  -- it no longer waits (lib/ledger.lua)
  owe_ws(ws_target({ws_id = rec.workspace}, KEYS[5], KEYS[6]), e, "start")
  redis.call("ZREM", KEYS[2], ARGV[ARG_ID])
  redis.call("ZREM", S.base .. ":granted", ARGV[ARG_ID])
  lease({"status", "IN_PROGRESS", "started_at", ARGV[ARG_NOW]})
  -- its webhook's "started" event, if chosen (lib/webhooks.lua)
  owe_started(KEYS[1], ARGV[ARG_ID], ARGV[ARG_NOW], rec.webhook_url, rec.webhook_events)
  announce(ARGV[ARG_ID], "IN_PROGRESS")
  announce_moved(KEYS[3])
  return with_granted("CLAIMED", {})
end

-- IN_PROGRESS
if rec.successor and rec.successor == ARGV[ARG_RESUME_KEY] then
  lease()
  return {"RESUMED"}
end
if tonumber(rec.lease_until or "0") > now then
  return {"LEASED"}
end
if rec.handed_back == "1" then
  lease()
  return {"RESUMED"}
end
local takeovers = tonumber(rec.takeovers or "0") + 1
if takeovers > tonumber(ARGV[ARG_MAX_TAKEOVERS]) then
  return finish("EXHAUSTED", "provider_error", "the request's worker was lost " .. (takeovers - 1) .. " times; giving up")
end
lease({"takeovers", takeovers})
return {"RESUMED"}
