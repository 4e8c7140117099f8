-- ws_settle.lua: on a store split into per-slot steps, give a workspace what
-- a step of its request's provider owed it (lib/ledger.lua, owe_ws): the request's
-- start ("q": it no longer waits), its end ("e": its hold settled, its
-- body's bytes given back, its pending webhook too when it had no event left
-- to deliver, and "q" too if it never started), or its pending webhook
-- ("w": its last webhook event ended after the request did; lib/webhooks.lua,
-- webhook_ended). W:open says what the request still owes, so
-- each is applied once whoever applies it (the caller of the step, or the
-- sweeper for a caller that died), and in whichever order they arrive. Every
-- request has its entry (admission writes it; `ops migrate-keys` for one
-- admitted before its store was split): an effect with no entry was applied.
--
-- KEYS[1] W:ws  KEYS[2] W:ledger  KEYS[3] W:open
-- ARGV by name (owed.py, SETTLE_ARGS): effect (JSON: lib/ledger.lua, ws_effects,
--   with ws and kind)
-- (an entry's "w" is also admit_undo.lua's: it counted a pending webhook)
-- returns 1 when applied now, 0 when it already was

local e = cjson.decode(ARGV[ARG_EFFECT])
local open = redis.call("HGET", KEYS[3], e.request_id)
if not open then
  return 0
end
local owes = ({start = "q", ["end"] = "e", webhook = "w"})[e.kind]
if not string.find(open, owes, 1, true) then
  return 0
end
local left = string.gsub(open, owes, "")
if e.kind == "end" then
  if e.queued then
    if string.find(left, "q", 1, true) then
      left = string.gsub(left, "q", "")
    else
      e.queued = nil  -- its start was given already
    end
  end
  if e.webhooks then
    left = string.gsub(left, "w", "")  -- given with the end: no event of it was left
  end
end
ws_apply(KEYS[1], KEYS[2], e)
if not string.find(left, "[qew]") then
  redis.call("HDEL", KEYS[3], e.request_id)
else
  redis.call("HSET", KEYS[3], e.request_id, left)
end
return 1
