-- webhook_take.lua: an attempt takes a pending webhook event to deliver it,
-- one attempt at a time, in its workspace's turn and past its endpoint's
-- circuit. The attempt holds the event for a lease: the event's due score
-- moves to the lease's end, so if the worker dies mid-delivery the sweeper
-- publishes the event again then (at least once, same webhook-id). It holds
-- one of its workspace's in-flight slots for the same lease, so a killed
-- worker's slot frees itself.
--
--   missing                     -> "MISSING" (and out of the due set)
--   delivered / gone / given up -> "DONE" (and out of the due set)
--   an attempt's lease is alive -> "BUSY": a duplicate message; nothing changes
--   before its next attempt     -> "NOT_DUE": an early message; nothing changes
--   its endpoint's circuit open -> "OPEN", at: due again at a random point of
--     the cooling after it ends (or, while another attempt probes the
--     endpoint, after a wait)
--   its workspace at its cap    -> "WAIT", at: due again after a wait
--   a wait past the retry window (counted from when the event was owed)
--     -> "GAVE_UP" (and the request's next event, if one is owed, takes its
--     place, due now)
--   else                        -> "TAKEN" with the event's fields; when the
--     circuit was open and its cooling over, this attempt is the probe
--
-- Waiting (OPEN, WAIT) is not an attempt: nothing is counted or logged. An
-- event that waits again and again waits longer each time (x2, up to x64:
-- its "waits" count, reset when it is taken), so a workspace's thousand
-- waiting events cost the webhooks worker a trickle of messages, not a
-- thousand every wait.
--
-- KEYS[1] rq:webhook:{id}   KEYS[2] rq:webhooks:due
-- KEYS[3] rq:webhooks:inflight:{ws}  KEYS[4] rq:webhooks:circuit:{ws}|{origin}
-- KEYS[5] rq:webhooks:inflight  KEYS[6] rq:ws:{ws} (its pending events count)
-- ARGV[1] request id  ARGV[2] now (s)  ARGV[3] lease (s)  ARGV[4] token of this attempt
-- ARGV[5] attempts in flight per workspace (0: no cap)  ARGV[6] the first wait (s)
-- ARGV[7] failures in a row that open a circuit (0: no circuit)
-- ARGV[8] retry window (s)  ARGV[9] seconds an ended event is kept
-- ARGV[10] an open circuit's cooling (s)  ARGV[11] a random number in [0, 1) (the jitter)
-- returns {"TAKEN", field, value, ...} | {"BUSY"} | {"NOT_DUE"} | {"OPEN", at} | {"WAIT", at}
--   | {"GAVE_UP"} | {"DONE"} | {"MISSING"}

local now = tonumber(ARGV[2])
local e = redis.call("HMGET", KEYS[1], "state", "next_at", "lease_until", "first_attempt_at", "owed_at",
  "counted")
if not e[1] then
  redis.call("ZREM", KEYS[2], ARGV[1])
  return {"MISSING"}
end
if e[1] ~= "pending" then
  redis.call("ZREM", KEYS[2], ARGV[1])
  return {"DONE"}
end
if tonumber(e[3] or "0") > now then
  return {"BUSY"}
end
if tonumber(e[2] or "0") > now then
  redis.call("ZADD", KEYS[2], e[2], ARGV[1])  -- the sweeper publishes it at its time
  return {"NOT_DUE"}
end

local lease_until = now + tonumber(ARGV[3])
local spread = tonumber(ARGV[11])

-- code, and when the event is due again given how long from now (or from
-- after, for an open circuit) and the span its waits spread over
local function defer(code, after, span)
  local waits = redis.call("HINCRBY", KEYS[1], "waits", 1)
  local at = after + span * 2 ^ math.min(waits - 1, 6) * spread
  local began = tonumber(e[5] or e[4] or ARGV[2])
  if at > began + tonumber(ARGV[8]) then
    redis.call("HSET", KEYS[1], "last_error", "still waiting its turn when the retry window ended")
    webhook_ended(KEYS[1], KEYS[6], ARGV[1], "given_up", ARGV[2], ARGV[9])
    return {"GAVE_UP"}
  end
  redis.call("ZADD", KEYS[2], at, ARGV[1])
  return {code, tostring(at)}
end

-- The endpoint's circuit: open once its failures in a row reach the threshold.
local probe = false
if tonumber(ARGV[7]) > 0 then
  local c = redis.call("HMGET", KEYS[4], "failures", "open_until", "probe_until")
  if tonumber(c[1] or "0") >= tonumber(ARGV[7]) then
    local open_until = tonumber(c[2] or "0")
    if open_until > now then
      return defer("OPEN", open_until, tonumber(ARGV[10]))
    end
    if tonumber(c[3] or "0") > now then
      return defer("OPEN", now, 2 * tonumber(ARGV[6]))  -- another attempt is probing it
    end
    probe = true
  end
end

-- The workspace's turn: at most ARGV[5] attempts in flight; a dead worker's
-- slot leaves at its lease's end.
local cap = tonumber(ARGV[5])
if cap > 0 then
  redis.call("ZREMRANGEBYSCORE", KEYS[3], "-inf", ARGV[2])
  if redis.call("ZCARD", KEYS[3]) >= cap then
    return defer("WAIT", now, 2 * tonumber(ARGV[6]))
  end
end
redis.call("ZADD", KEYS[3], lease_until, ARGV[4])
redis.call("EXPIRE", KEYS[3], math.ceil(tonumber(ARGV[3])) + 1)
redis.call("ZREMRANGEBYSCORE", KEYS[5], "-inf", ARGV[2])
redis.call("ZADD", KEYS[5], lease_until, ARGV[4])
if probe then
  redis.call("HSET", KEYS[4], "probe_until", tostring(lease_until))
end

redis.call("HINCRBY", KEYS[1], "attempts", 1)
redis.call("HSET", KEYS[1], "token", ARGV[4], "lease_until", tostring(lease_until), "last_attempt_at", ARGV[2],
  "waits", 0)
if not e[4] then
  redis.call("HSET", KEYS[1], "first_attempt_at", ARGV[2])
end
redis.call("ZADD", KEYS[2], lease_until, ARGV[1])
local reply = redis.call("HGETALL", KEYS[1])
table.insert(reply, 1, "TAKEN")
return reply
