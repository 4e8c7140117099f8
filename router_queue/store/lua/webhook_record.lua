-- webhook_record.lua: the event's part of what one webhook attempt came to,
-- with its provider's keys alone: the event's state and its place in the due
-- set. The workspace's part (the attempt's slot freed, its endpoint's
-- circuit, the attempt log) comes next (webhook_turn_end.lua), then the
-- failing endpoints every workspace shares (store/webhooks.py, record).
--
--   delivered (2xx)      -> state delivered, out of the due set
--   gone (410)           -> state gone: the receiver asked for no more
--   failed, next_at ""   -> state given_up: the retry window is over
--   failed               -> due again at next_at (the schedule's next delay)
--
-- An attempt whose lease ran out and was taken by another ("STALE") changes
-- nothing, unless it delivered: a 2xx ends the event whoever got it. Nor does
-- one at an event already ended ("DONE": its state, or another event of the
-- request holds the head); both are still logged. An event that ends makes
-- way for the request's next event owed, due at once (lib/webhooks.lua,
-- webhook_ended); the last of a completed request gives back the workspace's
-- pending count it held since its admission (admit.lua), once: its "counted"
-- mark goes in the same step, and the count is given in it or, on a store
-- split into per-slot steps, owed (lib/ledger.lua, owe_ws) and given by the caller.
--
-- KEYS[1] P:webhook:{id}  KEYS[2] P:webhook:due:{provider} (the one that holds it)
-- KEYS[3] W:ws  KEYS[4] W:ledger (its pending events count; or P:owed:{provider}
--   in both places: ws_target, which the store's consistency model links in, lua/effects/)
-- ARGV by name (ARGV[ARG_REQUEST_ID] and so on; store/webhooks.py,
-- RECORD_ARGS, whose order the generated ARG_* constants give):
--   request_id, token (the attempt's), now (s)
--   outcome            "delivered" | "gone" | "failed"
--   status             HTTP status or ""      error   the error, "" for none
--   next_at            next attempt at (s), "" to give up
--   keep_s             seconds an ended event is kept
--   msg_id             the event's webhook-id: an attempt at an event that
--                      already ended (the request's next one holds the head
--                      now) changes nothing
-- returns {"DELIVERED" | "GONE" | "GAVE_UP", effects owed...} | {"RETRY"} | {"STALE"} | {"DONE"}
--   | {"MISSING"} (nothing to log)

local outcome = ARGV[ARG_OUTCOME]
local e = redis.call("HMGET", KEYS[1], "state", "token", "msg_id", "workspace")
if not e[1] then
  return {"MISSING"}
end
if e[1] ~= "pending" or (e[3] or webhook_id(ARGV[ARG_REQUEST_ID])) ~= ARGV[ARG_MSG_ID] then
  return {"DONE"}
end
if e[2] ~= ARGV[ARG_TOKEN] and outcome ~= "delivered" then
  return {"STALE"}
end
redis.call("HSET", KEYS[1], "last_status", ARGV[ARG_STATUS], "last_error", ARGV[ARG_ERROR], "lease_until", 0)

-- the event ends; the request's next event, if one is owed, takes its place
local function finish(state, code)
  webhook_ended(KEYS[1], ws_target({ws_id = e[4] or ""}, KEYS[3], KEYS[4]), KEYS[2],
    ARGV[ARG_REQUEST_ID], state, ARGV[ARG_NOW], ARGV[ARG_KEEP_S])
  return with_granted(code, {})
end

if outcome == "delivered" then
  return finish("delivered", "DELIVERED")
end
if outcome == "gone" then
  return finish("gone", "GONE")
end
if ARGV[ARG_NEXT_AT] == "" then
  return finish("given_up", "GAVE_UP")
end
redis.call("HSET", KEYS[1], "next_at", ARGV[ARG_NEXT_AT])
redis.call("ZADD", KEYS[2], ARGV[ARG_NEXT_AT], ARGV[ARG_REQUEST_ID])
return {"RETRY"}
