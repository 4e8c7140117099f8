-- admit_undo.lua: on a store split into per-slot steps, give back an
-- admission's workspace part (admit_ws.lua) that its provider's part never
-- placed (refused, or given up by the sweeper: store/admission.py): its
-- waiting count, body bytes and pending webhook, its hold released with a
-- ledger entry, its idempotency reservation freed. Once: its open entry goes
-- in the same step. Its history entries stay; a listing skips a request
-- with no record.
--
-- KEYS[1] W:ws  KEYS[2] W:ledger  KEYS[3] W:idem:{keyhash}
-- KEYS[4] W:open
-- ARGV by name (admission.py, UNDO_ARGS): id (the request's)  price (its)
--   body_bytes (its body's)  now (s)  key_id (its caller's key, or "")
--   since (its admission's time, s; "" for now): its budgets' spend given back
-- returns 1 when given back now, 0 when there was nothing to give back

local open = redis.call("HGET", KEYS[4], ARGV[ARG_ID])
if not open or not string.find(open, "q", 1, true) or not string.find(open, "e", 1, true) then
  return 0
end
local e = ws_effects(ARGV[ARG_ID], ARGV[ARG_NOW])
e.queued, e.bytes, e.hold, e.how = 1, tonumber(ARGV[ARG_BODY_BYTES]), tonumber(ARGV[ARG_PRICE]), "release"
e.key, e.since = ARGV[ARG_KEY_ID], tonumber(ARGV[ARG_SINCE]) or tonumber(ARGV[ARG_NOW])
if string.find(open, "w", 1, true) then
  e.webhooks = 1
end
ws_apply(KEYS[1], KEYS[2], e)
local held = redis.call("GET", KEYS[3])
if held and string.sub(held, -(#ARGV[ARG_ID] + 1)) == "|" .. ARGV[ARG_ID] then
  redis.call("DEL", KEYS[3])
end
redis.call("HDEL", KEYS[4], ARGV[ARG_ID])
return 1
