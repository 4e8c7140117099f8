-- webhook_take.lua: the event's part of an attempt taking a pending webhook
-- event, with its provider's keys alone; the workspace's part, its turn and
-- its endpoint's circuit, came first (webhook_turn.lua) and its answer is
-- given here as turn. Events are delivered one attempt at a time: the
-- attempt holds the event for a lease, its due score moved to the lease's
-- end, so if the worker dies mid-delivery the sweeper publishes the event
-- again then (at least once, same webhook-id).
--
--   missing                     -> "MISSING" (and out of the due set)
--   delivered / gone / given up -> "DONE" (and out of the due set)
--   an attempt's lease is alive -> "BUSY": a duplicate message; nothing changes
--   before its next attempt     -> "NOT_DUE": an early message; nothing changes
--   no turn asked (turn "": the caller read it just before as one of the
--     above, and a step that changed it since publishes it) -> "BUSY"
--   its endpoint's circuit open (turn "OPEN") -> "OPEN", at: due again at a
--     random point of the cooling after it ends ("PROBING": while another
--     attempt probes the endpoint, after a wait)
--   its workspace at its cap (turn "WAIT") -> "WAIT", at: due again after a wait
--   a wait past the retry window (counted from when the event was owed)
--     -> "GAVE_UP" (and the request's next event, if one is owed, takes its
--     place, due now; with none, the workspace's pending count given back:
--     lib/webhooks.lua, webhook_ended)
--   else (turn "HELD" or "PROBE") -> "TAKEN" with the event's fields
-- The caller gives back at once a turn held for an event not taken here
-- (webhook_turn_end.lua).
--
-- Waiting (OPEN, WAIT) is not an attempt: nothing is counted or logged. An
-- event that waits again and again waits longer each time (x2, up to x64:
-- its "waits" count, reset when it is taken), so a workspace's thousand
-- waiting events cost the webhooks worker a trickle of messages, not a
-- thousand every wait.
--
-- KEYS[1] P:webhook:{id}   KEYS[2] P:webhook:due:{provider} (the one that holds it)
-- KEYS[3] W:ws  KEYS[4] W:ledger (its pending events count; or P:owed:{provider}
--   in both places: ws_target, which the store's consistency model links in, lua/effects/)
-- ARGV by name (ARGV[ARG_REQUEST_ID] and so on; store/webhooks.py, TAKE_ARGS):
--   request_id  now (s)  lease_s  token (of this attempt)
--   turn: webhook_turn.lua's answer ("" when not asked)  open_until: its "OPEN"'s until
--   wait_s: the first wait  window_s: the retry window  keep_s: seconds an ended event is kept
--   circuit_cooling_s: an open circuit's cooling  jitter: a random number in [0, 1)
-- returns {"TAKEN", field, value, ...} | {"BUSY"} | {"NOT_DUE"} | {"OPEN", at} | {"WAIT", at}
--   | {"GAVE_UP", effects owed...} | {"DONE"} | {"MISSING"}

local now = tonumber(ARGV[ARG_NOW])
local e = redis.call("HMGET", KEYS[1], "state", "next_at", "lease_until", "first_attempt_at", "owed_at",
  "workspace")
if not e[1] then
  redis.call("ZREM", KEYS[2], ARGV[ARG_REQUEST_ID])
  return {"MISSING"}
end
if e[1] ~= "pending" then
  redis.call("ZREM", KEYS[2], ARGV[ARG_REQUEST_ID])
  return {"DONE"}
end
if tonumber(e[3] or "0") > now then
  return {"BUSY"}
end
if tonumber(e[2] or "0") > now then
  redis.call("ZADD", KEYS[2], e[2], ARGV[ARG_REQUEST_ID])  -- the sweeper publishes it at its time
  return {"NOT_DUE"}
end
local turn = ARGV[ARG_TURN]
if turn == "" then
  return {"BUSY"}
end

-- code, and when the event is due again given how long from now (or from
-- after, for an open circuit) and the span its waits spread over
local function defer(code, after, span)
  local waits = redis.call("HINCRBY", KEYS[1], "waits", 1)
  local at = after + span * 2 ^ math.min(waits - 1, 6) * tonumber(ARGV[ARG_JITTER])
  local began = tonumber(e[5] or e[4] or ARGV[ARG_NOW])
  if at > began + tonumber(ARGV[ARG_WINDOW_S]) then
    redis.call("HSET", KEYS[1], "last_error", "still waiting its turn when the retry window ended")
    webhook_ended(KEYS[1], ws_target({ws_id = e[6] or ""}, KEYS[3], KEYS[4]), KEYS[2],
      ARGV[ARG_REQUEST_ID], "given_up", ARGV[ARG_NOW], ARGV[ARG_KEEP_S])
    return with_granted("GAVE_UP", {})
  end
  redis.call("ZADD", KEYS[2], at, ARGV[ARG_REQUEST_ID])
  return {code, tostring(at)}
end

if turn == "OPEN" then
  return defer("OPEN", tonumber(ARGV[ARG_OPEN_UNTIL]), tonumber(ARGV[ARG_CIRCUIT_COOLING_S]))
end
if turn == "PROBING" then
  return defer("OPEN", now, 2 * tonumber(ARGV[ARG_WAIT_S]))
end
if turn == "WAIT" then
  return defer("WAIT", now, 2 * tonumber(ARGV[ARG_WAIT_S]))
end

local lease_until = now + tonumber(ARGV[ARG_LEASE_S])
redis.call("HINCRBY", KEYS[1], "attempts", 1)
redis.call("HSET", KEYS[1], "token", ARGV[ARG_TOKEN], "lease_until", tostring(lease_until), "last_attempt_at", ARGV[ARG_NOW],
  "waits", 0)
if not e[4] then
  redis.call("HSET", KEYS[1], "first_attempt_at", ARGV[ARG_NOW])
end
redis.call("ZADD", KEYS[2], lease_until, ARGV[ARG_REQUEST_ID])
local reply = redis.call("HGETALL", KEYS[1])
table.insert(reply, 1, "TAKEN")
return reply
