-- admit_place.lua: on a store split into per-slot steps, admission's second
-- step, the provider's part (lib/admission.lua, Admission): the request a retry
-- submits again and whether the provider is draining checked, then the
-- record, its body, deadlines and place in the schedule written, granted at
-- once when a slot is free. It runs only while its admission is still
-- pending in P:admitting:{provider} (written before admit_ws.lua), and
-- takes it out in the same step: once the sweeper has given an admission up
-- (and undone its workspace's part) it can no longer be placed.
--
-- KEYS[1] P:req:{id}  KEYS[2] P:queue:{provider}  KEYS[3] P:seq:{provider}
-- KEYS[4] P:sched:{provider}  KEYS[5] P:running:{provider}
-- KEYS[6] the broker's list for the provider  KEYS[7] P:req:{original}
-- KEYS[8] P:body:{original} (as admit.lua's)  KEYS[9] P:deadlines:{provider}
-- KEYS[10] P:body:{id}  KEYS[11] P:admitting:{provider}
-- ARGV: admit.lua's (admission.py, ADMIT_ARGS); reserved: admit_ws.lua's
-- answer; admitting: this admission's member of P:admitting:{provider}
-- returns admit.lua's "ADMITTED" | its refusals of the provider's part | {"EXPIRED"}

if past_deadline(ARGV[ARG_WRITE_DEADLINE]) or not redis.call("ZSCORE", KEYS[11], ARGV[ARG_ADMITTING]) then
  return {"EXPIRED"}
end
local P = {req = KEYS[1], queue = KEYS[2], seq = KEYS[3], sched = KEYS[4], running = KEYS[5], list = KEYS[6],
  original = KEYS[7], original_body = KEYS[8], deadlines = KEYS[9], body = KEYS[10]}
local src, refused = admission_source(P)
if not src then
  return refused
end
redis.call("ZREM", KEYS[11], ARGV[ARG_ADMITTING])
return place_admission(P, src, cjson.decode(ARGV[ARG_RESERVED]))
