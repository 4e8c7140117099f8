-- admit_ws.lua: on a store split into per-slot steps, admission's first
-- step, the workspace's part (lib/admission.lua, Admission): the caller's rate windows,
-- the idempotency key, the quotas and credits checked, then the counts, the
-- hold and its ledger entry, the history's entries, the idempotency
-- reservation and the request's open entry written. admit_place.lua places
-- the request next; if it never does, admit_undo.lua gives all this back
-- (store/admission.py).
--
-- KEYS[1] W:ws  KEYS[2] W:idem:{keyhash}  KEYS[3] W:ledger
-- KEYS[4] W:history  KEYS[5] W:history:{model}  KEYS[6] W:open
-- KEYS[7] W:stored  KEYS[8] W:batch:{batch_id} (as admit.lua's KEYS[17])
-- KEYS[9..] the caller's rate-window counters (as admit.lua's)
-- ARGV: admit.lua's (admission.py, ADMIT_ARGS); body "", body_bytes its length
-- returns {"RESERVED", what admit_place.lua records (JSON: reserve_admission)}
--       | admit.lua's refusals of the workspace's part, and {"EXPIRED"}
-- each but "RATE_LIMITED" and "EXPIRED" ending, as admit.lua's do, with where the
-- caller's rate windows stand once counted (admission.py moves it to the placed reply)

if past_deadline(ARGV[ARG_WRITE_DEADLINE]) then
  return {"EXPIRED"}
end
local W = {ws = KEYS[1], idem = KEYS[2], ledger = KEYS[3], history = KEYS[4], model_history = KEYS[5],
  open = KEYS[6], stored = KEYS[7], batch = KEYS[8], rate = 9}
-- What follows the count: the reservation, or the refusal that ends it.
local function reserve_counted()
  local bytes = tonumber(ARGV[ARG_BODY_BYTES])
  local ws, refused = admission_checks(W, bytes)
  if not ws then
    return refused
  end
  return {"RESERVED", cjson.encode(reserve_admission(W, ws, bytes))}
end

local reply = admission_opening(W) or reserve_counted()
if reply[1] ~= "RATE_LIMITED" then
  reply[#reply + 1] = rate_windows(W.rate)
end
return reply
